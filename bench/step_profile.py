"""Where a DP step's extra time goes, operator by operator: the torch profiler around chosen training steps of a DP
variant and of the plain variant of the same path, and the difference per operator and input shapes.

A :class:`StepProfiler` is started and stopped around each step a bench times (its clocks' begin and end), so the
framework's set-up between fits is left out. Per step it keeps each operator's self time (CPU; on CUDA also the
device time of the kernels it launched) and call count, keyed by the operator's name and its inputs' shapes
(``group_by_input_shape``); a kernel's time counts once, as its launching operator's self device time (a kernel
launched outside an operator is left out). :func:`extra_operators` ranks the keys by what the DP step spends on them
beyond the plain step, each the median over the profiled steps (a load spike during a few steps does not move it):
the Gram matrices of the ghost norms, the noise, the norms, what an engine copies. The profiler adds a cost to every
operator call, so a step of many small operators looks slower under it than it runs: the rows compare DP with plain,
the timed tables give the times.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

#: Per key ``"name [shapes]"``: ``[cpu ms, device ms, calls]`` per profiled step.
Rows = dict[str, list[float]]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


class StepProfiler:
    """Accumulates per-operator self times over the steps between :meth:`begin` and :meth:`end` calls, leaving out
    the first ``skip`` (a DP fit's first step runs its one-off checks)."""

    def __init__(self, device: torch.device, skip: int = 0) -> None:
        self.cuda = device.type == "cuda"
        self._skip = skip
        self._steps: list[Rows] = []
        self._active: profile | None = None

    def begin(self) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._active = profile(activities=activities, record_shapes=True)
        self._active.__enter__()

    def end(self) -> None:
        if self._active is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self._active.__exit__(None, None, None)
        step: Rows = {}
        for event in self._active.key_averages(group_by_input_shape=True):
            if event.device_type != DeviceType.CPU:  # a kernel: its time is its launching operator's device time
                continue
            shapes = [list(s) for s in event.input_shapes if s]
            key = f"{event.key} {shapes}" if shapes else event.key
            row = step.setdefault(key, [0.0, 0.0, 0.0])
            row[0] += event.self_cpu_time_total / 1e3
            row[1] += event.self_device_time_total / 1e3
            row[2] += event.count
        self._active = None
        self._steps.append(step)

    def skip(self, steps: int) -> None:
        """Leave the next ``steps`` steps out (the first steps of a fit)."""
        self._skip = steps

    @property
    def steps(self) -> int:
        """The steps profiled so far."""
        return len(self._steps)

    def rows(self) -> Rows:
        """``{key: [cpu ms, device ms, calls]}``: per entry, the median over the profiled steps (0 for a step without
        the key)."""
        keys = {key for step in self._steps for key in step}
        zero = [0.0, 0.0, 0.0]
        return {
            key: [_median([step.get(key, zero)[i] for step in self._steps]) for i in range(3)] for key in sorted(keys)
        }


def extra_operators(dp: Rows, plain: Rows, *, device: bool, top: int = 12) -> dict[str, Any]:
    """The ``top`` operators (name and input shapes) on which ``dp`` spends the most time beyond ``plain``, and the
    totals of both: ``{"dp_ms", "plain_ms", "rows": [[key, dp ms, plain ms, dp calls, plain calls], ...]}``, times per
    step in ms, device time when ``device`` (CUDA) else CPU self time."""
    column = 1 if device else 0
    keys = set(dp) | set(plain)
    zero = [0.0, 0.0, 0.0]
    ranked = sorted(keys, key=lambda k: dp.get(k, zero)[column] - plain.get(k, zero)[column], reverse=True)
    rows = [
        [key, dp.get(key, zero)[column], plain.get(key, zero)[column], dp.get(key, zero)[2], plain.get(key, zero)[2]]
        for key in ranked[:top]
    ]
    return {
        "dp_ms": sum(row[column] for row in dp.values()),
        "plain_ms": sum(row[column] for row in plain.values()),
        "rows": rows,
    }
