"""The per-sample norms of :class:`~lightning_dp.clipping.clipper.PerSampleClipper`, the checks that its captures'
rows are examples', and the wiring of the sum check (docs/design.md sections 4.1, 4.3, 4.5 and 9.3). A mixin over the
clipper's attributes.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from lightning_dp.clipping.engines.base import ClippingEngine
from lightning_dp.clipping.groups import ClippingGroups
from lightning_dp.clipping.hooks import Capture, CaptureHooks
from lightning_dp.clipping.layers.registry import MisplacedParametersError, UnsupportedModuleError
from lightning_dp.clipping.loss_scaling import unscale_norms
from lightning_dp.clipping.multiplicity import check_rows
from lightning_dp.clipping.recomputation import reentrant_refused
from lightning_dp.clipping.rounding import rounded_norm_bound, underflow_scale
from lightning_dp.clipping.sum_check import VERIFY_RTOL, VERIFY_RTOL_REDUCED, SumCheck
from lightning_dp.clipping.terms import Term
from lightning_dp.clipping.underflow import underflow_bound


@dataclass
class _ScheduleSlot:
    """One micro-batch's place in the sum check's schedule: whether it is due (decided at its first pass), whether a
    pass ran, and whether a due pass saw non-finite samples (the check then says nothing: due again)."""

    due: bool | None = None
    ran: bool = False
    inconclusive: bool = False


def reported_norms(
    totals: torch.Tensor, scales: torch.Tensor, norm: int, epsilon: float, loss_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-sample norms the clipper reports and clips by, from the engines' ``totals`` and rounding ``scales``
    (``[G, B]``, in the backward's units scaled by ``loss_scale``; :meth:`SampleNormsMixin._norms`): the squared l2
    (``norm=2``, a Gram product's near-zero square rounded below 0 read as 0, NaN kept) or l1 norms in unscaled units,
    and the bounds ``nu`` (:func:`~.rounding.rounded_norm_bound`, ``epsilon`` the per-sample arithmetic's) still in the
    scaled units (:func:`~.loss_scaling.unscale_linear` divides them). Where ``nu`` is infinite (an overflowing rounding
    scale: factor 0 on every path) the norm is ``inf``, not what overflow left beside it, which the padded length moved
    (docs/design.md section 4.10), so the sample is dropped and counted as clipped.
    """
    if norm == 2:
        totals = totals.clamp_min(0)
    bound = rounded_norm_bound(totals.detach(), scales.detach(), norm, epsilon)
    return unscale_norms(torch.where(bound.isinf(), math.inf, totals), loss_scale, norm), bound


def _shared_parameter_groups(
    captures: list[Capture], registered: dict[tuple[int, str], nn.Parameter]
) -> list[list[Capture]]:
    """Split captures into groups closed under sharing a parameter (keyed by ``(id(module), attribute)`` in
    ``registered``); each group's terms are freed before the next (docs/design.md section 4.4).
    """
    groups: list[tuple[set[int], list[Capture]]] = []
    for capture in captures:
        params = {id(registered[key]) for key in _keys(capture) if key in registered}
        joined = [group for group in groups if group[0] & params]
        for group in joined:
            groups.remove(group)
            params |= group[0]
        groups.append((params, [c for group in joined for c in group[1]] + [capture]))
    return [members for _, members in groups]


def _keys(capture: Capture) -> list[tuple[int, str]]:
    """The ``(id(module), attribute)`` keys of the parameters of ``capture``'s module."""
    return [(id(capture.module), attr) for attr in capture.leaves]


class SampleNormsMixin:
    """Per-sample norms and the sum check of :class:`~lightning_dp.clipping.clipper.PerSampleClipper` (its base)."""

    module: nn.Module
    norm: int
    sum_check_every: int | None
    _engine: ClippingEngine
    _hooks: CaptureHooks
    _params: list[nn.Parameter]
    _names: dict[nn.Parameter, str]
    _registered: dict[tuple[int, str], nn.Parameter]
    _checked_batches: int
    #: the sum check's schedule slot of the running micro-batch once the engine groups its passes (:meth:`start_batch`)
    _slot: _ScheduleSlot | None
    #: modules whose folded (``B K r``) or expanded rows were seen to keep each example's rows its own
    _rows_verified: set[str]
    _sharded: bool
    _generator_for: Callable[[torch.device], torch.Generator] | None
    _past: list[Capture]
    _group_of: dict[nn.Parameter, int]
    groups: ClippingGroups | None
    augmentation_multiplicity: int
    # of PerSampleClipper and its other base ClippedSumMixin
    _kept_for_sum: Callable[
        [dict[nn.Parameter, list[Term]], list[Capture], dict[nn.Parameter, torch.Tensor]],
        dict[nn.Parameter, list[Term]] | list[Capture],
    ]

    if TYPE_CHECKING:

        @property
        def _norm_dtype(self) -> torch.dtype: ...  # PerSampleClipper's

        @property
        def _rounding_epsilon(self) -> float: ...  # PerSampleClipper's

    def _group_count(self) -> int:
        """``G``, the number of clipping groups (1 for flat clipping)."""
        return 1 if self.groups is None else len(self.groups.bounds)

    def _check_due(self) -> bool:
        """Whether this batch runs the sum check: on the first batch and every ``sum_check_every`` batches (every pass
        of a micro-batch whose first pass is due, after :meth:`start_batch`)."""
        if self.sum_check_every is None:
            return False
        due = self._checked_batches % self.sum_check_every == 0
        if self._slot is None:
            return due
        if self._slot.due is None:
            self._slot.due = due
        return self._slot.due

    def start_batch(self) -> None:
        """Begin a micro-batch: the clipped batches until the next call (its passes under ``max_physical_batch_size``)
        share one slot of the sum check's schedule, counted once (unless a due pass had non-finite samples), so that
        the schedule counts micro-batches whatever their sizes."""
        slot = self._slot
        if slot is not None and slot.ran and not (slot.due and slot.inconclusive):
            self._checked_batches += 1
        self._slot = _ScheduleSlot()

    def _count_check(self, conclusive: bool) -> None:
        """Count a clipped batch in the sum check's schedule (unless its check was over non-finite samples): at once,
        or in the running micro-batch's slot."""
        if self._slot is None:
            self._checked_batches += conclusive
        else:
            self._slot.ran = True
            self._slot.inconclusive |= not conclusive

    def _backward_pass(
        self, per_sample_loss: torch.Tensor, *, param_grads: bool, weight: float = 1.0
    ) -> tuple[list[Capture], dict[nn.Parameter, torch.Tensor | None]]:
        """One backward of ``weight * sum_i loss_i`` to the captured output edges; sets each capture's ``output_grad``.

        With ``param_grads`` also returns the parameter gradients (None where unreached; never written to ``.grad``) for
        the sum check. The graph is freed.

        Raises:
            MisplacedParametersError: (with ``param_grads``) parameters got a gradient but no hooked call did (the
                first named, all listed).
            ValueError: a region under reentrant activation checkpointing (``use_reentrant=True``).
        """
        if not per_sample_loss.requires_grad:
            raise ValueError("the per-sample loss does not require grad: it does not depend on trainable parameters")
        captures = self._hooks.captures
        leaves = self._forward_leaves(captures) if param_grads else []
        inputs = [c.edge for c in captures] + [leaf for _, leaf in leaves]
        total = per_sample_loss.sum() if weight == 1.0 else per_sample_loss.sum() * weight
        with self._hooks.suspended(), reentrant_refused():
            # edges and tensors mixed: torch.autograd.grad takes them, its annotation wants one kind
            grads = torch.autograd.grad(total, inputs, allow_unused=True)  # type: ignore[arg-type]
        for capture, grad in zip(captures, grads[: len(captures)], strict=True):
            capture.output_grad = None if grad is None else grad.view(capture.output_shape)
        reached = [c for c in captures if c.output_grad is not None]
        if not param_grads:
            return reached, {}
        batch_grads: dict[nn.Parameter, torch.Tensor | None] = dict.fromkeys(self._params)
        for (param, _), grad in zip(leaves, grads[len(captures) :], strict=True):
            if grad is not None:
                previous = batch_grads[param]
                batch_grads[param] = grad if previous is None else previous + grad
        captures = reached
        captured = {id(self._registered[key]) for c in captures for key in _keys(c) if key in self._registered}
        outside = [self._names[p] for p, g in batch_grads.items() if g is not None and id(p) not in captured]
        if outside:
            raise MisplacedParametersError(
                f"parameter '{outside[0]}' received a gradient but no hooked call of its module did: it is used "
                "outside its module's forward (e.g. functionally by a parent module, as F.linear(x, child.weight)); "
                "freeze it (requires_grad=False), train the model with LoRA, or use supported layers",
                parameters=tuple(outside),
            )
        return captures, batch_grads

    def _forward_leaves(self, captures: list[Capture]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each trainable parameter with the distinct tensors the forward used for it (under FSDP2, the unsharded
        ones)."""
        leaves: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        for capture in captures:
            for key in _keys(capture):
                if key in self._registered:
                    leaf = capture.leaves[key[1]]
                    leaves.setdefault(id(leaf), (self._registered[key], leaf))
        used = {id(param) for param, _ in leaves.values()}
        return list(leaves.values()) + [(p, p) for p in self._params if id(p) not in used]

    def _outside_use_error(self, failures: list[tuple[nn.Parameter, float, float]]) -> UnsupportedModuleError:
        details = ", ".join(
            f"'{self._names[p]}' (mismatch {diff:.3g} > tolerance {tol:.3g})" for p, diff, tol in failures
        )
        return UnsupportedModuleError(
            f"the per-sample gradients of parameter(s) {details} do not sum to their batch gradient: each is also "
            "used outside the forward of its module (e.g. functionally, as F.linear(x, module.weight), or in an L2 "
            "penalty added to the loss), and the gradient of that use would be lost (it never reaches .grad); "
            "route every use through the module, or freeze the parameter (requires_grad=False); for weight "
            "regularisation use the optimizer's weight_decay instead of a penalty term in the loss"
        )

    def _rows_per_example(self, capture: Capture, batch: int) -> int:
        """The rows of each example in ``capture`` (:func:`~lightning_dp.clipping.multiplicity.check_rows`; folded rows
        where the capture shows the fold, never under FSDP2).

        Raises:
            UnsupportedModuleError: rows that are not ``B K``, nor folded.
        """
        assert capture.output_grad is not None  # only captures the backward pass reached have rows
        copies = self.augmentation_multiplicity
        folds = (capture.fold_rows == batch * copies or capture.expanded) and not self._sharded
        return check_rows(capture.name, capture.output_grad.shape[0], batch, copies, folded=folds)

    def _verify_rows(self, per_sample_loss: torch.Tensor, batch: int) -> None:
        """Check, once per module, that a capture of ``B K r`` rows (a sequence or windows folded into the rows) holds
        each example's rows together, and that a capture whose broadcast input was expanded to the batch gives each
        example its own row (a model that reads only row 0 of it would send every example's gradient to example 0):
        the batch-independence check on those outputs (docs/design.md section 4.1).

        Raises:
            BatchMixingError: the rows are in another order (or are not examples' rows at all).
        """
        from lightning_dp.checks.independence import check_batch_independence  # checks import the clipping package

        rows_per_copy = batch * self.augmentation_multiplicity
        targets: dict[str, tuple[GradientEdge | torch.Tensor, torch.Size]] = {}
        checked: set[str] = set()
        for index, capture in enumerate(self._hooks.captures):
            rows = capture.output_shape[0] if capture.output_shape else 0
            folded = rows > 0 and rows != rows_per_copy and capture.fold_rows == rows_per_copy
            if (folded or capture.expanded) and capture.name not in self._rows_verified:
                targets[f"output of module '{capture.name}' (call {index})"] = (capture.edge, capture.output_shape)
                checked.add(capture.name)
        if not targets:
            return
        with self._hooks.suspended():
            conclusive = check_batch_independence(per_sample_loss, targets, self.augmentation_multiplicity)
        if conclusive:
            self._rows_verified |= checked

    def _check_all_rows(self, captures: list[Capture], batch: int) -> None:
        """Raise for every capture whose rows are not ``B K`` examples' (nor folded), naming them all.

        Raises:
            MisplacedParametersError: with the first module's message (:func:`~.multiplicity.check_rows`).
        """
        errors: dict[str, UnsupportedModuleError] = {}
        for capture in captures:
            try:
                self._rows_per_example(capture, batch)
            except UnsupportedModuleError as error:
                errors.setdefault(capture.name, error)
        if errors:
            raise MisplacedParametersError(str(next(iter(errors.values()))), modules=tuple(errors))

    def _terms(self, captures: list[Capture], batch: int) -> dict[nn.Parameter, list[Term]]:
        """Group the terms of all captures by parameter (one term per use), folded to ``batch`` examples
        (:func:`~lightning_dp.clipping.multiplicity.fold_copies`).

        Raises:
            ValueError: a captured input modified in place after its layer ran; a capture without ``B K`` rows.
        """
        terms: dict[nn.Parameter, list[Term]] = {}
        with self._hooks.suspended():
            for capture in captures:
                if capture.modified():
                    raise ValueError(
                        f"the input of module '{capture.name}' was modified in place after the module ran, so its "
                        "per-sample gradients would be computed from the modified values; replace the in-place op "
                        "that follows it (e.g. x.mul_(s) -> x = x * s)"
                    )
                output_grad = capture.output_grad
                assert output_grad is not None  # only captures the backward pass reached are passed here
                rows = self._rows_per_example(capture, batch)
                for name, term in capture.layer_terms(rows).items():
                    terms.setdefault(self._registered[(id(capture.module), name)], []).append(term)
                call = capture.call
                if call is not None and call.confirmed is not None:
                    self._hooks.confirmed_inputs[(id(capture.module), call.signature)] = call.confirmed
        return terms

    def _norms(
        self,
        per_sample_loss: torch.Tensor,
        captures: list[Capture],
        batch_grads: dict[nn.Parameter, torch.Tensor | None],
        check: bool,
        kept: list[dict[nn.Parameter, list[Term]] | list[Capture]] | None = None,
        reduced: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, SumCheck | None]:
        """Per-sample squared norms (l1 for ``norm=1``) per clipping group ``[G, B]``, current and past iterates
        together; their rounding scales ``[G, B]`` (:func:`~lightning_dp.clipping.rounding.rounded_norm_bound`); and
        with ``check`` the sum check fed with the current iterate's terms (failures read by the caller).

        ``reduced``: the backward ran in reduced precision (looser tolerance). With ``kept``, each group's terms (if
        views of the captures) or the captures themselves are appended for book-keeping.

        Raises:
            UnsupportedModuleError: (when ``check``) a parameter reached by the loss without per-sample terms.
        """
        batch = per_sample_loss.shape[0]
        dtype = self._norm_dtype
        checker = None
        if check:  # ``reduced``: whether the backward ran in reduced precision (decided before the norms, which don't)
            checker = SumCheck(VERIFY_RTOL_REDUCED if reduced else VERIFY_RTOL, reduced=reduced)
        past = {id(c) for c in self._past}
        with_terms: set[int] = set()
        totals = [torch.zeros(batch, dtype=dtype, device=per_sample_loss.device) for _ in range(self._group_count())]
        scales = [torch.zeros_like(total) for total in totals]
        for group in _shared_parameter_groups(captures + self._past, self._registered):
            then = [c for c in group if id(c) in past]
            now_terms = self._terms([c for c in group if id(c) not in past], batch)
            past_terms = self._terms(then, batch)
            terms = {p: now_terms.get(p, []) + past_terms.get(p, []) for p in {**now_terms, **past_terms}}
            grads: dict[nn.Parameter, torch.Tensor] = {}
            for param, param_terms in terms.items():
                with_terms.add(id(param))
                if checker is not None and param in now_terms:
                    checker.add(param, now_terms[param], batch_grads.pop(param, None))
                generator = None
                if self._engine.randomized:
                    assert self._generator_for is not None  # required with a randomized engine (the constructor)
                    generator = self._generator_for(param_terms[0].device)
                if kept is not None:
                    contribution, grad = self._engine.contribution_and_gradient(param_terms, self.norm, generator)
                    if grad is not None:
                        grads[param] = grad
                else:
                    contribution = self._engine.contribution(param_terms, self.norm, generator)
                clip_group = 0 if self.groups is None else self._group_of[param]
                totals[clip_group] = totals[clip_group] + contribution.to(dtype)
                # from the first use on (no ``0 +``: one add fewer per parameter, the same bits)
                uses = [term.rounding_scales(self.norm).to(dtype) for term in param_terms]
                scale = functools.reduce(operator.add, uses[1:], uses[0])
                if self.norm == 2:  # with the norm's underflow, as a squared scale
                    underflow = underflow_scale(underflow_bound(param_terms).to(dtype), self._rounding_epsilon)
                    scale = scale.square() + underflow
                scales[clip_group] = scales[clip_group] + scale
            if kept is not None:
                kept.append(self._kept_for_sum(terms, group, grads))
        total, scale = torch.stack(totals), torch.stack(scales)
        if checker is None:
            return total, scale, None
        reached = [p for p, g in batch_grads.items() if g is not None and id(p) not in with_terms]
        if reached:
            raise UnsupportedModuleError(
                f"parameter(s) {', '.join(repr(self._names[p]) for p in reached)} received a gradient but their layer "
                "family produced no per-sample gradient for them (e.g. an extra parameter of a subclass of a "
                "supported layer, used outside its forward); freeze them or use supported layers"
            )
        return total, scale, checker
