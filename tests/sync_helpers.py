"""Counting host-device synchronising calls (tests/engine/test_host_syncs.py, bench/op_count.py).

:class:`SyncRecorder` is a ``TorchFunctionMode`` that records every call which reads a tensor's value on the host
(``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``cpu``, ``numpy``, ``.to("cpu")``,
printing) or whose output shape depends on the values (``nonzero``, ``masked_select``, ``unique``, boolean-mask
indexing, ...): on a GPU each is a device synchronisation. On the CPU nothing synchronises, but the same calls are
made, so counting them on the CPU counts the syncs a GPU run would make. Each record keeps the Python stack, so a test
can tell the library's own calls (a frame in ``lightning_dp/``) from the framework's and the model's.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import lightning_dp

LIBRARY = str(Path(lightning_dp.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)

#: functions that read a value on the host.
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "__repr__", "__format__"}
#: functions whose output shape depends on the values (a GPU syncs to size the output).
DATA_DEPENDENT = {
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "bincount",
    "repeat_interleave",
    "nonzero_static",
}

#: ``(file name, function)`` of the library's calls that a GPU does not make: ``zero_and_finite_rows`` gathers the rows
#: to read on the CPU only, and reduces the whole factor on a device.
CPU_ONLY = {("rows.py", "zero_and_finite_rows")}


def _is_sync(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name in READS or name in DATA_DEPENDENT:
        if name == "repeat_interleave":  # a tensor of repeats without output_size sizes its output from the values
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        return True
    if name == "to":  # to("cpu") by name; .to(device) of device-agnostic code stays on the device
        return any(isinstance(a, str) and a.startswith("cpu") for a in (*args[1:], *kwargs.values()))
    if name in ("__getitem__", "index", "index_put_", "__setitem__"):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple | list) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    if name == "where":
        return len(args) + len(kwargs) == 1
    return False


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
        """The call is the library's own: its caller is in ``lightning_dp/``, or the innermost frame outside torch is
        (a torch helper called by the library that reads a value)."""
        outside_torch = [f for f in self.stack if not f.filename.startswith(TORCH)]
        return bool(outside_torch) and outside_torch[-1].filename.startswith(LIBRARY)

    @property
    def cpu_only(self) -> bool:
        """The call is made on the CPU only (:data:`CPU_ONLY`): a GPU takes another path there, which its CUDA case
        runs under ``torch.cuda.set_sync_debug_mode("error")``."""
        return any((Path(f.filename).name, f.name) in CPU_ONLY for f in self.stack)

    def where(self) -> str:
        frame = self.caller
        return f"{self.name} at {frame.filename}:{frame.lineno} ({frame.name})"


@dataclass
class SyncRecorder(TorchFunctionMode):
    """Records the synchronising calls made while :attr:`active` (see the module docstring), but those a GPU does not
    make (:data:`CPU_ONLY`)."""

    calls: list[SyncCall] = field(default_factory=list)
    active: bool = False

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.active:
            name = getattr(func, "__name__", str(func))
            if _is_sync(name, args, kwargs):
                call = SyncCall(name, traceback.extract_stack()[:-1])
                if not call.cpu_only:
                    self.calls.append(call)
        return func(*args, **kwargs)

    def library_calls(self) -> list[SyncCall]:
        return [call for call in self.calls if call.in_library]

    def report(self) -> str:
        return "\n".join(call.where() for call in self.calls)
