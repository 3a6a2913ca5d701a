"""Recording host-device synchronising calls (tests/engine/test_host_syncs.py): :class:`SyncRecorder` is a
``TorchFunctionMode`` that records every call which bench/host_reads.py (shared with bench/op_count.py) counts as a
synchronisation on a GPU, with its Python stack, so that a test can tell the library's own calls (a frame in
``lightning_dp/``) from the framework's and the model's.
"""

from __future__ import annotations

import importlib.util
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.overrides import TorchFunctionMode


def _host_reads() -> Any:
    """``bench/host_reads.py`` as a module (``bench/`` is not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "host_reads.py"
    spec = importlib.util.spec_from_file_location("host_reads", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


host_reads = _host_reads()


@dataclass
class SyncCall:
    """One synchronising call: the function's name and the stack (innermost last) that made it."""

    name: str
    stack: list[traceback.FrameSummary]

    @property
    def caller(self) -> traceback.FrameSummary:
        """The frame that called the torch function (the innermost frame outside this module)."""
        return self.stack[-1]

    @property
    def in_library(self) -> bool:
        """The call is the library's own (:func:`host_reads.in_library`)."""
        return bool(host_reads.in_library(self.stack))

    def where(self) -> str:
        frame = self.caller
        return f"{self.name} at {frame.filename}:{frame.lineno} ({frame.name})"


@dataclass
class SyncRecorder(TorchFunctionMode):
    """Records the synchronising calls made while :attr:`active` (:func:`host_reads.is_sync`), but those a GPU does not
    make (:func:`host_reads.cpu_only`)."""

    calls: list[SyncCall] = field(default_factory=list)
    active: bool = False

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.active:
            name = getattr(func, "__name__", str(func))
            if host_reads.is_sync(name, args, kwargs):
                stack = traceback.extract_stack()[:-1]
                if not host_reads.cpu_only(stack):
                    self.calls.append(SyncCall(name, stack))
        return func(*args, **kwargs)

    def library_calls(self) -> list[SyncCall]:
        return [call for call in self.calls if call.in_library]

    def report(self) -> str:
        return "\n".join(call.where() for call in self.calls)
