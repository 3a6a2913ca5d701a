"""What a run's numbers depend on besides its command and seed: library versions, threads and CPU kernels.

Small runs are not reproducible across these: one backward of a small CNN differs in the last bits between 1 and 2
CPU threads, and tens of noisy steps at a high learning rate can turn that into points of accuracy. Every recorded
result (the recipes' ``results.json``, the bench records) therefore carries :func:`run_environment`.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import numpy as np
import torch


def run_environment(device: str | torch.device = "cpu") -> dict[str, Any]:
    """The versions, thread count and kernels a run used, as JSON-ready values.

    Args:
        device: the device the model trained on (its name is recorded: the CPU's model or the GPU's).

    Returns:
        ``python``, ``torch``, ``numpy``; ``threads`` (``torch.get_num_threads()``); ``cpu_capability`` (the
        instruction set torch's CPU kernels were dispatched to, e.g. ``AVX512``); ``device_name``; ``platform``.
    """
    device = torch.device(device)
    device_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            device_name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device.type == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(device)
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device_name": device_name,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
