"""Checkpoint files that a kill cannot leave half-written, and finding the newest complete HF checkpoint folder.

Writers put the bytes in a temporary file in the target's folder, ``fsync`` it and ``os.replace`` it onto the target
(atomic on POSIX and Windows); a kill leaves at most a hidden ``.NAME.tmp-PID`` file, not removed automatically.
:func:`save_lightning_checkpoint` replaces Lightning's writer for local paths under the plain ``TorchCheckpointIO``
only (docs/design.md section 12.8).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

log = logging.getLogger("lightning_dp")

__all__ = ["atomic_save", "atomic_write_bytes", "last_complete_checkpoint", "save_lightning_checkpoint"]


def _dump(obj: Any, f: IO[bytes]) -> None:
    torch.save(obj, f)


def _fsync_folder(folder: Path) -> None:
    """Persist the rename itself (POSIX; a no-op where folders cannot be opened, as on Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_folder(path.parent)


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` through a temporary file in the same folder and ``os.replace``: a kill at any point
    leaves ``path`` either as it was or complete."""
    _atomic_write(path, lambda f: _dump(obj, f))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (as :func:`atomic_save`)."""
    _atomic_write(path, lambda f: f.write(data))


def _is_local(filepath: Any) -> bool:
    text = str(filepath)
    return "://" not in text or text.startswith("file://")


def save_lightning_checkpoint(
    strategy: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any, fallback: Callable[..., None]
) -> None:
    """What ``Strategy.save_checkpoint`` does (rank 0 writes), with :func:`atomic_save` for a local path written by
    the plain ``TorchCheckpointIO``; anything else goes to ``fallback`` (Lightning's own ``save_checkpoint``)."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    if type(strategy.checkpoint_io) is not TorchCheckpointIO or storage_options is not None or not _is_local(filepath):
        fallback(checkpoint, filepath, storage_options=storage_options)
        return
    if strategy.is_global_zero:
        text = str(filepath)
        atomic_save(checkpoint, text[len("file://") :] if text.startswith("file://") else text)


_CHECKPOINT_FOLDER = re.compile(r"^checkpoint-(\d+)$")


def last_complete_checkpoint(output_dir: str | os.PathLike[str], marker: str) -> str | None:
    """The newest ``checkpoint-STEP`` folder of ``output_dir`` holding ``marker`` (written last), or None; newer partial
    folders are skipped with a warning and left on disk.
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = sorted(
        (int(match.group(1)), child)
        for child in folder.iterdir()
        if (match := _CHECKPOINT_FOLDER.match(child.name)) and child.is_dir()
    )
    skipped: list[Path] = []
    for _, child in reversed(found):
        if (child / marker).is_file():
            if skipped:
                log.warning(
                    "Skipping the checkpoint folder(s) %s: they have no %s, so their writing was interrupted (a killed "
                    "process); resuming from %s",
                    ", ".join(str(s) for s in skipped),
                    marker,
                    child,
                )
            return str(child)
        skipped.append(child)
    return None
