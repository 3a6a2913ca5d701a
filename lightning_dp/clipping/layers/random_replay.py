"""Random numbers inside a module the exact fallback reruns (docs/design.md section 4.2): what its call draws is
recorded, and the rerun of each example replays that example's rows of it, so the rerun is the same function of the
parameters as the call (``torch.func`` refuses random numbers under ``vmap``).

While a recorded module runs, ``F.dropout`` (``nn.Dropout`` included; train mode) is computed here as
``x * keep / (1 - p)`` with ``keep ~ Bernoulli(1 - p)`` drawn from the global RNG, as torch's dropout draws it, and the
draws of :data:`DRAWS` (``torch.rand`` of stochastic depth's drop path, ...) run as they are; each ``keep`` (bool) or
drawn tensor is kept with the call. In the rerun the ``j``-th such call takes the ``j``-th record: the example's rows of
it (``[R_j / B, ...]``) when the rerun's shape is that, or the whole record when it is shared by the batch (DeBERTa's
dropout on its relative embeddings); another kind, another shape or another number of calls is refused. Other random
functions (in-place fills) still raise under ``vmap``. The fallback's first-batch comparison checks the replay with the
rest of the rerun. The rerun computes ``F.scaled_dot_product_attention`` in its reference maths, which ``vmap(grad)``
differentiates where the fused CPU kernels are not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_dp.clipping.layers.registry import UnsupportedModuleError

#: What one call drew, in call order: ``(keep, p)`` per dropout call (``keep`` bool), ``(drawn, None)`` per draw.
Records = list[tuple[torch.Tensor, float | None]]

#: Random draws replayed as they were (their outputs are not changed by the recording).
DRAWS = frozenset(
    {
        torch.rand,
        torch.rand_like,
        torch.randn,
        torch.randn_like,
        torch.randint,
        torch.randint_like,
        torch.bernoulli,
        torch.Tensor.bernoulli,
    }
)
#: The draws whose first argument is a tensor of their shape.
_LIKE = frozenset({torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli, torch.Tensor.bernoulli})


def _dropout_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, float, bool, bool]:
    """``(input, p, training, inplace)`` of a call of ``F.dropout``."""
    names = ("input", "p", "training", "inplace")
    values: dict[str, Any] = {"p": 0.5, "training": True, "inplace": False}
    values.update(zip(names, args, strict=False))
    values.update(kwargs)
    return values["input"], float(values["p"]), bool(values["training"]), bool(values["inplace"])


def _empty_like_draw(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """An empty tensor of the shape and dtype the draw ``func(*args, **kwargs)`` of :data:`DRAWS` would return."""
    options = {k: v for k, v in kwargs.items() if k in ("dtype", "device")}
    if func in _LIKE:
        return torch.empty_like(args[0], **options)
    if func is torch.randint:
        size = kwargs["size"] if "size" in kwargs else args[-1]
        return torch.empty(size, **{"dtype": torch.int64, **options})
    size = kwargs["size"] if "size" in kwargs else args  # rand, randn: the size as arguments, one sequence or keyword
    return torch.empty(*size, **options) if size and not isinstance(size[0], int) else torch.empty(size, **options)


def _apply(x: torch.Tensor, keep: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
    """Dropout with the mask ``keep``: autograd keeps the bool mask alone, as torch's dropout does."""
    scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    if inplace:
        return x.mul_(scale).masked_fill_(~keep, 0)
    return torch.where(keep, x * scale, 0)


class RandomRecorder(TorchFunctionMode):
    """Records the dropout masks and draws made while modules of :attr:`active` run; entered while any is active.

    Attributes:
        active: the records of each recorded call running now, innermost last (a draw goes to every one).
        names: the description of each (for messages).
    """

    def __init__(self) -> None:
        super().__init__()
        self.active: list[Records] = []
        self.names: list[str] = []

    def start(self, name: str) -> Records:
        """Start recording a call of the module described by ``name`` (entering the mode for the outermost); returns
        its records, filled as it runs."""
        if not self.active:
            self.__enter__()
        records: Records = []
        self.active.append(records)
        self.names.append(name)
        return records

    def stop(self) -> None:
        """Stop recording the innermost call (leaving the mode after the outermost, when it is the innermost mode: one
        entered inside and not left, after an interrupt, stays)."""
        self.active.pop()
        self.names.pop()
        if not self.active:
            depth = torch._C._len_torch_function_stack()
            if depth and torch._C._get_function_stack_at(depth - 1) is self:
                self.__exit__(None, None, None)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training, inplace = _dropout_arguments(args, kwargs)
            if training and p > 0:
                keep = torch.rand(x.shape, device=x.device) >= p
                for records in self.active:
                    records.append((keep, p))
                return _apply(x, keep, p, inplace)
        if func is F.scaled_dot_product_attention and kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0):
            raise UnsupportedModuleError(
                f"{self.names[-1]} runs scaled_dot_product_attention with dropout, whose fused mask the exact "
                "fallback's rerun cannot replay; load the model with attn_implementation='eager' or set its attention "
                "dropout to 0"
            )
        result = func(*args, **kwargs)
        if func in DRAWS:
            drawn = result.detach().clone()  # the caller may change its draw in place (drop path's floor_)
            for records in self.active:
                records.append((drawn, None))
        return result


def by_example(records: Records, examples: int) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
    """The records ``[R_j, ...]`` whose rows ``B`` divides, as ``[B, R_j / B, ...]`` (their rows by example), and
    their indices: the vmapped input of :class:`RandomReplay`."""
    indices = tuple(j for j, (drawn, _) in enumerate(records) if drawn.ndim and drawn.shape[0] % examples == 0)
    return indices, tuple(
        records[j][0].reshape(examples, records[j][0].shape[0] // examples, *records[j][0].shape[1:]) for j in indices
    )


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` without dropout, in its reference maths (torch's documentation), which
    ``vmap(grad(...))`` differentiates where the fused CPU kernels are not (with respect to a mask)."""
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    weights = query @ key.transpose(-2, -1) * (1 / math.sqrt(query.size(-1)) if scale is None else scale)
    if is_causal:
        causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        weights = weights.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        weights = (
            weights.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else weights + attn_mask
        )
    return torch.softmax(weights, dim=-1) @ value


class RandomReplay(TorchFunctionMode):
    """Replays the recorded masks and draws in the dropout calls and draws of a rerun, in order (see the module's
    docstring).

    Args:
        records: the call's records.
        example: the example's rows of records by index (``[R_j / B, ...]`` under ``vmap``; :func:`by_example`).

    Attributes:
        whole: whether a record was replayed whole (shared by the batch, or a draw that decides a branch for all).
    """

    def __init__(self, records: Records, example: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.records = records
        self.example = example
        self.index = 0
        self.whole = False

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training, _ = _dropout_arguments(args, kwargs)
            if training and p > 0:
                return _apply(x, self._next(x.shape, dropout=True), p, inplace=False)
        if func in DRAWS:
            like = _empty_like_draw(func, args, kwargs)  # the draw's shape and dtype, drawing nothing
            return self._next(like.shape, dropout=False).to(like.dtype).clone()
        if func is F.scaled_dot_product_attention:  # without dropout: the recorder refused it with dropout
            return _attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _next(self, shape: torch.Size, *, dropout: bool) -> torch.Tensor:
        """The next record for a call of ``shape``: the example's rows of it, or the whole."""
        if self.index >= len(self.records):
            raise TypeError(f"the rerun draws random numbers more often than the call ({len(self.records)} times)")
        (record, p), example = self.records[self.index], self.example.get(self.index)
        self.index += 1
        if (p is not None) != dropout:
            raise TypeError("the rerun draws random numbers in another order than the call")
        if example is not None and example.shape == shape:
            return example
        if record.shape != shape:
            raise TypeError(f"the rerun draws random numbers of another shape ({tuple(shape)}) than the call")
        self.whole = True
        return record

    def finish(self) -> None:
        """Raise when the rerun used fewer records than the call made."""
        if self.index != len(self.records):
            raise TypeError(f"the rerun draws random numbers {self.index} times, the call {len(self.records)} times")
