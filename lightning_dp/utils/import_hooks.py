"""Run code once a third-party module is imported, without importing it (a post-import hook).

``import lightning_dp`` does not import Lightning (seconds of start-up a command-line call or an HF-only script would
pay for nothing), yet ``Trainer(strategy="dp")`` must find the DP strategies in Lightning's ``StrategyRegistry``
whichever of ``lightning_dp`` and ``lightning`` the user imports first: :func:`when_imported` registers them as soon
as Lightning is there. The clipping engines register HF's ``Conv1D`` layer family the same way, when ``transformers``
is imported.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once the module ``name`` is imported: now if it already is, else right after its code has
    run (the module complete, before the import statement that asked for it returns). An exception from a deferred
    ``callback`` becomes a warning: the import of ``name`` itself still succeeds."""
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder that answers for one module only: it asks the other finders for it and wraps the loader's
    ``exec_module`` so ``callback`` runs right after the module's code, and leaves ``sys.meta_path`` then. A lookup
    that loads nothing (``importlib.util.find_spec``, as availability checks do) leaves it in place."""

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
