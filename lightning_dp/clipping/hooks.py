"""Capture of layer activations and output gradients through module hooks, attached in place.

Each supported module gets a forward hook that stores its first input and registers a tensor hook on its output;
the tensor hook stores the gradient w.r.t. that output. One :class:`Capture` is recorded per call, so a module
called twice in one forward yields two captures (their per-sample gradients are summed by the engines).

Why forward hook + tensor hook rather than ``register_full_backward_hook``: full backward hooks wrap the module's
inputs and outputs in a ``BackwardHookFunction``, which fails when the output is then modified in place (e.g.
``x = linear(x); x.relu_()``) and needs special handling for first layers whose input does not require grad. A tensor
hook registered on the output before an in-place op receives the gradient w.r.t. the value the module produced
(PyTorch's documented semantics for hooks on tensors later modified in place), and works whatever the inputs. The
one exception is an output that is a view of another tensor (``nn.Linear`` on ``[B, T, d]``, HF ``Conv1D``): an
in-place op rebases the view's autograd history and its hook never fires, so such outputs are replaced by a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_dp.clipping.registry import LayerFamily


@dataclass
class Capture:
    """One call of a hooked module.

    Attributes:
        name: the module's path in the root module.
        module: the module.
        family: its layer family.
        activation: its first input, detached (``[B, ...]``).
        output_grad: gradient of the first-pass loss w.r.t. its output (``[B, ...]``); None until the first pass
            reaches it (and None for calls whose output does not influence the loss).
    """

    name: str
    module: nn.Module
    family: LayerFamily
    activation: torch.Tensor
    output_grad: torch.Tensor | None = None


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return next(iter(kwargs.values()), None)


class CaptureHooks:
    """Hooks on a set of modules recording :class:`Capture` objects.

    Forward calls are recorded only when gradients are enabled and the hooks are not suspended (so ``no_grad``
    evaluation, ``generate()`` and the clipper's own passes record nothing); output gradients only inside
    :meth:`capturing_grads`.

    Args:
        modules: ``{path: (module, family)}`` to hook.
    """

    def __init__(self, modules: dict[str, tuple[nn.Module, LayerFamily]]) -> None:
        self.captures: list[Capture] = []
        self._batch_hint = 0
        self._suspended = False
        self._grads_on = False
        self._handles: list[RemovableHandle] = []
        self.attached = True
        for name, (module, family) in modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name, family), with_kwargs=True))
            if family.expand_batch:
                self._handles.append(module.register_forward_pre_hook(self._expand_hook, with_kwargs=True))

    def _recording(self) -> bool:
        return torch.is_grad_enabled() and not self._suspended

    def _expand_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Expand a broadcast first input ``[1, ...]`` to the batch size of the most recently recorded call.

        In HF models the broadcast ``position_ids`` embedding runs right after the token embedding, whose output
        gives the batch size. When no earlier call fixes it, nothing is expanded and the clipper reports the batch
        mismatch at backward.
        """
        x = _first_input(args, kwargs)
        if not self._recording() or not isinstance(x, torch.Tensor) or x.ndim == 0:
            return None
        if x.shape[0] != 1 or self._batch_hint <= 1:
            return None
        x = x.expand(self._batch_hint, *x.shape[1:])
        if args:
            return (x, *args[1:]), kwargs
        first = next(iter(kwargs))
        return args, {**kwargs, first: x}

    def _forward_hook(self, name: str, family: LayerFamily) -> Callable[..., torch.Tensor | None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> torch.Tensor | None:
            x = _first_input(args, kwargs)
            if not self._recording() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            if output._base is not None:
                # A view (e.g. Linear on [B, T, d]) modified in place later is rebased onto its base, and a hook on
                # it would never fire; a copy owns its storage (the view is then freed, so memory is unchanged).
                output = output.clone()
            capture = Capture(name, module, family, x.detach())
            self.captures.append(capture)
            self._batch_hint = output.shape[0] if output.ndim else 0

            def grad_hook(grad: torch.Tensor) -> None:
                if self._grads_on:
                    capture.output_grad = grad if capture.output_grad is None else capture.output_grad + grad

            output.register_hook(grad_hook)
            return output

        return hook

    @contextmanager
    def capturing_grads(self) -> Iterator[None]:
        """Within this context, backward passes store output gradients and forward calls are not recorded."""
        self._grads_on, self._suspended = True, True
        try:
            yield
        finally:
            self._grads_on, self._suspended = False, False

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Within this context, nothing is recorded (used for the clipper's second backward)."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def clear(self) -> None:
        """Forget all captures (after each clipped batch)."""
        self.captures = []
        self._batch_hint = 0

    def remove(self) -> None:
        """Remove every hook this object registered and forget all captures."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.attached = False
        self.clear()
