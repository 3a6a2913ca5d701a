"""Dropout inside a module the exact fallback reruns (docs/design.md section 4.2): the masks its call draws are
recorded, and the rerun of each example applies that example's rows of them, so the rerun is the same function of the
parameters as the call (``torch.func`` refuses random numbers under ``vmap``).

While a recorded module runs (train mode), ``F.dropout`` (``nn.Dropout`` included) is computed here as
``x * keep / (1 - p)`` with ``keep ~ Bernoulli(1 - p)`` drawn from the global RNG, as torch's dropout draws it; each
``keep`` is kept (bool) with the call. In the rerun the ``j``-th dropout call takes the ``j``-th mask: the example's
rows of it (``[R_j / B, ...]``) when the rerun's input has that shape, or the whole mask when the input is shared by
the batch (DeBERTa's dropout on its relative embeddings); another shape, or another number of dropout calls, is refused.
The fallback's first-batch comparison checks the replay with the rest of the rerun.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: The masks of one call: ``(keep, p)`` per dropout call, in call order.
Masks = list[tuple[torch.Tensor, float]]


def _dropout_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, float, bool, bool]:
    """``(input, p, training, inplace)`` of a call of ``F.dropout``."""
    names = ("input", "p", "training", "inplace")
    values: dict[str, Any] = {"p": 0.5, "training": True, "inplace": False}
    values.update(zip(names, args, strict=False))
    values.update(kwargs)
    return values["input"], float(values["p"]), bool(values["training"]), bool(values["inplace"])


def _apply(x: torch.Tensor, keep: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
    scale = keep.to(x.dtype) * (1.0 / (1.0 - p) if p < 1 else 0.0)
    return x.mul_(scale) if inplace else x * scale


class DropoutRecorder(TorchFunctionMode):
    """Records the dropout masks drawn while modules of :attr:`active` run; entered while any is active.

    Attributes:
        active: the masks of each recorded call running now, innermost last (a mask drawn goes to every one).
    """

    def __init__(self) -> None:
        super().__init__()
        self.active: list[Masks] = []

    def start(self) -> Masks:
        """Start recording a call (entering the mode for the outermost); returns its masks, filled as it runs."""
        if not self.active:
            self.__enter__()
        masks: Masks = []
        self.active.append(masks)
        return masks

    def stop(self) -> None:
        """Stop recording the innermost call (leaving the mode after the outermost)."""
        self.active.pop()
        if not self.active:
            self.__exit__(None, None, None)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training, inplace = _dropout_arguments(args, kwargs)
            if training and p > 0:
                keep = torch.rand(x.shape, device=x.device) >= p
                for masks in self.active:
                    masks.append((keep, p))
                return _apply(x, keep, p, inplace)
        return func(*args, **kwargs)


def by_example(masks: Masks, examples: int) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
    """The masks ``[R_j, ...]`` whose rows ``B`` divides, as ``[B, R_j / B, ...]`` (their rows by example), and their
    indices: the vmapped input of :class:`DropoutReplay`."""
    indices = tuple(j for j, (keep, _) in enumerate(masks) if keep.ndim and keep.shape[0] % examples == 0)
    return indices, tuple(
        masks[j][0].reshape(examples, masks[j][0].shape[0] // examples, *masks[j][0].shape[1:]) for j in indices
    )


class DropoutReplay(TorchFunctionMode):
    """Applies recorded masks to the dropout calls of a rerun, in order (see the module's docstring).

    Args:
        masks: the call's masks.
        example: the example's rows of masks by index (``[R_j / B, ...]`` under ``vmap``; :func:`by_example`).
    """

    def __init__(self, masks: Masks, example: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.masks = masks
        self.example = example
        self.index = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training, _ = _dropout_arguments(args, kwargs)
            if training and p > 0:
                if self.index >= len(self.masks):
                    raise TypeError(f"the rerun calls dropout more often than the call ({len(self.masks)} times)")
                keep, example = self.masks[self.index][0], self.example.get(self.index)
                self.index += 1
                if example is not None and example.shape == x.shape:
                    keep = example
                elif keep.shape != x.shape:
                    raise TypeError(f"the rerun calls dropout on another shape ({tuple(x.shape)}) than the call")
                return _apply(x, keep, p, inplace=False)
        return func(*args, **kwargs)

    def finish(self) -> None:
        """Raise when the rerun used fewer masks than the call drew."""
        if self.index != len(self.masks):
            raise TypeError(f"the rerun calls dropout {self.index} times, the call {len(self.masks)} times")
