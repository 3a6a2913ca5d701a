"""Where the offline recipes, examples and benches find their local copies of public datasets.

A *data root* is one folder holding a folder per dataset (:data:`DATASETS`), with the files of the original
releases: ``ROOT/glue/sst2/train_full.tsv``, ``ROOT/e2e/devset.csv``, ``ROOT/cifar10/...``. The user names it with a
flag (``--data_dir ROOT`` for every recipe), else with the environment variable ``LIGHTNING_DP_DATA=ROOT``; the flag
also takes the dataset's own folder (``ROOT/glue`` or ``ROOT/glue/sst2``), recognised by the files the caller reads.
With neither set, or no such files, :func:`local_data_dir` raises :class:`LocalDataError`, whose one-line message says
what to set. Nothing is looked up anywhere else.
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
    """The local copy of a dataset is not where ``--data_dir`` / ``LIGHTNING_DP_DATA`` say, or neither is set.

    Both a ``FileNotFoundError`` (a file is missing) and a ``ValueError`` (an argument has a bad value), so that the
    recipes' scripts and ``lightning-dp fit`` report it as one error line (exit status 2) like any bad input.
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
        data_dir: a data root holding ``dataset`` (a relative path such as ``glue/sst2``), or the dataset's own folder
            (any tail of ``dataset``: ``ROOT/glue`` or ``ROOT/glue/sst2``); ``None``: the root ``$LIGHTNING_DP_DATA``.
        dataset: where the dataset lies under a data root (``e2e``, ``glue/sst2``, ``cifar10``).
        files: the file names the folder must hold (they tell a dataset folder from a root).
        hub_config: the configuration loading the same data from the Hub, named in the error message (``None``:
            the caller has none).
        flag: how the user gives ``data_dir`` on the command line, named in the error message.

    Raises:
        LocalDataError: neither ``data_dir`` nor ``LIGHTNING_DP_DATA`` is set, the folder does not exist, or no
            candidate folder holds all of ``files`` (one line naming the flag, the variable and ``hub_config``).
            Both a ``FileNotFoundError`` and a ``ValueError``.
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
