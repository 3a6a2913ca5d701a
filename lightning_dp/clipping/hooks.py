"""Capture of layer activations and of the autograd edges of layer outputs, through forward hooks attached in place.

One :class:`Capture` per call of a hooked module: its first input and the gradient edge of its output (the base's
edge for a pure-reshape view; other views are copied). The clipper's ``torch.autograd.grad`` to those edges yields
the output gradients without parameter gradients (docs/design.md section 4.1).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from lightning_dp.clipping.layers.fallback import (
    CapturedCall,
    covered_parameters,
    join_outputs,
    refuse_example_lists,
    split_joined,
)
from lightning_dp.clipping.layers.random_replay import RandomRecorder, Records
from lightning_dp.clipping.layers.registry import LayerFamily, UnsupportedModuleError
from lightning_dp.clipping.multiplicity import fold_copies
from lightning_dp.clipping.recomputation import recomputing, save_input, saved_tensor_hooks_active
from lightning_dp.clipping.terms import Term


@dataclass
class Capture:
    """One call of a hooked module.

    Attributes:
        name: the module's path in the root module.
        module: the module.
        family: its layer family.
        activation: its first input, detached (``[B, ...]``; shares storage and version counter with the input);
            inside an activation-checkpointed region None until the backward hands over the recomputed input
            (:mod:`~.recomputation`).
        activation_version: the input's version counter at the call.
        edge: the autograd edge of its output (or of the output's base).
        output_shape: the output's shape (the gradient at ``edge`` is reshaped to it).
        output_grad: gradient of the loss w.r.t. the output (``[B, ...]``); None until the clipper's backward, or when
            the output does not reach the loss.
        leaves: the parameters as the call used them, by attribute name (under FSDP2, the unsharded ones).
        parameter_values: detached copies of ``leaves`` at the call for a family with ``reads_parameters`` (and for
            the fallback when parameters may change before the terms are formed); else None.
        call: every input of the call, for a family with ``captures_call``; else None.
        expanded: whether the first input was a broadcast ``[1, ...]`` expanded to the batch before the call (or
            the fallback's output computed from parameters alone was expanded to the rows where it is used).
        fold_rows: when the first input's rows fold, sample-major, the rows of a tensor with a leading dimension of
            ``fold_rows`` (a reshape of it, directly or through element-wise operations): that dimension; else None.
    """

    name: str
    module: nn.Module
    family: LayerFamily
    activation: torch.Tensor | None
    activation_version: int
    edge: GradientEdge
    output_shape: torch.Size
    leaves: dict[str, torch.Tensor]
    parameter_values: dict[str, torch.Tensor] | None = None
    output_grad: torch.Tensor | None = None
    call: CapturedCall | None = None
    expanded: bool = False
    fold_rows: int | None = None

    def modified(self) -> bool:
        """Whether an input of the call was modified in place after the module ran."""
        if self.call is not None:
            return self.call.modified()
        return self.activation is not None and self.activation._version != self.activation_version

    def recomputed(self, x: torch.Tensor) -> None:
        """Take the call's first input ``x`` as the backward recomputed it (a checkpointed region). The recomputation
        repeats the forward's operations, so ``x`` then has the version the forward's input had at the call, unless
        the region modified it in place after the call (:meth:`modified`)."""
        self.activation = x.detach()

    def layer_terms(self, rows: int) -> dict[str, Term]:
        """The family's terms for this call per example, ``{param attribute: Term}`` (after the backward set
        ``output_grad``), each example's ``rows`` consecutive rows folded (:func:`~.multiplicity.fold_copies`)."""
        assert self.output_grad is not None  # only captures the backward pass reached have terms
        if self.activation is None:  # checkpointed: the node on the call's outputs hands over the recomputed input
            raise UnsupportedModuleError(
                f"module '{self.name}' ({type(self.module).__name__}) in an activation-checkpointed region got an "
                "output gradient that passed through none of its call's outputs, so its recomputed input never "
                "reached the clipper: checkpoint the model without it, or freeze its parameters (requires_grad=False)"
            )
        if self.call is not None:  # such a family folds its rows itself
            values = self.parameter_values or {k: v.detach() for k, v in self.leaves.items()}
            return self.family.terms(self.name, self.module, self.call, self.output_grad, values, rows)
        extra = () if self.parameter_values is None else (self.parameter_values,)
        terms = self.family.terms(self.module, self.activation, self.output_grad, *extra)
        return {name: fold_copies(term, rows) for name, term in terms.items()}

    def keep_parameter_values(self) -> None:
        """Copy the parameters of the module and its submodules as they are now (their values at the call, for terms
        formed after later updates: per-sample momentum's past iterates)."""
        if self.call is not None and self.parameter_values is None:  # (copied at the call under FSDP2)
            self.parameter_values = {k: p.detach().clone() for k, p in self.module.named_parameters()}

    def release(self) -> None:
        """Drop the captured activation and output gradient; the capture is not used again."""
        self.activation = self.output_grad = None
        self.parameter_values = None
        self.call = None


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return next(iter(kwargs.values()), None)


def _reshaped_base(output: torch.Tensor) -> torch.Tensor | None:
    """``output``'s base when ``output`` is a pure reshape of its contiguous base, else None."""
    base = output._base
    is_reshape = (
        base is not None
        and base.requires_grad
        and base.grad_fn is not None
        and output.is_contiguous()
        and base.is_contiguous()
        and output.numel() == base.numel()
        and output.storage_offset() == base.storage_offset()
    )
    return base if is_reshape else None


#: autograd nodes of element-wise operations: a tensor they produce keeps its inputs' rows in place.
_ELEMENTWISE = frozenset(
    f"{name}Backward{overload}"
    for name in (
        "Add", "Sub", "Mul", "Div", "Neg", "Relu", "Gelu", "Silu", "Tanh", "Sigmoid", "NativeDropout", "Clone",
        "ToCopy", "Pow", "Exp", "Hardtanh", "LeakyRelu", "Elu", "Softplus", "Abs", "Sqrt", "Rsqrt", "Erf",
    )
    for overload in (0, 1)
)  # fmt: skip


def _pure_reshape_of(x: torch.Tensor) -> torch.Tensor | None:
    """The contiguous tensor ``x`` is a pure reshape of (same storage, offset and size), or None."""
    base = x._base
    if base is None or base.ndim == 0 or not (x.is_contiguous() and base.is_contiguous()):
        return None
    if x.storage_offset() != base.storage_offset() or x.numel() != base.numel():
        return None
    return base


def _save_call_input(
    whole: Any, output: torch.Tensor, index: int | None, x: torch.Tensor, sink: Callable[[torch.Tensor], None] | None
) -> tuple[Any, torch.Tensor]:
    """Pass the hooked ``output`` of a call in a checkpointed region, and the other differentiable tensors of its
    result ``whole`` when that is a tuple (``index``: the hooked one's position), through one node saving the call's
    input ``x`` (:func:`~.recomputation.save_input`). Returns ``whole`` with those tensors replaced and the new
    ``output``."""
    others = []
    if index is not None and isinstance(whole, tuple):
        others = [i for i, t in enumerate(whole) if i != index and isinstance(t, torch.Tensor) and t.requires_grad]
    first, *rest = save_input([output, *(whole[i] for i in others)], x, sink)
    if others:
        items = list(whole)
        for i, tensor in zip(others, rest, strict=True):
            items[i] = tensor
        whole = tuple(items)
    return whole, first


class CaptureHooks:
    """Hooks on a set of modules recording :class:`Capture` objects (only with gradients enabled and not suspended).

    Args:
        modules: ``{path: (module, family)}`` to hook.
        copy_parameters: copy the parameters a ``captures_call`` family's call used (FSDP2 frees them after the
            forward).
        record_outputs: keep the fallback's outputs for its comparison (off under FSDP2).
    """

    def __init__(
        self,
        modules: dict[str, tuple[nn.Module, LayerFamily]],
        copy_parameters: bool = False,
        record_outputs: bool = True,
    ) -> None:
        self.captures: list[Capture] = []
        #: keep a fallback call's output for its comparison while its split is not confirmed (off under FSDP2)
        self.record_outputs = record_outputs
        #: ``(id(module), call signature) -> positions`` of the inputs split by example, confirmed by the fallback's
        #: comparison on two examples or more (:class:`~.layers.fallback.CapturedCall`)
        self.confirmed_inputs: dict[tuple[int, Hashable], tuple[int, ...]] = {}
        self._copy_parameters = copy_parameters
        self._batch_hint = 0
        #: ids of the modules whose first input the pre-hook just expanded (consumed by their forward hook)
        self._expanded: set[int] = set()
        #: ``id(module) -> rows`` its broadcast input or output was expanded to by the forward's calls of this batch,
        #: for their recomputation under checkpointing (:meth:`_expansion`)
        self._expansions: dict[int, set[int]] = {}
        #: (autograd node, output number) of the outputs of calls whose rows fold a tensor's leading dimension: (that
        #: dimension, rows)
        self._fold_nodes: dict[Any, tuple[int, int]] = {}
        self._suspended = False
        #: the dropout masks and random draws of the calls of rerun families (:mod:`~.layers.random_replay`)
        self._random = RandomRecorder()
        self._recorded: list[tuple[int, Records]] = []
        self._handles: list[RemovableHandle] = []
        self.attached = True
        self._names = {
            id(module): f"module '{name}' ({type(module).__name__})" for name, (module, _) in modules.items()
        }
        for name, (module, family) in modules.items():
            # prepend: before any forward hook already on the module. FSDP2's own (a layer that is its own FSDP unit)
            # puts the sharded parameters back, and a user's hook may replace the output; the capture needs the
            # weights the forward used and the layer's own output.
            hook = self._forward_hook(name, family)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True, prepend=True))
            if family.expand_batch:
                self._handles.append(module.register_forward_pre_hook(self._expand_hook, with_kwargs=True))
            if family.reruns:  # its dropout masks and random draws, recorded for the rerun
                self._handles.append(module.register_forward_pre_hook(self._start_recording))
                self._handles.append(module.register_forward_hook(self._stop_recording, always_call=True))

    def _recording(self) -> bool:
        return torch.is_grad_enabled() and not self._suspended

    def _start_recording(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # also in a checkpointed region's recomputation: its dropout then draws as in the forward (records unused)
        if self._recording() or recomputing():
            self._recorded.append((id(module), self._random.start(self._names[id(module)])))

    def _stop_recording(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._recorded and self._recorded[-1][0] == id(module):
            self._recorded.pop()
            self._random.stop()

    def _draws(self, module: nn.Module) -> Records:
        """The random records of the running call of ``module`` (empty when none is recorded)."""
        return self._recorded[-1][1] if self._recorded and self._recorded[-1][0] == id(module) else []

    def _expand_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Expand a broadcast first input ``[1, ...]`` to the batch size of the most recently recorded call (HF
        ``position_ids``); with no earlier call nothing is expanded.
        """
        x = _first_input(args, kwargs)
        if not (self._recording() or recomputing()) or not isinstance(x, torch.Tensor) or x.ndim == 0:
            return None
        if x.shape[0] != 1:
            return None
        rows = self._expansion(module)
        if rows <= 1:
            return None
        x = x.expand(rows, *x.shape[1:])
        self._expanded.add(id(module))
        if args:
            return (x, *args[1:]), kwargs
        first = next(iter(kwargs))
        return args, {**kwargs, first: x}

    def _expansion(self, module: nn.Module) -> int:
        """The rows a broadcast ``[1, ...]`` input or output of ``module``'s call is expanded to (none when at most
        1): those of the most recently recorded call; in a checkpointed region's recomputation, which runs in the
        backward, those the forward expanded the module's calls of this batch to.

        Raises:
            UnsupportedModuleError: in a recomputation, when the forward expanded the module's calls of this batch
                to different rows (the recomputation cannot tell its calls apart).
        """
        if not recomputing():
            rows = self._batch_hint if self._batch_hint > 1 else 0
            self._expansions.setdefault(id(module), set()).add(rows)
            return rows
        counts = self._expansions.get(id(module), {0})
        if len(counts) > 1:
            raise UnsupportedModuleError(
                f"{self._names[id(module)]} expands a broadcast [1, ...] input or output to {sorted(counts)} rows "
                "(0: none) in the calls of one batch, which an activation-checkpointed recomputation cannot tell "
                "apart: checkpoint the model without it"
            )
        return next(iter(counts))

    def _fold_rows(self, x: Any) -> int | None:
        """The leading dimension of the tensor whose rows ``x`` holds sample-major, folded: ``x`` a pure reshape of
        it, or made from such tensors (outputs of calls that fold) by element-wise operations; else None."""
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return None
        base = _pure_reshape_of(x)
        if base is not None and 0 < base.shape[0] != x.shape[0] and x.shape[0] % base.shape[0] == 0:
            return base.shape[0]
        return self._node_fold_rows(x.grad_fn, x.output_nr, x.shape[0], depth=4)

    def _node_fold_rows(self, node: Any, output_nr: int, rows: int, depth: int) -> int | None:
        """The fold of output ``output_nr`` of ``node`` when it has ``rows`` rows: a folding call's output of those
        rows, or an element-wise node all of whose inputs with a gradient are (parameters and constants aside)."""
        if node is None:
            return None
        if (node, output_nr) in self._fold_nodes:
            fold, node_rows = self._fold_nodes[node, output_nr]
            return fold if node_rows == rows else None
        if depth == 0 or type(node).__name__ not in _ELEMENTWISE:
            return None
        found = set()
        for child, child_nr in node.next_functions:
            if child is None or type(child).__name__ == "AccumulateGrad":  # a constant or a parameter
                continue
            child_fold = self._node_fold_rows(child, child_nr, rows, depth - 1)
            if child_fold is None:
                return None
            found.add(child_fold)
        return found.pop() if len(found) == 1 else None

    def _forward_hook(self, name: str, family: LayerFamily) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            x = _first_input(args, kwargs)
            rerun = recomputing()  # a checkpointed region's recomputation: the forward's outputs, no capture
            if not (rerun or self._recording()):
                return None
            if family.reruns:
                refuse_example_lists(name, module, args, kwargs)  # at every call, whatever the batch size
            whole = output
            if family.output_index is not None and isinstance(output, tuple):  # a router's (logits, ...)
                output = output[family.output_index]
            joined = None
            if family.reruns and not isinstance(output, torch.Tensor):  # a tuple, an HF ModelOutput: joined
                output, positions, spec = join_outputs(output, name, module)
                joined = (spec, positions)
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            replaced = None
            single = family.reruns and joined is None and output.ndim and output.shape[0] == 1
            if single and not any(isinstance(t, torch.Tensor) for t in tree_leaves((args, kwargs))):
                rows = self._expansion(module)
                if rows > 1:
                    # a bias computed from parameters alone, [1, ...], broadcast to the rows where it is used (Swin's
                    # relative position bias): expanded to the rows of the latest call, so its gradient stays per row
                    output = replaced = output.expand(rows, *output.shape[1:]).clone()
                    self._expanded.add(id(module))
            base = _reshaped_base(output)
            if base is not None:
                edge = get_gradient_edge(base)
            else:
                if output._base is not None:
                    # Another kind of view would leave the graph if modified in place; a copy owns its storage
                    # (the view is then freed, so memory is unchanged).
                    output = replaced = output.clone()
                edge = get_gradient_edge(output)
            # checkpointed (saved-tensors hooks active): the input is taken from the recomputation, not kept
            deferred = isinstance(x, torch.Tensor) and not family.captures_call and saved_tensor_hooks_active()
            if rerun:
                self._expanded.discard(id(module))
                if deferred:
                    whole, replaced = _save_call_input(whole, output, family.output_index, x, None)
                return self._result(whole, output, replaced, joined, family.output_index)
            leaves: dict[str, torch.Tensor] = dict(covered_parameters(module, family.encloses))
            values = {k: leaves[k].detach().clone() for k in family.reads_parameters} or None
            call = None
            if family.captures_call:
                call = CapturedCall.record(args, kwargs, output)
                call.joined = joined
                call.draws = self._draws(module)
                call.batched = self.confirmed_inputs.get((id(module), call.signature))
                if family.reruns and call.batched is None and self.record_outputs:
                    call.output = output.detach().clone()  # for the fallback's comparison
                if self._copy_parameters:
                    values = {k: v.detach().clone() for k, v in leaves.items()}
            activation = None if deferred else x.detach() if isinstance(x, torch.Tensor) else output.detach()
            version = x._version if isinstance(x, torch.Tensor) else 0
            capture = Capture(name, module, family, activation, version, edge, output.shape, leaves, values, call=call)
            self.captures.append(capture)
            capture.expanded = id(module) in self._expanded
            self._expanded.discard(id(module))
            capture.fold_rows = self._fold_rows(x)
            if deferred:
                whole, replaced = _save_call_input(whole, output, family.output_index, x, capture.recomputed)
            if capture.fold_rows is not None and output.ndim:
                for tensor in (output, replaced):  # a node of several outputs (SaveInput) folds only this one
                    if tensor is not None and tensor.grad_fn is not None:
                        self._fold_nodes[tensor.grad_fn, tensor.output_nr] = (capture.fold_rows, output.shape[0])
            self._batch_hint = output.shape[0] if output.ndim else 0
            return self._result(whole, output, replaced, joined, family.output_index)

        return hook

    @staticmethod
    def _result(
        whole: Any,
        output: torch.Tensor,
        replaced: torch.Tensor | None,
        joined: tuple[Any, Any] | None,
        output_index: int | None,
    ) -> Any:
        """What the forward hook returns: the output rebuilt from views of the joined tensor, whose gradient is
        captured; the call's outputs with ``replaced`` for the hooked output; or None (unchanged)."""
        if joined is not None:
            return split_joined(whole, output, joined[1])
        if replaced is not None and output_index is not None and whole is not output:
            return (*whole[:output_index], replaced, *whole[output_index + 1 :])
        return replaced

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Within this context, nothing is recorded (the clipper's own passes)."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def clear(self) -> None:
        """Forget all captures (after each clipped batch), and stop recording calls a ``BaseException`` left
        running."""
        while self._recorded:
            self._recorded.pop()
            self._random.stop()
        self.captures = []
        self._fold_nodes = {}
        self._expansions = {}
        self._batch_hint = 0

    def remove(self) -> None:
        """Remove every hook this object registered and forget all captures."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.attached = False
        self.clear()
