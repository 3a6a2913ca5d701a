"""Run code once a third-party module is imported, without importing it (a post-import hook; docs/design.md section
2.1): the DP strategies join Lightning's ``StrategyRegistry``, and HF's ``Conv1D`` layer family registers.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once module ``name`` is imported (now if it already is); a deferred callback's exception
    becomes a warning.
    """
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder for one module that wraps its loader's ``exec_module`` to run ``callback`` afterwards, then leaves
    ``sys.meta_path`` (a lookup that loads nothing leaves it in place).
    """

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        others = (  # never another hook (two hooks on one name, e.g. after a reload, would ask each other forever)
            finder for finder in sys.meta_path if not isinstance(finder, _AfterImport) and hasattr(finder, "find_spec")
        )
        spec = next((found for finder in others if (found := finder.find_spec(fullname, path, target))), None)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_call(module: ModuleType) -> None:
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
                try:
                    self.callback()
                except Exception as error:  # the user's import must not fail because of ours
                    message = f"lightning_dp could not complete its set-up after importing {fullname}: {error!r}"
                    warnings.warn(message, stacklevel=2)

        spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec
