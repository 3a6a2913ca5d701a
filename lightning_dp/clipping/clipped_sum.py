"""The clipped sum of :class:`~lightning_dp.clipping.clipper.PerSampleClipper` by book-keeping (docs/design.md
sections 4.4 and 9.2): what each group of captures keeps for it while the norms are taken, the masking of samples
whose loss or norm is not finite, and ``p.grad += sum_i c_i term_i``; and :func:`add_to_grad`, how the clipped sum
reaches ``p.grad``, on a sharded parameter its shard. The mixin holds no state of its own: it reads the clipper's
attributes (set by ``PerSampleClipper.__init__``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_dp.clipping.groups import ClippingGroups
from lightning_dp.clipping.hooks import Capture
from lightning_dp.clipping.terms import Factored, Materialised, Term
from lightning_dp.runtime.sharding import is_sharded, sum_into_shard


def _allocates_memory(terms: dict[nn.Parameter, list[Term]], group: list[Capture]) -> bool:
    """Whether a factored term of ``group`` holds a new dense tensor (conv patches, a dtype cast) rather than views
    of the captured activations and output gradients. Materialised terms are not counted: most are of vector-sized
    parameters (a weight-standardised convolution's weight term is an exception, docs/design.md section 4.2)."""
    captured = {t.untyped_storage().data_ptr() for c in group for t in (c.activation, c.output_grad) if t is not None}
    for param_terms in terms.values():
        for term in param_terms:
            if isinstance(term, Factored):
                dense = [term.right] if term.is_index else [term.left, term.right]
                if any(t.untyped_storage().data_ptr() not in captured for t in dense):
                    return True
    return False


def add_to_grad(param: nn.Parameter, clipped: torch.Tensor) -> None:
    """``param.grad += clipped`` (created when None), ``clipped`` being this rank's clipped sum of ``param``, full
    size (``param``'s global shape), cast to ``param``'s dtype. For a sharded ``param`` the sum over all ranks goes
    in, this rank's shard of it (:func:`~lightning_dp.runtime.sharding.sum_into_shard`, one reduce-scatter: a collective
    that every rank issues for the same parameters in the same order)."""
    clipped = clipped.to(param.dtype)
    if is_sharded(param):
        clipped = sum_into_shard(clipped, param)
    if param.grad is None:
        param.grad = clipped
    else:
        param.grad.add_(clipped)


class ClippedSumMixin:
    """Book-keeping of the clipped sum and masking of non-finite samples for
    :class:`~lightning_dp.clipping.clipper.PerSampleClipper` (a base class of it, not used alone)."""

    dropped_nonfinite: bool
    _group_of: dict[nn.Parameter, int]
    groups: ClippingGroups | None
    _past_finite: torch.Tensor | None
    # a method of SampleNormsMixin, another base of PerSampleClipper
    _terms: Callable[[list[Capture], int], dict[nn.Parameter, list[Term]]]

    def _kept_for_sum(
        self,
        terms: dict[nn.Parameter, list[Term]],
        group: list[Capture],
        grads: dict[nn.Parameter, torch.Tensor],
    ) -> dict[nn.Parameter, list[Term]] | list[Capture]:
        """What the clipped sum of one group needs: its terms (of the current and the past iterates) when they are
        views of the captures (nothing new held), else the captures, whose terms are then formed again. Per-sample
        gradients the engine formed (``grads``) replace their parameter's terms; when they replace every term, the
        group's captured tensors are released."""
        rest = {param: param_terms for param, param_terms in terms.items() if param not in grads}
        if _allocates_memory(rest, group):
            return group
        if not rest:
            for capture in group:
                capture.release()
        # in the order of ``terms``: on a sharded model the sums are collectives, issued in the same order on every
        # rank (which parameters got per-sample gradients may differ between ranks)
        return {param: [Materialised(grads[param])] if param in grads else rest[param] for param in terms}

    def _finite_samples(self, norms: torch.Tensor, per_sample_loss: torch.Tensor) -> torch.Tensor | None:
        """``[B]`` bool, the samples whose loss (now and at every past iterate) and norm are finite, or ``None``
        when all are (one host sync).

        A non-finite value in a sample's per-sample terms makes its norm non-finite: every term entry enters the
        norm through sums and products (``x * inf`` is ``inf`` or NaN, never finite), so the norm is the one place to
        look. A finite norm that overflowed (``inf`` from finite terms) drops the sample too.
        """
        keep = torch.isfinite(norms) & torch.isfinite(per_sample_loss.detach())
        if self._past_finite is not None:
            keep = keep & self._past_finite
        if bool(keep.all()):
            return None
        self.dropped_nonfinite = True
        return keep

    def _add_clipped_sum(
        self,
        kept: list[dict[nn.Parameter, list[Term]] | list[Capture]],
        batch: int,
        factors: torch.Tensor,
        keep: torch.Tensor | None,
    ) -> None:
        """Book-keeping: ``p.grad += sum_u sum_i c_gi term_ui`` per parameter, group by group (terms kept by
        :meth:`_norms`, or formed again from a group of captures), ``factors`` ``[G, B]`` and ``g`` the parameter's
        clipping group (0 for flat clipping). With ``keep`` (``[B]`` bool, the samples whose quantities are all
        finite), the terms of the other samples are zeroed first (their factor is 0 already, but ``0 * inf`` is
        NaN)."""
        for item in kept:
            terms = item if isinstance(item, dict) else self._terms(item, batch)
            for param, param_terms in terms.items():
                if keep is not None:
                    param_terms = [term.masked(keep) for term in param_terms]
                param_factors = factors[0 if self.groups is None else self._group_of[param]]
                clipped = param_terms[0].batch_sum(param_factors)
                for term in param_terms[1:]:
                    clipped = clipped + term.batch_sum(param_factors)
                add_to_grad(param, clipped)
