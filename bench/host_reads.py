"""Which torch calls synchronise a GPU with the host: those that read a tensor's value on the host (``item``,
``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``cpu``, ``numpy``, ``.to("cpu")``, printing) and
those whose output shape depends on the values (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing,
...). On the CPU nothing synchronises, but the same calls are made, so recording them on the CPU (a
``TorchFunctionMode`` that passes every call's name and arguments to :func:`is_sync`) counts the syncs a GPU run would
make. One definition for bench/op_count.py, which counts them per step, and tests/sync_helpers.py, with which
tests/engine/test_host_syncs.py asserts that a DP step makes none of its own.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

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

#: ``(file name, function)`` of the library's calls that a GPU does not make (``lightning_dp.clipping.rows.gathers``):
#: on the CPU only, ``zero_and_finite_rows`` gathers the rows to read, and ``zero_rows_`` writes the rows to zero; on a
#: device each passes over the whole factor.
CPU_ONLY = {("rows.py", "zero_and_finite_rows"), ("rows.py", "zero_rows_")}

Stack = list[traceback.FrameSummary]


def is_sync(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the torch function ``name`` called with ``args`` and ``kwargs`` synchronises a GPU with the host."""
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


def in_library(stack: Stack) -> bool:
    """Whether a call with ``stack`` (innermost frame last) is the library's own: the innermost frame outside torch is
    in ``lightning_dp/`` (the library's call, or a torch helper's that the library called)."""
    outside_torch = [f for f in stack if not f.filename.startswith(TORCH)]
    return bool(outside_torch) and outside_torch[-1].filename.startswith(LIBRARY)


def gathering_on_the_cpu() -> bool:
    """Whether the library takes its CPU paths on the CPU (``lightning_dp.clipping.rows.GATHERING_DEVICES`` holds
    ``"cpu"``; a library from before that switch always does): not while a caller has emptied it to take a GPU's."""
    try:
        from lightning_dp.clipping import rows
    except ImportError:
        return True
    return "cpu" in getattr(rows, "GATHERING_DEVICES", {"cpu"})


def cpu_only(stack: Stack) -> bool:
    """Whether a call with ``stack`` is made on the CPU only (:data:`CPU_ONLY`) while the library takes its CPU paths
    (:func:`gathering_on_the_cpu`): a GPU takes another path there, which the CUDA tests run under
    ``torch.cuda.set_sync_debug_mode("error")``, and which runs on the CPU, every read counted, once those paths are
    switched off."""
    return gathering_on_the_cpu() and any((Path(f.filename).name, f.name) in CPU_ONLY for f in stack)
