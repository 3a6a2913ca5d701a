"""bench/records.py: the record of a run states the load average from before it and the environment after it."""

from __future__ import annotations

import argparse
import json

from bench_helpers import load_bench


def test_run_or_render_reads_the_load_before_the_run_and_the_threads_after_it(monkeypatch, tmp_path, capsys) -> None:
    import torch

    records = load_bench(monkeypatch, "records")
    loads = iter([0.5, 3.0, 4.0])  # before the run, (the environment after it,) after the run
    monkeypatch.setattr(records.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    threads = torch.get_num_threads()

    def run(args: argparse.Namespace) -> dict:
        torch.set_num_threads(1)  # as a bench's --threads does, inside its run
        return {"runs": [1]}

    args = argparse.Namespace(render=False, record="r", json=True)
    try:
        records.run_or_render(
            args, run, lambda: None, script="bench/x.py", records=tmp_path, report_lines=lambda record: []
        )
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["environment"]["load_before"] == 0.5 and record["environment"]["load_after"] == 4.0
    assert record["environment"]["threads"] == 1 and record["runs"] == [1]
    assert json.loads(capsys.readouterr().out) == record
