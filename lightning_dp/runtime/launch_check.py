"""Whether the launcher asked for more processes than are training: ``accelerate launch --num_processes N`` without
``--multi_gpu``, or ``WORLD_SIZE`` set around a run whose process group is not initialised (docs/design.md section
12.8).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence

#: The repository's accelerate configuration for 2 processes on one machine (gloo on CPU, NCCL with GPUs), named in
#: the warning when it exists (a run from the repository's root); otherwise the warning gives the flags.
TWO_PROCESSES_CONFIG = "configs/accelerate/ddp_2_processes.yaml"


def process_count_warning(world_size: int, environ: Mapping[str, str], argv: Sequence[str]) -> str | None:
    """The warning to give when the launcher asked for more processes than ``world_size``, else ``None``.

    Args:
        world_size: processes in this run's ``torch.distributed`` group (1 when not initialised).
        environ: this process's environment (``os.environ``).
        argv: this process's command line (``sys.argv``), repeated in the command that works.
    """
    if world_size != 1:
        return None
    if "WORLD_SIZE" not in environ and "MASTER_ADDR" in environ and "ACCELERATE_USE_CPU" in environ:
        if os.path.isfile(TWO_PROCESSES_CONFIG):  # run from the repository's root
            launch = ["--config_file", TWO_PROCESSES_CONFIG]
            more = "set num_processes in the file for more"
        else:
            launch, more = ["--multi_gpu", "--num_processes", "2"], "--num_processes N for N"
        command = shlex.join(["accelerate", "launch", *launch, *argv])
        return (
            "accelerate launch was asked for several processes, but 1 is training: without --multi_gpu (or a config "
            "file with distributed_type: MULTI_GPU) accelerate starts a single process, on CPU too. For 2 processes "
            f"run: {command} ({more}; lightning_dp's docs/hf.md, 'Several processes')"
        )
    requested = environ.get("WORLD_SIZE", "")
    if requested.isdigit() and int(requested) > 1:
        return (
            f"the launcher started {requested} processes (WORLD_SIZE={requested}), but torch.distributed is not "
            "initialised here: each process trains alone, on the whole data and with its own noise. With Lightning, "
            f"train with DPDDPStrategy on {requested} devices (or num_nodes x devices = {requested})"
        )
    return None
