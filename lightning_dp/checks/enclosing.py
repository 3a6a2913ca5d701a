"""The smallest enclosing module that is per-sample, for parameters whose gradient the hooks cannot attribute to
examples where their own module runs (docs/design.md section 4.2): a parameter read outside its module's forward
(DeBERTa's ``rel_embeddings.weight``, read by the encoder), or a layer applied to rows that are not examples
(DeBERTa's ``pos_key_proj`` on relative positions ``[1, 2k, d]`` shared by the batch).

The attach probe (:mod:`~lightning_dp.checks.attach_probe`) tracks one forward of the model's example inputs with
:class:`UseTracker`: the module running at each use of a trainable parameter, and the rows of every module's calls.
For each misplaced parameter, :func:`enclosing_units` takes the deepest module whose forward contains its module and
every use, then climbs to the first ancestor whose every call returned one row per example: that module's exact
fallback (a rerun per example under ``torch.func``) gives the parameter's per-sample gradient, exact whatever happens
inside. The fallback's first-batch comparison then checks that the module is per-sample, and the sum check that no
use was missed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
            where = next((path for path in reversed(tracker.stack) if path is not None), None)
            for key in used:
                tracker.uses.setdefault(key, set()).add(where)
        return result


class UseTracker:
    """What one forward of ``root`` shows about where its trainable parameters are used.

    Attributes:
        uses: ``id(param) -> {path}``, the innermost module of ``root`` running at each use (None: outside every
            module of ``root``).
        rows: ``path -> {rows}``, the first dimension of the first tensor each call of the module returned.
    """

    def __init__(self, root: nn.Module) -> None:
        self._paths = {id(module): path for path, module in root.named_modules()}
        self.tracked = {id(p) for p in root.parameters() if p.requires_grad}
        self.uses: dict[int, set[str | None]] = {}
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


def _ancestors(path: str) -> Iterator[str]:
    """``path``, its parent, ..., the root ``''``."""
    parts = path.split(".") if path else []
    for end in range(len(parts), -1, -1):
        yield ".".join(parts[:end])


def _common_ancestor(paths: set[str]) -> str:
    split = [path.split(".") if path else [] for path in paths]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _inside(path: str, unit: str) -> bool:
    return unit == "" or path.startswith(f"{unit}.")


def enclosing_units(
    root: nn.Module, error: MisplacedParametersError, tracker: UseTracker, rows: int, current: Enclosing
) -> Enclosing | None:
    """The enclosures that serve the misplaced parameters of ``error`` and those of ``current``, merged (a unit inside
    another gives its modules to the outer one); None when one of them has no enclosing module that is per-sample.

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
    problems: list[set[int]] = [{id(by_name[name])} for name in error.parameters if name in by_name]
    for path in error.modules:
        own = {id(p) for p in own_parameters(root.get_submodule(path)).values() if p.requires_grad}
        problems.append(own)
    units: dict[str, set[str]] = {
        unit: {f"{unit}.{sub}" if unit else sub for sub in subs} for unit, subs in current.items()
    }
    for params in problems:
        enclosed = set().union(*(owners.get(key, set()) for key in params))
        sites: set[str | None] = set(enclosed)
        for key in params:
            sites |= tracker.uses.get(key, set())
        if not enclosed or None in sites:
            return None
        unit = next(
            (
                path
                for path in _ancestors(_common_ancestor({s for s in sites if s is not None}))
                if tracker.rows.get(path) == {rows}
            ),
            None,
        )
        if unit is None:
            return None
        units.setdefault(unit, set()).update(enclosed - {unit})
    for inner in sorted(units, key=len, reverse=True):  # nested units: the outermost serves all
        outer = next((u for u in units if u != inner and _inside(inner, u)), None)
        if outer is not None:
            units[outer] |= units.pop(inner) - {outer}
    return {
        unit: tuple(sorted(path[len(unit) + 1 :] if unit else path for path in paths))
        for unit, paths in sorted(units.items())
    }
