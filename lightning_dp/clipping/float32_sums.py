"""float32 clipped sums of 16-bit trainable parameters (docs/privacy.md, "Mixed precision").

A bfloat16 or float16 parameter (Lightning ``bf16-true``, a model loaded in half precision) cannot hold a float32
``.grad``. Its clipped sum, formed in float32 by the clipper, is kept here instead of being rounded into ``.grad``; the
:class:`~lightning_dp.optim.DPOptimizer` takes it (:func:`take_float32_sums`), adds the noise and divides by ``q N`` in
float32, and only then casts the result into ``.grad``: the rounding to the parameter's dtype comes after the noise,
so it is post-processing of the float32 release. The parameter's own ``.grad`` holds zeros meanwhile (and whatever is
written there outside the clipper, added to the sum before the noise).

The sums are keyed by the parameter object (weakly); a sum is started afresh whenever the parameter's ``.grad`` is
``None`` (the optimizer's ``zero_grad`` default), and :func:`discard_float32_sums` drops them. FSDP2-sharded
parameters keep the previous path (the sum rounded into the sharded ``.grad``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_dp.runtime.sharding import is_sharded

#: ``{id(param): (weak reference to param, float32 sum)}``, the sums of 16-bit parameters since their ``.grad`` was
#: last ``None`` (or discarded); an entry goes with its parameter. (Not a ``WeakKeyDictionary``: its lookups compare
#: tensors with ``==``.)
_SUMS: dict[int, tuple[weakref.ref[nn.Parameter], torch.Tensor]] = {}


def float32_sum(param: nn.Parameter) -> torch.Tensor | None:
    """``param``'s float32 sum, or ``None``."""
    entry = _SUMS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def _forget(key: int) -> Callable[[object], None]:
    """The weak reference's callback: drop the entry of a parameter that is gone."""

    def forget(_: object) -> None:
        _SUMS.pop(key, None)

    return forget


_HALF = (torch.bfloat16, torch.float16)


def keeps_float32_sum(param: torch.Tensor) -> bool:
    """Whether ``param``'s clipped sum is kept here in float32 (a 16-bit parameter, not sharded)."""
    return param.dtype in _HALF and not is_sharded(param)


def add_float32_sum(param: nn.Parameter, clipped: torch.Tensor) -> None:
    """Add ``clipped`` (``[*param.shape]``, float32 or wider) to ``param``'s float32 sum; a ``param`` whose ``.grad``
    is ``None`` starts a new sum and gets a zero ``.grad`` (as after a plain backward)."""
    clipped = clipped.to(torch.float32)
    kept = float32_sum(param)
    if param.grad is None or kept is None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        put_float32_sum(param, clipped.clone())
    else:
        kept.add_(clipped)


def pop_float32_sum(param: nn.Parameter) -> torch.Tensor | None:
    """Remove ``param``'s float32 sum and return it (``None`` when it has none)."""
    kept = float32_sum(param)
    _SUMS.pop(id(param), None)
    return kept


def put_float32_sum(param: nn.Parameter, kept: torch.Tensor) -> None:
    """Make ``kept`` (float32, ``[*param.shape]``) ``param``'s float32 sum, replacing any."""
    _SUMS[id(param)] = (weakref.ref(param, _forget(id(param))), kept)


def take_float32_sums(params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]:
    """For each of ``params``: its float32 sum (removed from here; zeros when the clipper added none), for a 16-bit
    parameter; ``None`` for the others."""
    taken: list[torch.Tensor | None] = []
    for param in params:
        if not keeps_float32_sum(param):
            taken.append(None)
            continue
        kept = pop_float32_sum(param)
        taken.append(torch.zeros(param.shape, dtype=torch.float32, device=param.device) if kept is None else kept)
    return taken


def discard_float32_sums(params: Sequence[nn.Parameter]) -> None:
    """Forget the float32 sums of ``params`` (a step skipped, the gradients zeroed)."""
    for param in params:
        if float32_sum(param) is not None:
            _SUMS.pop(id(param), None)
