"""The leave-half-out check: mixing of examples that has no gradient path, one of the run-time checks of
:mod:`lightning_dp.checks`.

:func:`check_leave_half_out` runs the user's step forward only, six times, on fresh row copies of the batch: the
values test (the batch twice, and each half replaced by copies of its neighbours: the kept losses must not change,
bit for bit, where the runs are comparable) and the count test (each half alone: the signature of a loss divided by
an additive count over the batch). It catches a loss divided by the batch's token count, ``h -
h.mean(0).detach()``, statistics under ``no_grad``. The tests and what they cannot see: docs/design.md section 9.4
and docs/privacy.md, "Run-time checks".
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_dp.checks.independence import BATCH_MIXING_HINT, BatchMixingError
from lightning_dp.data.batch_tensors import holds_rows
from lightning_dp.data.example_lists import select_examples

log = logging.getLogger("lightning_dp")

#: Forwards of one check: the batch twice, the two same-shape variants, the two halves.
LEAVE_HALF_OUT_FORWARDS = 6
#: The smallest batch the training guard checks: its halves have two examples or more, so the check never runs the
#: user's step on one example when the draw did not (a step that fails on one example would raise only at the draws of
#: two or three examples).
LEAVE_HALF_OUT_MIN_BATCH = 4
#: Relative tolerance of the count test's common factor and of the relation between the halves' factors.
COUNT_RTOL = 0.01

_MIXING_REASON = (
    "so it depends on other examples (e.g. a loss divided by the batch's total token count: use a per-example mean; "
    "batch statistics computed under no_grad or detached); "
)


def check_leave_half_out(
    compute_loss: Callable[[Any], torch.Tensor | None], batch: Any, batch_size: int, module: nn.Module
) -> bool:
    """Fail when an example's loss depends on the other examples' values or number without a gradient path.

    Every forward runs in eval mode, under ``no_grad``, with deterministic algorithms, from the same torch RNG state,
    on rows of every tensor of ``batch`` whose first dimension is ``batch_size`` and the entries of its marked
    per-example sequences (:mod:`lightning_dp.data.example_lists`). Logs a warning, and checks nothing, when no tensor
    of the batch has ``B`` rows and no marked sequence ``B`` entries.

    Args:
        compute_loss: ``batch -> [B]`` per-sample loss of the user's step on that batch (``None``: nothing to check).
        batch: the training batch (before any guard transformation).
        batch_size: ``B``.
        module: the model (put in eval mode for the forwards, then restored).

    Returns:
        Whether the check was conclusive: False when a loss is not finite or ``None``, or when a half has no finite
        nonzero loss (the caller checks again later). A values test skipped as not comparable stays conclusive.

    Raises:
        BatchMixingError: naming the test that failed (and, for the values test, an example whose loss changed).
    """
    if batch_size < 2:
        return True
    conclusive, error = _leave_half_out(compute_loss, batch, batch_size, module, active=True, lockstep=False)
    if error is not None:
        raise error
    return conclusive


def check_leave_half_out_in_step(
    compute_loss: Callable[[Any], torch.Tensor | None], batch: Any, batch_size: int, module: nn.Module, *, active: bool
) -> tuple[bool, BatchMixingError | None]:
    """:func:`check_leave_half_out` in lockstep with the other ranks, for a sharded (FSDP2) model, whose forwards
    gather weights with collectives: every rank runs the six forwards; a rank that does not check this batch
    (``active`` False) runs its batch six times and compares nothing.

    Returns:
        ``(conclusive, error)``: the error is returned, not raised, so the ranks can agree before raising.
    """
    return _leave_half_out(compute_loss, batch, batch_size, module, active=active and batch_size >= 2, lockstep=True)


class _CallShapes(TorchFunctionMode):
    """Records every torch call made under it with the shapes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.calls.append((getattr(func, "__qualname__", repr(func)), _shapes((args, kwargs))))
        return func(*args, **kwargs)


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return ("nested", value.dtype, tuple(tuple(size) for size in value._nested_tensor_size().tolist()))
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_shapes(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, _shapes(item)) for key, item in value.items())
    return None


@contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic algorithms (warn only) for the forwards, the caller's setting restored afterwards."""
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _leave_half_out(
    compute_loss: Callable[[Any], torch.Tensor | None],
    batch: Any,
    batch_size: int,
    module: nn.Module,
    *,
    active: bool,
    lockstep: bool,
) -> tuple[bool, BatchMixingError | None]:
    """The forwards of :func:`check_leave_half_out` (inactive: the batch six times, only in ``lockstep``, where the
    other ranks' forwards need this rank's) and, active, the two tests."""
    index = torch.arange(batch_size)
    even, odd = index[0::2], index[1::2]
    odd_as_even, even_as_odd = index.clone(), index.clone()
    odd_as_even[odd] = even[: len(odd)]  # each odd row a copy of the even row before it
    even_as_odd[even[: len(odd)]] = odd  # each even row with a partner a copy of the odd row after it
    found = holds_rows(batch, batch_size)
    # fresh row copies for every forward, the batch's own rows included: the same layout (a view arriving
    # non-contiguous would run other kernels than its copies)
    selections = (index, index, odd_as_even, even_as_odd, even, odd)
    variants = [select_examples(batch, batch_size, selection) for selection in selections] if active else []
    if active and not found:
        log.warning(
            "leave-half-out check could not run (no tensor of the batch has the batch size %d as its first "
            "dimension, nor any per-example list as many entries), so mixing of examples without a gradient path is "
            "NOT checked",
            batch_size,
        )
        if not lockstep:
            return True, None
        active = False
    if not active and not lockstep:
        return True, None
    losses, calls, nondeterministic = _forwards(
        compute_loss, variants if active else [batch] * LEAVE_HALF_OUT_FORWARDS, module, batch
    )
    if not active:
        return True, None
    if any(loss is None for loss in losses):
        return False, None
    full, again, odd_replaced, even_replaced, half_even, half_odd = (loss.detach() for loss in losses)  # type: ignore[union-attr]
    halves = torch.empty_like(full)
    halves[even.to(full.device)], halves[odd.to(full.device)] = half_even, half_odd
    error = None
    if not nondeterministic and bool(_same_bits(full, again).all()):
        # each variant is compared only where it made the calls, with the shapes, of the batch's second run (the
        # first may fill caches)
        if calls[2] == calls[1]:
            error = _values_test(full, odd_replaced, even, "odd", "even")
        if error is None and calls[3] == calls[1]:
            error = _values_test(full, even_replaced, odd, "even", "odd")
    counted, count_error = _count_test(full, halves, even.to(full.device), odd.to(full.device))
    finite = all(bool(torch.isfinite(loss).all()) for loss in (full, again, odd_replaced, even_replaced, halves))
    return finite and counted, error or count_error


def _forwards(
    compute_loss: Callable[[Any], torch.Tensor | None], batches: list[Any], module: nn.Module, batch: Any
) -> tuple[list[torch.Tensor | None], list[list[tuple[str, Any]]], bool]:
    """The losses of ``batches`` and the calls each made, every forward in eval mode under ``no_grad``, a recording
    :class:`_CallShapes` (so every forward takes the same code paths: an active mode switches PyTorch's fast paths
    off), deterministic algorithms and the same RNG state (CPU and every CUDA device of the batch and the module);
    and whether an operation without a deterministic implementation ran (its warning, under ``warn_only``). Every
    submodule's train/eval mode is restored afterwards."""
    devices = sorted(
        {t.device.index or 0 for t in _all_tensors(batch) if t.is_cuda}
        | {p.device.index or 0 for p in module.parameters() if p.is_cuda}
    )
    modes = {sub: sub.training for sub in module.modules()}
    module.eval()
    losses, calls = [], []
    try:
        with _deterministic(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for data in batches:
                recorder = _CallShapes()
                with torch.random.fork_rng(devices=devices), torch.no_grad(), recorder:
                    losses.append(compute_loss(data))
                calls.append(recorder.calls)
    finally:
        for sub, training in modes.items():
            sub.training = training
    nondeterministic = any("does not have a deterministic implementation" in str(w.message) for w in caught)
    for warning in caught:  # pass the others on
        if "deterministic" not in str(warning.message):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return losses, calls, nondeterministic


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal, or both NaN."""
    return (a == b) | (a.isnan() & b.isnan())


def _values_test(
    full: torch.Tensor, variant: torch.Tensor, kept: torch.Tensor, replaced: str, compared: str
) -> BatchMixingError | None:
    """An error when a loss of the ``kept`` indices differs, bit for bit, between ``full`` and ``variant`` (the batch
    with the ``replaced`` examples copies of their neighbours), both ``[B]``."""
    kept = kept.to(full.device)
    differs = ~_same_bits(full[kept], variant[kept])
    if not bool(differs.any()):
        return None
    example = int(kept[int(torch.nonzero(differs)[0])])
    return BatchMixingError(
        f"leave-half-out check: replacing the {replaced}-indexed examples by copies of their neighbours changed the "
        f"loss of example {example}, one of the {compared}-indexed ones, at the same shapes, "
        + _MIXING_REASON
        + BATCH_MIXING_HINT
    )


def _count_test(
    full: torch.Tensor, halves: torch.Tensor, even: torch.Tensor, odd: torch.Tensor
) -> tuple[bool, BatchMixingError | None]:
    """The count test of the module docstring: ``full`` ``[B]`` the losses with the whole batch, ``halves`` ``[B]``
    each example's loss in its half. A division by an additive count over the batch, both halves non-empty, gives
    each half a factor above 1 shared by all its examples, and reciprocals that add up to 1. The error needs, in each
    half, a factor of at least ``1 + COUNT_RTOL`` shared within ``COUNT_RTOL`` by a strict majority of ALL the half's
    examples (zero and non-finite losses count against it), and the relation within ``COUNT_RTOL``. Returns
    ``(conclusive, error)``: not conclusive when a half has no example whose losses are finite and nonzero, or when
    the signature holds among those examples but not among all (zero or crafted losses in the batch): the caller
    checks again on a later batch."""
    compared = torch.isfinite(full) & torch.isfinite(halves) & (full != 0) & (halves != 0)
    factors, majority_of_all = [], True
    for half in (even, odd):
        ratios = (halves[half] / full[half])[compared[half]]
        if ratios.numel() == 0:
            return False, None
        factor = float(ratios.median())  # the lower median
        sharing = int(((ratios - factor).abs() <= COUNT_RTOL * abs(factor)).sum())
        if factor < 1 + COUNT_RTOL or 2 * sharing <= ratios.numel():
            return True, None
        majority_of_all &= 2 * sharing > len(half)
        factors.append(factor)
    if abs(1 / factors[0] + 1 / factors[1] - 1) > COUNT_RTOL:
        return True, None
    if not majority_of_all:  # the signature among the nonzero losses only: decide on a later batch
        return False, None
    return True, BatchMixingError(
        "leave-half-out check: run alone, the even- and the odd-indexed examples' losses each grew by one common "
        "factor, and the two factors' reciprocals add up to 1: the loss is divided by a count over the batch (of "
        "examples or tokens), so with Poisson sampling each example's contribution depends on which others were "
        "drawn; use a per-example mean, or divide by a constant such as the expected batch size; " + BATCH_MIXING_HINT
    )


def _all_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of ``batch``, those inside its marked per-example sequences too (for their devices)."""
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found
