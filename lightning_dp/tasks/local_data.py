"""Where the offline recipes, examples and benches find their local copies of public datasets: a data root (one folder
per dataset, the original release files) given by ``--data_dir`` or ``LIGHTNING_DP_DATA``; nothing else is searched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

#: The environment variable naming the data root (used when ``--data_dir`` is not given).
DATA_ENV = "LIGHTNING_DP_DATA"
#: The dataset folders a data root holds, one per recipe dataset.
DATASETS = ("glue", "e2e", "dart", "billsum", "hotpotqa", "cifar10")


class LocalDataError(FileNotFoundError, ValueError):
    """The local copy of a dataset is missing or no data root is set; a ``FileNotFoundError`` and a ``ValueError`` (one
    error line, exit status 2).
    """


def local_data_dir(
    data_dir: str | Path | None,
    dataset: str,
    files: Sequence[str],
    hub_config: str | None = None,
    flag: str = "--data_dir ROOT",
) -> Path:
    """The folder of the local copy of ``dataset``: the one holding every file of ``files``.

    Args:
        data_dir: a data root, or the dataset's own folder (any tail of ``dataset``); ``None``: ``$LIGHTNING_DP_DATA``.
        dataset: where the dataset lies under a data root (``e2e``, ``glue/sst2``, ``cifar10``).
        files: the file names the folder must hold.
        hub_config: the Hub configuration loading the same data, named in the error (``None``: none).
        flag: how the user gives ``data_dir`` on the command line, named in the error.

    Raises:
        LocalDataError: no ``data_dir`` nor ``LIGHTNING_DP_DATA``, a missing folder, or no folder holding ``files``.
    """
    hint = (
        f"give the data root (the folder holding {'/, '.join(DATASETS)}/) or the dataset's own folder with {flag}, "
        f"or set {DATA_ENV}=ROOT"
    )
    if hub_config is not None:
        hint += f"; or load the data from the Hub with --config {hub_config}"
    if data_dir is None:
        root = os.environ.get(DATA_ENV)
        if not root:
            raise LocalDataError(f"no local data for {dataset}: {hint}")
        given, source = Path(root), f"{DATA_ENV}={root}"
    else:
        given, source = Path(data_dir), f"data folder {str(data_dir)!r}"
    if not given.is_dir():
        raise LocalDataError(f"{source} does not exist; {hint}")
    parts = Path(dataset).parts
    candidates = [given.joinpath(*parts[i:]) for i in range(len(parts))]
    if given.name == parts[-1]:  # the dataset's own folder, named as the dataset (not another task's folder)
        candidates.append(given)
    for folder in candidates:
        if all((folder / name).is_file() for name in files):
            return folder
    raise LocalDataError(
        f"{source} holds no local copy of {dataset} (expected {' and '.join(files)} in {given / dataset} or in the "
        f"folder itself); {hint}"
    )


def require_file(path: Path) -> Path:
    """``path`` if it is a file. Raises :class:`LocalDataError` saying which file of the local copy is missing."""
    if not path.is_file():
        raise LocalDataError(f"expected data file {str(path)!r} is missing; check --data_dir or {DATA_ENV}")
    return path
