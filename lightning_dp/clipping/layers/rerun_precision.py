"""Reduced precision in the exact fallback's rerun (:mod:`~lightning_dp.clipping.layers.fallback`): a layer norm that
``vmap`` cannot differentiate under CPU autocast, and the float32 copies its comparison under autocast runs on
(docs/design.md section 4.2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

_HALF = (torch.bfloat16, torch.float16)


class CpuLayerNormInFloat32(TorchFunctionMode):
    """Runs ``F.layer_norm`` of a CPU input in bfloat16 or float16 with a float32 weight (CPU autocast leaves a layer
    norm in its input's dtype) on the input cast to float32, the output cast back: the values of the mixed kernel,
    which computes in float32 (a few entries in a thousand differ in their last bit), and a backward that ``vmap``
    batches (its rule for the mixed kernel raises "expected scalar type BFloat16 but found Float" when the input needs
    a gradient)."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.layer_norm:
            x, weight = args[0], args[2] if len(args) > 2 else kwargs.get("weight")
            mixed = weight is not None and x.dtype in _HALF and weight.dtype == torch.float32
            if mixed and x.device.type == "cpu":
                return func(x.float(), *args[1:], **kwargs).to(x.dtype)
        return func(*args, **kwargs)


def in_float32(value: Any) -> Any:
    """``value`` in float32 when it is a bfloat16 or float16 tensor, else itself."""
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in _HALF else value
