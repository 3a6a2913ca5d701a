"""The smallest enclosing module that is per-sample, for parameters whose gradient the hooks cannot attribute to
examples where their own module runs (docs/design.md section 4.2): a parameter read outside its module's forward
(DeBERTa's ``rel_embeddings.weight``, read by the encoder), or a layer applied to rows that are not examples
(DeBERTa's ``pos_key_proj`` on relative positions ``[1, 2k, d]`` shared by the batch).

The attach probe (:mod:`~lightning_dp.checks.attach_probe`) tracks one forward of the model's example inputs with
:class:`UseTracker`: the calls running at each use of a trainable parameter, and the rows of every module's calls.
For each misplaced parameter, :func:`enclosing_units` takes the innermost module whose call ran every use, whose
subtree holds the parameter's module and whose every call returned one row per example: that module's exact fallback
(a rerun per example under ``torch.func``) gives the parameter's per-sample gradient, exact whatever happens inside.
The probe then runs again: the fallback's comparison checks that the module is per-sample, and the sum check (always
on in the probe) that no use of the probe's forward was missed. A use that only other inputs reach (a branch on the
sequence length) is caught by the sum check of the training batch that takes it, when one is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_dp.clipping.layers.fallback import own_parameters
from lightning_dp.clipping.layers.registry import MisplacedParametersError

#: ``{path: descendant paths relative to it}``: each enclosing module and the modules whose parameters it serves.
Enclosing = dict[str, tuple[str, ...]]


class _Uses(TorchFunctionMode):
    """Records the running module at each torch function that takes a tracked parameter and returns a tensor that
    requires grad (a detach or a copy under ``no_grad`` is not a use)."""

    def __init__(self, tracker: UseTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        tracker = self.tracker
        used = [id(x) for x in tree_leaves((args, kwargs)) if isinstance(x, nn.Parameter) and id(x) in tracker.tracked]
        if used and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(result)):
            calls = tuple(path for path in tracker.stack if path is not None)
            for key in used:
                tracker.uses.setdefault(key, set()).add(calls)
        return result


class UseTracker:
    """What one forward of ``root`` shows about where its trainable parameters are used.

    Attributes:
        uses: ``id(param) -> {calls}``, at each use the modules of ``root`` whose calls were running, outermost first
            (empty: outside every module of ``root``).
        rows: ``path -> {rows}``, the first dimension of the first tensor each call of the module returned.
    """

    def __init__(self, root: nn.Module) -> None:
        self._paths = {id(module): path for path, module in root.named_modules()}
        self.tracked = {id(p) for p in root.parameters() if p.requires_grad}
        self.uses: dict[int, set[tuple[str, ...]]] = {}
        self.rows: dict[str, set[int]] = {}
        self.stack: list[str | None] = []

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self._paths.get(id(module)))

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        path = self.stack.pop() if self.stack else None
        first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
        if path is not None and first is not None:
            self.rows.setdefault(path, set()).add(first.shape[0] if first.ndim else 0)

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Track the forward run within (global module hooks and a torch function mode, removed on exit)."""
        self.uses, self.rows, self.stack = {}, {}, []
        pre = nn.modules.module.register_module_forward_pre_hook(self._enter)
        post = nn.modules.module.register_module_forward_hook(self._exit, always_call=True)
        try:
            with _Uses(self):
                yield
        finally:
            pre.remove()
            post.remove()


def _inside(path: str, unit: str) -> bool:
    """Whether the module at ``path`` is ``unit`` or in its subtree."""
    return unit in ("", path) or path.startswith(f"{unit}.")


@dataclass
class _Problem:
    """Modules whose own parameters need an enclosing module, and the calls running at their parameters' uses."""

    owners: set[str]
    calls: set[tuple[str, ...]]

    def served_by(self, unit: str) -> bool:
        """Whether ``unit``'s call runs every use and its subtree holds every owner (so its rerun can vary them)."""
        return all(unit in calls for calls in self.calls) and all(_inside(owner, unit) for owner in self.owners)


def enclosing_units(
    root: nn.Module, error: MisplacedParametersError, tracker: UseTracker, rows: int, current: Enclosing
) -> Enclosing | None:
    """The enclosures that serve the misplaced parameters of ``error`` and those of ``current``, merged (a unit whose
    uses all run inside another's call gives its modules to it); None when one of them has no enclosing module.

    Each problem's unit is the innermost module whose call ran every use of its parameters, whose subtree holds their
    modules, and whose every call returned ``rows`` rows.

    Args:
        root: the model.
        error: the probe's refusal, naming the parameters used outside their module's forward and the modules whose
            calls had rows that are not examples.
        tracker: the probe's forward, tracked.
        rows: ``B K``, the rows of an example-wise call in that forward.
        current: the enclosures in force.
    """
    owners: dict[int, set[str]] = {}
    for path, module in root.named_modules():
        for param in own_parameters(module).values():
            if param.requires_grad:
                owners.setdefault(id(param), set()).add(path)
    by_name = dict(root.named_parameters())
    groups = [{id(by_name[name])} for name in error.parameters if name in by_name]
    modules = [*error.modules, *(f"{unit}.{sub}" if unit else sub for unit, subs in current.items() for sub in subs)]
    groups += [
        {id(p) for p in own_parameters(root.get_submodule(path)).values() if p.requires_grad} for path in modules
    ]
    units: dict[str, list[_Problem]] = {}
    for params in groups:
        problem = _Problem(set().union(*(owners.get(key, set()) for key in params)), set())
        for key in params:
            problem.calls |= tracker.uses.get(key, set())
        if not problem.owners or not problem.calls:
            return None
        innermost = max(problem.calls, key=len)
        unit = next(
            (path for path in reversed(innermost) if problem.served_by(path) and tracker.rows.get(path) == {rows}),
            None,
        )
        if unit is None:
            return None
        units.setdefault(unit, []).append(problem)
    for inner in sorted(units, key=lambda path: path.count(".") + bool(path), reverse=True):
        outer = next((u for u in units if u != inner and all(p.served_by(u) for p in units[inner])), None)
        if outer is not None:  # one rerun serves both
            units[outer] += units.pop(inner)
    return {
        unit: tuple(sorted({owner[len(unit) + 1 :] if unit else owner for p in problems for owner in p.owners} - {""}))
        for unit, problems in sorted(units.items())
    }
