"""The clipped sum of :class:`~lightning_dp.clipping.clipper.PerSampleClipper` by book-keeping, the zeroing of
non-finite entries, and :func:`add_to_grad` (docs/design.md sections 4.4 and 9.2). A stateless mixin.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_dp.clipping.float32_sums import add_float32_sum, keeps_float32_sum
from lightning_dp.clipping.groups import ClippingGroups
from lightning_dp.clipping.hooks import Capture
from lightning_dp.clipping.rows import extreme_entries
from lightning_dp.clipping.terms import Factored, Materialised, Term, Writable, batch_sum
from lightning_dp.runtime.sharding import is_sharded, sum_into_shard


def _allocates_memory(terms: dict[nn.Parameter, list[Term]], group: list[Capture]) -> bool:
    """Whether a factored term of ``group`` holds a new dense tensor rather than views of the captures."""
    captured = {t.untyped_storage().data_ptr() for c in group for t in (c.activation, c.output_grad) if t is not None}
    for param_terms in terms.values():
        for term in param_terms:
            if isinstance(term, Factored):
                dense = [term.right] if term.is_index else [term.left, term.right]
                if any(t.untyped_storage().data_ptr() not in captured for t in dense):
                    return True
    return False


def output_gradients(captures: list[Capture]) -> Writable:
    """The :data:`~lightning_dp.clipping.terms.Writable` of the clipped sum: a tensor sharing storage with a capture's
    output gradient (a result of the clipper's own backward, which nothing reads after the sum)."""
    storages = {c.output_grad.untyped_storage().data_ptr() for c in captures if c.output_grad is not None}
    return lambda tensor: tensor.untyped_storage().data_ptr() in storages


def exceeded(
    norms: torch.Tensor, bound: float, group_norms: torch.Tensor | None, groups: ClippingGroups | None
) -> torch.Tensor:
    """``[B]`` bool: the samples whose norm ``norms`` ``[B]`` exceeds ``bound``, or with groups whose norm in some group
    (``group_norms`` ``[G, B]``) exceeds that group's bound."""
    if groups is None or group_norms is None:
        return norms > bound
    bounds = group_norms.new_tensor(groups.bounds)
    return (group_norms > bounds[:, None]).any(0)


def add_to_grad(param: nn.Parameter, clipped: torch.Tensor) -> None:
    """``param.grad += clipped`` (created when None; cast to ``param``'s dtype), ``clipped`` this rank's full-size
    clipped sum; a sharded ``param`` gets its shard of the sum over ranks (a collective,
    :func:`~lightning_dp.runtime.sharding.sum_into_shard`). A 16-bit ``param`` (not sharded) keeps the sum in float32
    beside its ``.grad`` instead (:mod:`~.float32_sums`).
    """
    if keeps_float32_sum(param):
        add_float32_sum(param, clipped)
        return
    clipped = clipped.to(param.dtype)
    if is_sharded(param):
        clipped = sum_into_shard(clipped, param)
    if param.grad is None:
        param.grad = clipped
    else:
        param.grad.add_(clipped)


def without_overflow(factors: torch.Tensor, terms: list[Term]) -> torch.Tensor:
    """``factors`` ``[B]`` with 0 for every sample whose weighted factor in :meth:`Factored.batch_sum` would overflow
    in some term of the parameter (``terms``): a factor above 1 (automatic clipping, or a loss scale below 1) times the
    largest entry of the factor's rows that count (:attr:`Factored.active`; ``large_weights`` zeroes the others before
    the scaling, so that whether a sample is kept does not depend on the rows its batch was padded to). Only that
    scaling can overflow for a kept sample (the products it forms are at most ``C / sqrt(r)``, docs/design.md
    section 4.11), and zeroing the sample in every term of the parameter keeps its contribution a restriction of its
    clipped gradient to whole parameters, of norm at most the bound. A sample whose terms are not finite is dropped
    anyway (factor 0). No host read.
    """
    keep = torch.ones_like(factors, dtype=torch.bool)
    for term in terms:
        if isinstance(term, Factored):  # its rows that do not count are zeroed before the scaling (large_weights)
            factor = term.right if term.scales_right else term.left
            low, high = extreme_entries(factor.detach())  # max |x| = max(high, -low), without a copy of |x|
            peak = torch.where(term.active, torch.maximum(high, low.neg()), 0.0).amax(1)
            keep &= torch.isfinite(factors.to(factor.dtype) * peak)
    return torch.where(keep, factors, 0.0)


class ClippedSumMixin:
    """Book-keeping of the clipped sum and masking of non-finite samples (a base of the clipper)."""

    #: whether a sample was dropped since construction: a Python bool, or a 0-dim bool tensor on the device that the
    #: steps OR into without reading it (:attr:`dropped_nonfinite` reads it).
    _dropped: torch.Tensor | bool
    _group_of: dict[nn.Parameter, int]
    groups: ClippingGroups | None
    max_grad_norm: float
    clipping_fn: str
    _loss_scale: float  # of LossScaleMixin, another base of PerSampleClipper
    last_group_norms: torch.Tensor | None
    _past_finite: torch.Tensor | None
    # a method of SampleNormsMixin, another base of PerSampleClipper
    _terms: Callable[[list[Capture], int], dict[nn.Parameter, list[Term]]]

    def _kept_for_sum(
        self,
        terms: dict[nn.Parameter, list[Term]],
        group: list[Capture],
        grads: dict[nn.Parameter, torch.Tensor],
    ) -> dict[nn.Parameter, list[Term]] | list[Capture]:
        """What one group's clipped sum needs: its terms when they are views of the captures, else the captures;
        engine-formed per-sample gradients (``grads``) replace their parameter's terms (the captures are released when
        all do).
        """
        rest = {param: param_terms for param, param_terms in terms.items() if param not in grads}
        if _allocates_memory(rest, group):
            return group
        if not rest:
            for capture in group:
                capture.release()
        # in the order of ``terms``: on a sharded model the sums are collectives, issued in the same order on every
        # rank (which parameters got per-sample gradients may differ between ranks)
        return {param: [Materialised(grads[param])] if param in grads else rest[param] for param in terms}

    @property
    def dropped_nonfinite(self) -> bool:
        """Whether any sample has been dropped for a non-finite loss or norm since construction (see
        :meth:`~lightning_dp.clipping.clipper.PerSampleClipper.backward`). Reading it is a host sync: it is read at the
        end of a run, never per step (the steps keep the flag on the device)."""
        return bool(self._dropped)

    @dropped_nonfinite.setter
    def dropped_nonfinite(self, value: torch.Tensor | bool) -> None:
        self._dropped = value

    def clip_fraction(self, norms: torch.Tensor) -> Callable[[], float]:
        """A function that computes and reads (one host sync) the fraction of the last clipped batch's samples whose
        norm ``norms`` (or a group's norm) exceeded its bound; the bound and group norms are kept now, since adaptive
        clipping moves the bound after the step. A diagnostic, never privatised; no step calls it."""
        bound, group_norms, groups = self.max_grad_norm, self.last_group_norms, self.groups
        return lambda: float(exceeded(norms, bound, group_norms, groups).float().mean())

    def clipped_samples(self, norms: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: the samples of the last clipped batch whose norm ``norms`` (or a group's norm) exceeded its
        bound (a diagnostic, never privatised)."""
        return exceeded(norms, self.max_grad_norm, self.last_group_norms, self.groups)

    def _finite_samples(self, norms: torch.Tensor, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool, the samples whose loss (at every iterate) and norm are finite; ORs "one was not" into the
        device flag behind :attr:`dropped_nonfinite`. No host sync (docs/design.md section 9.2): the caller masks
        with it whether or not a sample is dropped, so no step reads it.
        """
        keep = torch.isfinite(norms) & torch.isfinite(per_sample_loss.detach())
        if self._past_finite is not None:
            keep = keep & self._past_finite
        dropped = ~keep.all()
        self._dropped = dropped if isinstance(self._dropped, bool) and not self._dropped else self._dropped | dropped
        return keep

    def _add_clipped_sum(
        self,
        kept: list[dict[nn.Parameter, list[Term]] | list[Capture]],
        batch: int,
        factors: torch.Tensor,
        writable: Writable,
    ) -> None:
        """Book-keeping: ``p.grad += sum_u sum_i c_gi term_ui`` per parameter, group by group, ``factors`` ``[G, B]``
        (0 for a dropped sample). The terms' non-finite entries, a dropped sample's only, are zeroed first, in place in
        the tensors ``writable`` accepts (:func:`~lightning_dp.clipping.terms.finite`): a no-op on finite terms, so the
        sum is the same bits whether or not a sample was dropped, and no host read decides anything.
        """
        large = self.clipping_fn == "automatic" or self._loss_scale < 1  # factors above 1: a scaled factor may overflow
        for item in kept:
            terms = item if isinstance(item, dict) else self._terms(item, batch)
            for param, param_terms in terms.items():
                param_factors = factors[0 if self.groups is None else self._group_of[param]]
                if large:
                    param_factors = without_overflow(param_factors, param_terms)
                add_to_grad(param, batch_sum(param_terms, param_factors, writable, large))
