"""Cut the small test subsets of this folder from full local copies of the recipes' datasets.

    python tests/data/cut_subsets.py --source DATA_ROOT     # DATA_ROOT holds glue/, e2e/, dart/, billsum/, ...

Text files keep their first rows byte for byte (header included); the DART JSON lists keep their first entries
(re-serialised); the CIFAR-10 npz files keep the first images of each class. What each file holds: README.md here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
#: relative path -> data rows kept (after the header line) of the text files cut by lines.
LINES = {
    "glue/sst2/train_full.tsv": 300,
    "glue/sst2/dev.tsv": 200,
    "glue/qnli/dev.tsv": 250,
    "e2e/devset.csv": 200,
    "e2e/testset_w_refs.csv": 200,
    "billsum/us_train_sample100.jsonl": 10,
    "hotpotqa/hotpotqa_dev_distractor_500.jsonl": 30,
}
#: files with a header line (the others are JSON lines).
HEADED = (".tsv", ".csv")
#: relative path -> entries kept of the JSON lists.
ENTRIES = {"dart/dart-v1.1.1-full-dev.json": 200, "dart/dart-v1.1.1-full-test.from_xml.json": 100}
#: relative path -> images kept per class of the npz files.
PER_CLASS = {"cifar10/cifar10_train_5k_subset_from_jpg.npz": 20, "cifar10/cifar10_test_10k_from_jpg.npz": 10}


def cut_lines(source: Path, target: Path, rows: int) -> None:
    """The first ``rows`` data lines of ``source`` (plus its header line for TSV/CSV), byte for byte."""
    keep = rows + (1 if source.suffix in HEADED else 0)
    with source.open("rb") as handle:
        lines = [line for _, line in zip(range(keep), handle, strict=False)]
    target.write_bytes(b"".join(lines))


def cut_entries(source: Path, target: Path, entries: int) -> None:
    """The first ``entries`` items of the JSON list in ``source``."""
    data = json.loads(source.read_text(encoding="utf-8"))
    target.write_text(json.dumps(data[:entries], indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def cut_images(source: Path, target: Path, per_class: int) -> None:
    """The first ``per_class`` images of each class of ``source`` (file order), every key kept, compressed."""
    with np.load(source) as data:
        arrays = {key: data[key] for key in data.files}
    labels = arrays["y"]
    keep = np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in np.unique(labels)])
    np.savez_compressed(target, **{k: v if k == "classes" else v[keep] for k, v in arrays.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="root of the full copies (glue/, e2e/, ...)")
    source = parser.parse_args().source
    for table, cut in ((LINES, cut_lines), (ENTRIES, cut_entries), (PER_CLASS, cut_images)):
        for name, size in table.items():
            target = HERE / name
            target.parent.mkdir(parents=True, exist_ok=True)
            cut(source / name, target, size)
            print(f"{name}: {target.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
