"""Checks around the training forward for leaks the clipping hooks cannot see (docs/design.md section 9).

Per-sample clipping bounds each example's influence on the GRADIENT. Two things escape it:

- state written during the forward without noise: a module that updates a buffer or a frozen parameter
  (``requires_grad=False``) from the data (a hand-written running mean) stores data in the ``state_dict`` that is
  released with the model. :class:`BufferWatch` fails, naming the module and the tensor, when one was written or
  replaced during a training forward. On EVERY step it compares each tensor's identity, version counter and storage
  address (``data_ptr()``): in-place ops on the tensor or a ``.detach()`` of it (``buf.add_(...)``,
  ``buf.detach().copy_(...)``), reassignment of the attribute (``self.buf = ...``) and ``buf.data = ...`` are caught;
  no tensor work. A write through ``.data`` (``buf.data.copy_(...)``: that alias has its own version counter) changes
  none of the three, so on the FIRST training forward, and on every step while the batch-independence check is
  pending, it also compares the contents before and after the forward (exact equality for tensors up to
  :data:`EXACT_COMPARE_NUMEL` elements, the float64 sum and sum of squares for larger ones: one read of every watched
  tensor, no copy of the large ones; a write that keeps both, e.g. a permutation, is missed). Such a write on a later
  step only is not caught.
- operations that mix examples without parameters (``h - h.mean(0)``, batch statistics computed by hand): example
  i's loss then depends on example j's data, so removing j changes every clipped contribution and the sensitivity
  of the clipped sum is no longer ``C``. :func:`check_batch_independence` tests, on the first step (and, with
  ``check_batch_independence_every=N``, on every N-th optimizer step: see :class:`TrainingGuard`), that the
  gradient of example i's loss with respect to example j's input (float inputs) and to every hooked layer's output
  for example j (which covers integer inputs through the embedding outputs) is zero for i != j. This is the idea of
  Lightning's ``BatchGradientVerification`` (``lightning.pytorch.callbacks.batch_size_finder``'s sibling in
  ``pl_bolts``), made complete over pairs: for each bit b of the sample index, one vector-Jacobian product of
  ``sum_{i: bit_b(i)=1} loss_i`` and one of its complement; any i != j differ in some bit, so every pair is tested,
  with ``2 ceil(log2 B)`` extra backward passes of the checked batch.

- mixing without a gradient path (a per-sample loss divided by the batch's total token count, ``(tok * mask).sum(1)
  / mask.sum()``; ``h - h.mean(0).detach()``; statistics computed under ``torch.no_grad``) is invisible to
  gradients, so :func:`check_leave_half_out` adds a forward-only test on the same first batch: with the model in
  eval mode, under ``no_grad`` and the same torch RNG state, the per-sample losses of the even-indexed examples must
  be the same whether the odd-indexed ones are in the batch or not (two extra forwards per checked step).

What the independence checks cannot see (documented in docs/privacy.md): mixing of integer inputs before the first
hooked layer that the leave-half-out split does not change (e.g. sorting token ids across the batch), mixing that
only happens on batches that are not checked (a schedule or a data-dependent branch that starts after the first
step, when only the first step is checked; any mixing on the steps between two periodic checks), mixing that only
happens in train mode (for the leave-half-out forward), and gradients that cancel exactly within a tested set. When
it cannot run at all (no target with ``B`` rows, a loss without gradient) or cannot check the float inputs (batch
size unknown), it logs a warning.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.autograd.graph import GradientEdge

from lightning_dp.clipping.registry import UnsupportedModuleError

log = logging.getLogger("lightning_dp")

#: watched tensors up to this many elements are cloned and compared exactly on the content check; larger ones by
#: checksum (float64 sum and sum of squares), so a large frozen base (LoRA) is read in chunks, never copied whole.
EXACT_COMPARE_NUMEL = 2**16
_CHECKSUM_CHUNK = 2**22

#: relative tolerance of the independence check: gradients across examples must vanish up to rounding.
INDEPENDENCE_RTOL = 1e-6

BATCH_MIXING_HINT = (
    "an operation mixes examples of the batch (e.g. h - h.mean(0), hand-written batch statistics, attention or "
    "pooling over the batch dimension), so clipping each example's gradient no longer bounds its influence; make "
    "every operation act on each example separately. If you are sure the model is per-example (e.g. the coupling is "
    "in a non-trainable diagnostic), switch the check off with check_batch_independence=False"
)


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


class BatchMixingError(UnsupportedModuleError):
    """Example i's loss depends on example j's data (i != j): the per-sample sensitivity bound does not hold."""


class BufferWatch:
    """Detects buffers and frozen parameters written or replaced during a training forward (see the module
    docstring for what is caught on every step and what only when contents are compared).

    Args:
        module: the model (all its buffers, persistent or not, are watched: a non-persistent buffer written from the
            data still shapes later outputs; and every parameter with ``requires_grad=False``).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._before: dict[str, tuple[int, int, int]] = {}
        self._contents: dict[str, torch.Tensor] = {}

    def _watched(self) -> Iterable[tuple[str, torch.Tensor]]:
        yield from self.module.named_buffers()
        yield from ((name, p) for name, p in self.module.named_parameters() if not p.requires_grad)

    def _state(self) -> dict[str, tuple[int, int, int]]:
        return {name: (id(t), t._version, t.data_ptr()) for name, t in self._watched()}

    def start(self, *, contents: bool = False) -> None:
        """Record identities, version counters and storage addresses (call right before the training forward);
        with ``contents``, also a copy (small tensors) or checksum (large ones) of each tensor's contents."""
        self._before = self._state()
        self._contents = {name: _fingerprint(t) for name, t in self._watched()} if contents else {}

    def check(self) -> None:
        """Compare with :meth:`start`.

        Raises:
            UnsupportedModuleError: naming each buffer or frozen parameter (and its module) written in place,
                replaced or added since.
        """
        changed = [name for name, state in self._state().items() if self._before.get(name) != state]
        if self._contents:
            current = dict(self._watched())
            changed += [
                name
                for name, before in self._contents.items()
                if name not in changed and name in current and not _same(before, _fingerprint(current[name]))
            ]
            self._contents = {}
        if not changed:
            return
        parts = [name.rpartition(".") for name in changed]
        details = ", ".join(f"'{buffer}' of module '{owner or '<root>'}'" for owner, _, buffer in parts)
        raise UnsupportedModuleError(
            f"buffer(s) or frozen parameter(s) {details} changed during the training forward: a buffer or frozen "
            "parameter written from the data (e.g. a hand-written running mean) is saved in the state_dict without "
            "noise and leaks the training examples; compute the statistic without storing it, make it a trainable "
            "parameter of a supported layer, or update it only outside training (e.g. from public data)"
        )


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (at most :data:`EXACT_COMPARE_NUMEL` elements), else ``[2]`` float64: sum and sum of
    squares."""
    tensor = tensor.detach()
    if tensor.numel() <= EXACT_COMPARE_NUMEL:
        return tensor.clone()
    values = (torch.view_as_real(tensor) if tensor.is_complex() else tensor).reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=tensor.device)
    for chunk in values.split(_CHECKSUM_CHUNK):  # bounded float64 temporaries
        chunk = chunk.to(torch.float64)
        total += torch.stack((chunk.sum(), chunk.square().sum()))
    return total


def _same(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Equal contents (NaN equal to NaN)."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    if before.is_floating_point() or before.is_complex():
        return bool(torch.isclose(before, after, rtol=0.0, atol=0.0, equal_nan=True).all())
    return torch.equal(before, after)


def input_leaves(batch: Any, batch_size: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """The batch with every floating-point tensor of first dimension ``batch_size`` replaced by a clone of a fresh
    leaf that requires grad (a clone, so the user's in-place ops on it stay legal), and those leaves by position.

    Returns:
        ``(batch, {"input 0": leaf [B, ...], ...})``; the batch unchanged when it has no such tensor.
    """
    leaves: dict[str, torch.Tensor] = {}

    def as_leaf(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.ndim == 0 or tensor.shape[0] != batch_size:
            return tensor
        leaf = tensor.detach().requires_grad_(True)
        leaves[f"input {len(leaves)}"] = leaf
        return leaf.clone()

    return apply_to_collection(batch, torch.Tensor, as_leaf), leaves


def check_batch_independence(
    per_sample_loss: torch.Tensor,
    targets: dict[str, tuple[GradientEdge | torch.Tensor, torch.Size]],
) -> None:
    """Fail when example i's loss has a nonzero gradient with respect to example j's part of a target, i != j.

    Runs ``2 ceil(log2 B)`` vector-Jacobian products of the per-sample loss (graph retained, nothing written to
    ``.grad``); see the module docstring for the construction and what it cannot see.

    Args:
        per_sample_loss: ``[B]``, attached to the graph of the training forward.
        targets: ``{description: (edge or tensor, shape)}`` with the sample dimension first (hooked layer outputs,
            float input leaves); targets whose first dimension is not ``B`` are skipped.

    Raises:
        BatchMixingError: naming a pair (i, j) and the first target where the dependence shows.

    Logs a warning (and checks nothing) when no target has ``B`` rows or the loss has no gradient.
    """
    batch = per_sample_loss.shape[0]
    targets = {name: t for name, t in targets.items() if len(t[1]) and t[1][0] == batch}
    if batch < 2:
        return
    if not targets or not per_sample_loss.requires_grad:
        why = (
            "the per-sample loss has no gradient"
            if targets
            else f"no hooked layer output or float input has the batch size {batch} as its first dimension"
        )
        log.warning(
            "batch-independence check could not run (%s), so mixing of examples in the model is NOT checked; "
            "make sure every operation acts on each example separately",
            why,
        )
        return
    names = list(targets)
    inputs = [targets[name][0] for name in names]
    index = torch.arange(batch, device=per_sample_loss.device)
    finite = torch.isfinite(per_sample_loss.detach())
    for bit in range(math.ceil(math.log2(batch))):
        member = ((index >> bit) & 1).bool()
        for chosen in (member, ~member):
            weights = (chosen & finite).to(per_sample_loss.dtype)
            with torch.enable_grad():
                grads = torch.autograd.grad(
                    per_sample_loss, inputs, grad_outputs=weights, retain_graph=True, allow_unused=True
                )
            _raise_on_leak(names, grads, [targets[n][1] for n in names], chosen, finite)


def _raise_on_leak(
    names: Iterable[str],
    grads: Iterable[torch.Tensor | None],
    shapes: Iterable[torch.Size],
    chosen: torch.Tensor,
    finite: torch.Tensor,
) -> None:
    """Raise when a row outside ``chosen`` has a gradient above the relative tolerance. Examples whose loss is not
    finite (``~finite``; the clipper drops them) and non-finite gradient rows (``0 * inf`` in a backward) are left
    out, so that such an example neither fails the check (which would reveal that it was drawn) nor blinds it
    (an infinite scale would hide every other example's leak)."""
    for name, grad, shape in zip(names, grads, shapes, strict=True):
        if grad is None:
            continue
        rows = grad.reshape(shape).reshape(shape[0], -1).abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=1).float()
        inside, outside = rows[chosen & finite], rows[~chosen & finite]
        scale = float(inside.max()) if inside.numel() else 0.0
        if outside.numel() and float(outside.max()) > INDEPENDENCE_RTOL * max(scale, 1e-30):
            j = int(torch.nonzero(~chosen & finite)[int(outside.argmax())])
            raise BatchMixingError(
                f"batch-independence check: the losses of other examples have a nonzero gradient with respect to "
                f"example {j}'s {name} (largest |gradient| {float(outside.max()):.3g}); " + BATCH_MIXING_HINT
            )


def check_leave_half_out(
    compute_loss: Callable[[Any], torch.Tensor | None], batch: Any, batch_size: int, module: nn.Module
) -> None:
    """Fail when removing the odd-indexed examples changes the per-sample loss of an even-indexed one.

    The forward-only complement of :func:`check_batch_independence`: it sees mixing without a gradient path (a loss
    normalised by the batch's token count, statistics under ``no_grad``). Both forwards run with ``module`` in eval
    mode (no dropout), under ``no_grad`` (the hooks record nothing) and from the same torch RNG state; the batch is
    cut to the even rows in every tensor whose first dimension is ``batch_size``.

    Args:
        compute_loss: ``batch -> [B]`` per-sample loss of the user's step on that batch (``None``: skipped).
        batch: the training batch (before any guard transformation).
        batch_size: ``B``.
        module: the model (put in eval mode for the two forwards, then restored).

    Raises:
        BatchMixingError: naming an example whose loss changed.

    Logs a warning (and checks nothing) when no tensor of the batch has ``B`` rows.
    """
    if batch_size < 2:
        return
    keep = torch.arange(0, batch_size, 2)
    cut = []

    def even_rows(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.ndim == 0 or tensor.shape[0] != batch_size:
            return tensor
        cut.append(tensor)
        return tensor[keep.to(tensor.device)]

    half = apply_to_collection(batch, torch.Tensor, even_rows)
    if not cut:
        log.warning(
            "leave-half-out check could not run (no tensor of the batch has the batch size %d as its first "
            "dimension), so mixing of examples without a gradient path is NOT checked",
            batch_size,
        )
        return
    devices = sorted({t.device.index or 0 for t in cut if t.is_cuda})
    training = module.training
    module.eval()
    try:
        losses = []
        for data in (batch, half):
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                losses.append(compute_loss(data))
    finally:
        module.train(training)
    full, part = losses
    if full is None or part is None:
        return
    kept = full[keep.to(full.device)]
    close = torch.isclose(kept, part, rtol=1e-4, atol=1e-6, equal_nan=True)  # an example's NaN loss is its own
    if not bool(close.all()):
        i = int(keep[int(torch.nonzero(~close)[0])])
        raise BatchMixingError(
            f"leave-half-out check: the loss of example {i} is {float(kept[~close][0]):.6g} with the whole batch and "
            f"{float(part[~close][0]):.6g} without the odd-indexed examples, so it depends on other examples (e.g. a "
            "loss divided by the batch's total token count: use a per-example mean; batch statistics computed under "
            "no_grad or detached); " + BATCH_MIXING_HINT
        )


class TrainingGuard:
    """The checks of this module around each training forward of one run: buffers and frozen parameters on every
    step (contents on the first step and while independence is pending), batch independence (gradients, then the
    leave-half-out forward) on the first step with at least two examples (when ``check_batch_independence``) and,
    with ``check_every = N``, again on every optimizer step whose number is a multiple of N.

    Which steps are checked: the count of optimizer steps taken so far (``step()``, the accountant's count, the same
    on every process of a multi-process run) decides, never the local batch: at the first forward of a step whose
    number is a multiple of N, both checks become pending, exactly as at the start of a run, and they run on the
    first micro-batch of that step with at least two examples (the first micro-batch when ``accumulate_grad_batches``
    / ``gradient_accumulation_steps`` > 1, unless it has fewer than two examples; then the next one, possibly in a
    later step). So every rank arms the same steps; the checks themselves are local, as the first-step check is (no
    collective: each rank checks its own examples and a rank whose examples mix raises there), so they add no
    synchronisation point. With per-sample momentum the checks see the current iterate's forward (the forwards at
    the stored iterates of the same batch run the same code at older parameters). A check never writes ``.grad``,
    never draws from the noise or sampling generators and restores the torch RNG state around its forwards, so it
    does not change the update.

    Usage by an integration: ``batch = guard.before_forward(batch, batch_size)``, the user's forward and per-sample
    loss, then ``guard.after_forward(per_sample_loss)`` before the clipper's backward.

    Args:
        module: the model.
        output_targets: ``() -> {description: (edge, shape)}`` of the hooked layer outputs of the current forward
            (:meth:`~lightning_dp.clipping.PerSampleClipper.output_targets`).
        check_batch_independence: run :func:`check_batch_independence` and :func:`check_leave_half_out` on the first
            step.
        check_every: ``N >= 1``: also on every N-th optimizer step (steps ``0, N, 2N, ...`` of ``step()``);
            ``None`` (default): the first step only. Needs ``check_batch_independence``.
        step: ``() -> int``, the number of optimizer steps taken so far (needed with ``check_every``).

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
    ) -> None:
        validate_independence_every(check_every, check_batch_independence)
        if check_every is not None and step is None:
            raise ValueError("check_every needs step, the count of optimizer steps taken so far")
        self.buffers = BufferWatch(module)
        self._output_targets = output_targets
        self.independence_pending = check_batch_independence
        #: whether :func:`check_leave_half_out` is still to run (on the first batch with two examples or more).
        self.leave_half_out_pending = check_batch_independence
        self.check_every = check_every
        self._step = step
        #: the last optimizer step whose checks were armed (each due step arms once, at its first forward).
        self._armed_step: int | None = None
        self._first_step = True
        self._warned_no_size = False
        self._leaves: dict[str, torch.Tensor] = {}

    def _arm_if_due(self) -> None:
        """Make both independence checks pending at the first forward of a step that is a multiple of
        ``check_every``."""
        if self.check_every is None:
            return
        step = self._step()
        if step % self.check_every == 0 and step != self._armed_step:
            self._armed_step = step
            self.independence_pending = True
            self.leave_half_out_pending = True

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
        if self.independence_pending and batch_size is not None and batch_size >= 2:
            batch, self._leaves = input_leaves(batch, batch_size)
        return batch

    def after_forward(self, per_sample_loss: torch.Tensor) -> None:
        """Check the buffers, and (while pending) batch independence.

        Raises:
            UnsupportedModuleError: a buffer or frozen parameter changed during the forward.
            BatchMixingError: an example's loss depends on another example's data.
        """
        self.buffers.check()
        self._first_step = False
        if not self.independence_pending or per_sample_loss.ndim != 1 or per_sample_loss.shape[0] < 2:
            return
        targets = {**self._output_targets(), **{name: (leaf, leaf.shape) for name, leaf in self._leaves.items()}}
        self._leaves = {}
        with self._naming_the_step():
            check_batch_independence(per_sample_loss, targets)
        self.independence_pending = False

    def leave_half_out(
        self, compute_loss: Callable[[Any], torch.Tensor | None], batch: Any, batch_size: int | None, module: nn.Module
    ) -> None:
        """Run :func:`check_leave_half_out` while pending, on the first batch with two examples or more of the first
        step (and of every due step with ``check_every``); call after :meth:`after_forward`, with the batch as the
        user's step received it.

        Raises:
            BatchMixingError: as :func:`check_leave_half_out`.
        """
        if not self.leave_half_out_pending or batch_size is None or batch_size < 2:
            return
        self.leave_half_out_pending = False
        with self._naming_the_step():
            check_leave_half_out(compute_loss, batch, batch_size, module)

    @contextmanager
    def _naming_the_step(self) -> Iterator[None]:
        """With ``check_every``, a :class:`BatchMixingError` raised inside says on which optimizer step
        (``"batch-independence check after 4 optimizer steps: ..."``): mixing may have started after the first step."""
        try:
            yield
        except BatchMixingError as error:
            if self.check_every is not None and error.args and isinstance(error.args[0], str):
                step = self._step()
                error.args = (error.args[0].replace(" check: ", f" check after {step} optimizer steps: ", 1),)
            raise
