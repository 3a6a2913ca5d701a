"""The files of a private search in its output folder: the state that makes it resumable, the best artifact so far,
and, when it has finished, the released result.

- ``search_state.json`` (private while the search runs): the fingerprint of the search (space, plan, direction), the
  drawn candidates (their number is ``K``), how many completed, and the best so far. It is written before the first
  candidate runs, so a restart reads ``K`` instead of drawing it again; no loser's score is ever written. When the
  search finishes it keeps only the fingerprint and ``"finished": true``.
- ``candidate-<i>[.saved.pt]``: the best candidate's artifact while the search runs (a beaten one is deleted);
  ``winner[.saved.pt]`` once it has finished: a fresh copy whose file times are those of the finish.
- ``result.json``: what the search releases (the winner's hyper-parameters and score, epsilon, delta), never ``K``.

Every JSON file is replaced atomically (:func:`~lightning_dp.runtime.checkpoints.atomic_write_bytes`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from lightning_dp.runtime.checkpoints import atomic_save, atomic_write_bytes

STATE_FILE = "search_state.json"
RESULT_FILE = "result.json"
#: Suffix of an artifact that is an object (saved with ``torch.save``) rather than a path the candidate wrote.
OBJECT_SUFFIX = ".saved.pt"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())


def _normalised(data: Any) -> Any:
    """``data`` as JSON gives it back (tuples as lists), so a fingerprint compares equal to its stored copy."""
    return json.loads(json.dumps(data, sort_keys=True))


def remove(path: Path) -> None:
    """Delete a file or folder (nothing if it does not exist)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@dataclasses.dataclass
class SearchState:
    """The private state of a running search.

    Attributes:
        fingerprint: the space, the plan and the direction of the scores, as JSON data.
        candidates: the drawn hyper-parameters, one dict per candidate (``len`` is ``K``).
        completed: candidates trained so far.
        best: ``{"candidate": index, "score": score, "artifact": file name or None}`` of the best so far, or None.
        running: the candidate being trained (written before it starts), or None between candidates: a process
            that stopped during it leaves it here, and the restart scores it NaN instead of training it again.
    """

    fingerprint: dict[str, Any]
    candidates: list[dict[str, Any]]
    completed: int = 0
    best: dict[str, Any] | None = None
    running: int | None = None


class SearchFolder:
    """The output folder of one search.

    Args:
        output_dir: the folder (created if missing).
        fingerprint: what identifies the search; a state or result written for another is refused.
    """

    def __init__(self, output_dir: str | Path, fingerprint: dict[str, Any]) -> None:
        self.path = Path(output_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        self.fingerprint = _normalised(fingerprint)

    def _read(self) -> dict[str, Any] | None:
        file = self.path / STATE_FILE
        if not file.exists():
            return None
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(
                f"{file} is not a readable search state ({error}); it holds the drawn number of candidates: restore it"
            ) from error
        if data.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"{self.path} holds a search with another search space, plan or direction (its {STATE_FILE}); resume "
                "it with the same settings, or give a new output folder for a new search, whose cost adds to that one's"
            )
        return data

    def finished_result(self) -> dict[str, Any] | None:
        """The released result of a finished search in this folder (deleting a candidate artifact that a crash in
        :meth:`finish` left behind), else None.

        Raises:
            ValueError: a state for another search, or an unreadable one.
        """
        data = self._read()
        if data is None or not data.get("finished"):
            return None
        self._remove_candidates()  # left by a crash after the state was reduced
        return json.loads((self.path / RESULT_FILE).read_text(encoding="utf-8"))

    def load(self) -> SearchState | None:
        """The state of a started, unfinished search (its stale candidate artifacts deleted), else None."""
        data = self._read()
        if data is None:
            return None
        state = SearchState(
            data["fingerprint"], data["candidates"], data["completed"], data["best"], data.get("running")
        )
        kept = state.best["artifact"] if state.best else None
        for stale in self.path.glob("candidate-*"):
            if stale.name != kept:
                remove(stale)
        return state

    def save(self, state: SearchState) -> None:
        """Write ``state`` (atomically)."""
        _write_json(self.path / STATE_FILE, dataclasses.asdict(state))

    def keep_artifact(self, index: int, artifact: Any) -> str | None:
        """Store candidate ``index``'s artifact as ``candidate-<index>``: a ``Path`` is moved there (keeping a
        file's suffix), ``None`` is not stored, any other object is saved with ``torch.save``. Returns the file name."""
        if artifact is None:
            return None
        if isinstance(artifact, Path):
            target = self.path / f"candidate-{index}{artifact.suffix if artifact.is_file() else ''}"
            remove(target)
            shutil.move(str(artifact), target)
            return target.name
        name = f"candidate-{index}{OBJECT_SUFFIX}"
        atomic_save(artifact, self.path / name)
        return name

    def load_artifact(self, name: str | None) -> Any:
        """The artifact stored under ``name``: a ``Path`` for a moved path, the object for a saved one."""
        if name is None:
            return None
        path = self.path / name
        if name.endswith(OBJECT_SUFFIX) and path.is_file():
            return torch.load(path, weights_only=False)  # the search's own file
        return path

    def finish(self, state: SearchState, result: dict[str, Any]) -> dict[str, Any]:
        """Release the search: copy the best artifact to ``winner`` (fresh files, their access and modification times
        set to now: the kept file's times would date the winner's training, and the gap to ``result.json``'s would
        tell how many candidates trained after it), write ``result.json`` (``result`` plus the artifact's name),
        reduce the state to the fingerprint and ``"finished": true``, then delete the candidate's artifact (a crash
        before the state is reduced leaves it for the restart to copy again). Returns the result."""
        best = state.best
        kept = best["artifact"] if best else None
        artifact = None
        if best is not None and kept is not None:
            artifact = "winner" + kept.removeprefix(f"candidate-{best['candidate']}")
            _copy_fresh(self.path / kept, self.path / artifact)
        result = {**result, "artifact": artifact}
        _write_json(self.path / RESULT_FILE, result)
        _write_json(self.path / STATE_FILE, {"fingerprint": self.fingerprint, "finished": True})
        self._remove_candidates()
        return result

    def _remove_candidates(self) -> None:
        for stale in self.path.glob("candidate-*"):
            remove(stale)


def _copy_fresh(source: Path, target: Path) -> None:
    """Copy the file or folder ``source`` to ``target`` (replacing it) as new files, then set the access and
    modification times of ``target`` and of every file and folder under it to now."""
    remove(target)
    if source.is_dir():
        shutil.copytree(source, target, copy_function=shutil.copyfile)
    else:
        shutil.copyfile(source, target)
    now = time.time()
    for path in [*target.rglob("*"), target] if target.is_dir() else [target]:
        os.utime(path, (now, now), follow_symlinks=False)
