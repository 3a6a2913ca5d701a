"""What a run's numbers depend on besides its command and seed (versions, threads, CPU kernels), recorded with every
result (docs/design.md section 12.8).
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
        device: the device the model trained on (its name is recorded).

    Returns:
        ``python``, ``torch``, ``numpy``, ``threads``, ``cpu_capability`` (e.g. ``AVX512``), ``device_name``,
        ``platform``.
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
