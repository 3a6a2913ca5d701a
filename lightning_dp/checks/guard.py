"""The run-time checks of :mod:`lightning_dp.checks` around each training forward of one run, and when they run
(docs/design.md section 9): :class:`TrainingGuard`.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_dp.checks.buffers import BufferWatch
from lightning_dp.checks.independence import (
    BatchMixingError,
    InputsRequireGrad,
    check_batch_independence,
    check_batch_independence_in_step,
    input_leaves,
)
from lightning_dp.checks.leave_half_out import (
    LEAVE_HALF_OUT_MIN_BATCH,
    check_leave_half_out,
    check_leave_half_out_in_step,
)

log = logging.getLogger("lightning_dp")

#: ``values -> each one's maximum over the ranks`` (:attr:`TrainingGuard.lockstep`).
Lockstep = Callable[[list[int]], list[int]]


def validate_independence_every(every: int | None, check_batch_independence: bool) -> None:
    """Raise ``ValueError`` unless ``every`` (``check_batch_independence_every``) is ``None`` or a positive whole
    number of optimizer steps, and, when it is a number, ``check_batch_independence`` is on."""
    if every is None:
        return
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(
            f"check_batch_independence_every must be a positive whole number of optimizer steps or None (first "
            f"step only), got {every!r}"
        )
    if not check_batch_independence:
        raise ValueError(
            f"check_batch_independence_every={every} repeats the batch-independence check, which "
            "check_batch_independence=False switches off: set check_batch_independence=True to check every "
            f"{every} optimizer steps, or check_batch_independence_every=None to keep the check off"
        )


class TrainingGuard:
    """The checks of :mod:`lightning_dp.checks` around each training forward of one run.

    Buffers and frozen parameters on every step; batch independence (gradients, then leave-half-out) on the first batch
    with at least two examples (leave-half-out: :data:`~.leave_half_out.LEAVE_HALF_OUT_MIN_BATCH`) from the first step
    and, with ``check_every = N``, from every optimizer step whose number (the accountant's count, the same on every
    rank) is a multiple of N. The checks are local to each rank, never write ``.grad``, never
    draw from the noise or sampling generators and restore the torch RNG, so they do not change the update. On an
    FSDP2-sharded model on several processes (:attr:`lockstep`) they run in lockstep. Which micro-batch is checked, and
    the lockstep protocol: docs/design.md sections 9.2, 9.4 and 12.5.

    Usage: ``batch = guard.before_forward(batch, batch_size)``, ``per_sample_loss = guard.forward(compute_loss,
    batch)``, then ``guard.after_forward(per_sample_loss)`` before the clipper's backward.

    Args:
        module: the model.
        output_targets: ``() -> {description: (edge, shape)}`` of the hooked layer outputs of the current forward
            (:meth:`~lightning_dp.clipping.PerSampleClipper.output_targets`).
        check_batch_independence: run :func:`check_batch_independence` and :func:`check_leave_half_out` on the first
            step.
        check_every: ``N >= 1``: also on every N-th optimizer step (steps ``0, N, 2N, ...``); ``None`` (default): the
            first step only. Needs ``check_batch_independence``.
        step: ``() -> int``, the number of optimizer steps taken so far (needed with ``check_every``).
        copies: ``K``, the augmentation multiplicity (hooked layer outputs of ``B K`` rows, sample-major).

    Raises:
        ValueError: ``check_every`` not ``None`` or a positive int, or given without ``check_batch_independence`` or
            without ``step``.
    """

    def __init__(
        self,
        module: nn.Module,
        output_targets: Any,
        *,
        check_batch_independence: bool = True,
        check_every: int | None = None,
        step: Callable[[], int] | None = None,
        copies: int = 1,
    ) -> None:
        validate_independence_every(check_every, check_batch_independence)
        if check_every is not None and step is None:
            raise ValueError("check_every needs step, the count of optimizer steps taken so far")
        self.buffers = BufferWatch(module)
        self._output_targets = output_targets
        self.independence_pending = check_batch_independence
        #: whether :func:`check_leave_half_out` is still to run (on the first batch with four examples or more).
        self.leave_half_out_pending = check_batch_independence
        self.check_every = check_every
        self._step = step
        self.copies = copies
        #: the last optimizer step whose checks were armed (each due step arms once, at its first forward).
        self._armed_step: int | None = None
        self._first_step = True
        self._warned_no_size = False
        self._leaves: dict[str, torch.Tensor] = {}
        #: ``values -> each one's maximum over the ranks``, set by the engine for a sharded model on several
        #: processes: the checks then run in lockstep (class docstring); ``None``: each rank checks on its own.
        self.lockstep: Lockstep | None = None
        #: in lockstep, whether the ranks agreed that none of them has a check pending (then no collective runs
        #: until a due step arms the checks again on every rank).
        self._nobody_pending = not check_batch_independence
        #: per check, whether its last run on this process was inconclusive (a non-finite loss) and no later run
        #: concluded: reported at the end of the run.
        self._inconclusive = {"batch-independence": False, "leave-half-out": False}

    @property
    def unresolved(self) -> bool:
        """Whether a check ran inconclusively on this process and had not concluded by now (a statement about the
        private data: it depends on which examples were drawn; see docs/privacy.md, "Run-time checks")."""
        return any(self._inconclusive.values())

    def _arm_if_due(self) -> None:
        """Make both independence checks pending at the first forward of a step that is a multiple of
        ``check_every``."""
        if self.check_every is None:
            return
        assert self._step is not None, "__init__ requires step with check_every"
        step = self._step()
        if step % self.check_every == 0 and step != self._armed_step:
            self._armed_step = step
            self.independence_pending = True
            self.leave_half_out_pending = True
            self._nobody_pending = False

    def before_forward(self, batch: Any, batch_size: int | None) -> Any:
        """Start watching the buffers and frozen parameters (their contents too on the first step and while the
        independence check is pending); while the independence check is pending (first step; with ``check_every``,
        every due step), return the batch with its float inputs as gradient leaves (see :func:`input_leaves`), else
        the batch itself."""
        self._arm_if_due()
        self.buffers.start(contents=self._first_step or self.independence_pending)
        self._leaves = {}
        if self.independence_pending and batch_size is None and not self._warned_no_size:
            self._warned_no_size = True
            log.warning(
                "batch-independence check: the batch size could not be read from the batch, so its float inputs "
                "are not checked (only the hooked layer outputs are); mixing of examples before the first hooked "
                "layer is NOT checked"
            )
        if self.independence_pending and batch_size is not None and batch_size >= 2 and self.lockstep is None:
            batch, self._leaves = input_leaves(batch, batch_size)
        return batch

    def forward(self, compute_loss: Callable[[Any], torch.Tensor | None], batch: Any) -> torch.Tensor | None:
        """``compute_loss(batch)`` on the batch :meth:`before_forward` returned: while its float inputs are gradient
        leaves, under :class:`~lightning_dp.checks.independence.InputsRequireGrad`."""
        if not self._leaves:
            return compute_loss(batch)
        with InputsRequireGrad():
            return compute_loss(batch)

    def after_forward(self, per_sample_loss: torch.Tensor) -> None:
        """Check the buffers, and (while pending) batch independence.

        Raises:
            UnsupportedModuleError: a buffer or frozen parameter changed during the forward.
            BatchMixingError: an example's loss depends on another example's data.
        """
        self.buffers.check()
        self._first_step = False
        if self.lockstep is not None:
            self._after_forward_in_step(per_sample_loss, self.lockstep)
            return
        if not self.independence_pending or per_sample_loss.ndim != 1 or per_sample_loss.shape[0] < 2:
            return
        targets = {**self._output_targets(), **{name: (leaf, leaf.shape) for name, leaf in self._leaves.items()}}
        self._leaves = {}
        with self._naming_the_step():
            conclusive = check_batch_independence(per_sample_loss, targets, self.copies)
        self.independence_pending = not conclusive  # a non-finite loss: check again on the next batch
        self._inconclusive["batch-independence"] = not conclusive

    def _after_forward_in_step(self, per_sample_loss: torch.Tensor, lockstep: Lockstep) -> None:
        """:meth:`after_forward`'s gradient check in lockstep with the other ranks (class docstring)."""
        if self._nobody_pending:
            return
        batch = per_sample_loss.shape[0] if per_sample_loss.ndim == 1 else 0
        active = self.independence_pending and batch >= 2
        (bits,) = lockstep([math.ceil(math.log2(batch)) if active else 0])
        if bits == 0:
            return
        with self._naming_the_step():
            conclusive, error = check_batch_independence_in_step(
                per_sample_loss, self._output_targets(), active=active, bits=bits, copies=self.copies
            )
            self._raise_if_any_rank(error, "batch-independence", lockstep)
        if active:
            self.independence_pending = not conclusive
            self._inconclusive["batch-independence"] = not conclusive

    def _raise_if_any_rank(self, error: BatchMixingError | None, check: str, lockstep: Lockstep) -> None:
        """Raise ``error``, or, when another rank found mixing, a :class:`BatchMixingError` saying so (every rank
        raises together)."""
        (found,) = lockstep([int(error is not None)])
        if error is not None:
            raise error
        if found:
            raise BatchMixingError(f"{check} check: another process found examples of its batch mixing")

    def leave_half_out(
        self, compute_loss: Callable[[Any], torch.Tensor | None], batch: Any, batch_size: int | None, module: nn.Module
    ) -> None:
        """Run :func:`check_leave_half_out` while pending, on the first batch with :data:`LEAVE_HALF_OUT_MIN_BATCH`
        examples or more from the first step on (and from every due step with ``check_every``), and again on each next
        such batch while it is inconclusive (a non-finite loss); call after :meth:`after_forward`, with the batch as the
        user's step received it.

        Raises:
            BatchMixingError: as :func:`check_leave_half_out`.
        """
        if self.lockstep is not None:
            self._leave_half_out_in_step(compute_loss, batch, batch_size, module, self.lockstep)
            return
        if not self.leave_half_out_pending or batch_size is None or batch_size < LEAVE_HALF_OUT_MIN_BATCH:
            return
        with self._naming_the_step():
            conclusive = check_leave_half_out(compute_loss, batch, batch_size, module)
        self.leave_half_out_pending = not conclusive  # a non-finite loss: check again on the next batch
        self._inconclusive["leave-half-out"] = not conclusive

    def _leave_half_out_in_step(
        self,
        compute_loss: Callable[[Any], torch.Tensor | None],
        batch: Any,
        batch_size: int | None,
        module: nn.Module,
        lockstep: Lockstep,
    ) -> None:
        """:meth:`leave_half_out` in lockstep with the other ranks (class docstring), then the ranks' agreement on
        whether any check is still pending (when none is, the lockstep stops until a due step arms the checks)."""
        if self._nobody_pending:
            return
        active = self.leave_half_out_pending and batch_size is not None and batch_size >= LEAVE_HALF_OUT_MIN_BATCH
        (run,) = lockstep([int(active)])
        if run:
            with self._naming_the_step():
                conclusive, error = check_leave_half_out_in_step(
                    compute_loss, batch, batch_size or 0, module, active=active
                )
                self._raise_if_any_rank(error, "leave-half-out", lockstep)
            if active:
                self.leave_half_out_pending = not conclusive
                self._inconclusive["leave-half-out"] = not conclusive
        pending = lockstep([int(self.independence_pending), int(self.leave_half_out_pending)])
        self._nobody_pending = not any(pending)

    @contextmanager
    def _naming_the_step(self) -> Iterator[None]:
        """With ``check_every``, a :class:`BatchMixingError` raised inside says on which optimizer step
        (``"batch-independence check after 4 optimizer steps: ..."``): mixing may have started after the first step."""
        try:
            yield
        except BatchMixingError as error:
            if self.check_every is not None and error.args and isinstance(error.args[0], str):
                assert self._step is not None, "__init__ requires step with check_every"
                step = self._step()
                error.args = (error.args[0].replace(" check: ", f" check after {step} optimizer steps: ", 1),)
            raise
