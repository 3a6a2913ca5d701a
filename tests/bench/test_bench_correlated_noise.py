"""bench/correlated_noise.py renders docs/correlated_noise.md (and its figure) only from its recorded JSON, and
scripts/banded_bands.py's table on that page is what the script computes (no training is run here)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
from bench_helpers import ROOT, load_bench, page_and_rendering, render_page_and_figure


def record(epsilon: float, runs: list[dict]) -> dict:
    return {
        "command": f"python bench/correlated_noise.py --target-epsilon {epsilon:g} --threads 1",
        "args": {"epochs": 15, "target_epsilon": epsilon, "seeds": [0, 1]},
        "environment": {"torch": "2.13.0+cpu", "threads": 1},
        "runs": runs,
    }


def run(variant: str, seed: int, acc: float, sigma: float) -> dict:
    return {"variant": variant, "seed": seed, "test_acc": acc, "epsilon": 2.998, "noise_multiplier": sigma}


RUNS = [run("DP-SGD", 0, 0.90, 1.97), run("banded b=4", 0, 0.92, 2.9), run("DP-SGD", 1, 0.92, 1.97),
        run("banded b=4", 1, 0.94, 2.9), run("BLT d=4", 0, 0.80, 4.1), run("BLT d=4", 1, 0.82, 4.1)]  # fmt: skip


def test_rows_average_the_seeds_and_name_the_noise(monkeypatch) -> None:
    text = load_bench(monkeypatch, "correlated_noise").markdown(record(3.0, RUNS))
    assert "| DP-SGD | 91.0 +- 1.4 | banded, b = 1 (DP-SGD) | 2.998 | 1.97 |" in text
    assert "| banded b=4 | 93.0 +- 1.4 | banded, b = 4 | 2.998 | 2.9 |" in text
    assert "| BLT d=4 | 81.0 +- 1.4 | BLT, d = 4 | 2.998 | 4.1 |" in text
    assert "python bench/correlated_noise.py --target-epsilon 3 --threads 1" in text


def test_run_trains_dp_sgd_every_band_and_blt_per_seed(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "correlated_noise")
    calls = []

    def fake_run_demo(*, callbacks, **options) -> dict:
        calls.append(options)
        return {"test_acc": 0.9, "epsilon": 2.998, "privacy": {"noise_multiplier": 1.971}}

    monkeypatch.setattr("lightning_dp.cli.demo.run_demo", fake_run_demo)
    out = bench.run(argparse.Namespace(epochs=2, target_epsilon=1.0, seeds=[0]))
    assert [r["variant"] for r in out["runs"]] == ["DP-SGD", *(f"banded b={b}" for b in bench.BANDS), "BLT d=4"]
    assert calls[0] == {"target_epsilon": 1.0, "epochs": 2, "seed": 0, "progress_bar": False}
    for call, b in zip(calls[1:-1], bench.BANDS, strict=True):
        assert call["noise_correlation"] == "banded" and call["correlation_band"] == b and call["target_epsilon"] == 1
    assert calls[-1]["noise_correlation"] == "blt" and calls[-1]["correlation_buffers"] == 4


def test_render_fills_the_markers_and_draws_the_figure(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "correlated_noise")
    text = render_page_and_figure(bench, monkeypatch, tmp_path, "digits_eps3", record(3.0, RUNS))
    assert text == f"intro\n{bench.START}\n{bench.markdown(record(3.0, RUNS))}\n{bench.END}\nend\n"
    assert (tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG")


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "correlated_noise"),
        "python bench/correlated_noise.py --target-epsilon 3 --threads 1 --record digits_eps3",
    )
    assert page == rendered


def _bands_script():
    spec = importlib.util.spec_from_file_location("banded_bands", ROOT / "scripts" / "banded_bands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_band_table_starts_at_dp_sgd_and_states_each_band(monkeypatch) -> None:
    """A small case: b = 1 is DP-SGD (column norm 1, error ratio 1, k = n), a band's rate is b q."""
    text = _bands_script().table(40, 0.02, 3.0, 1e-5, (1, 4))
    lines = text.splitlines()
    assert lines[2].startswith("| 1 | 0.02 |") and lines[2].endswith("| 1.000 | 40 | 1.000 |")
    assert lines[3].startswith("| 4 | 0.08 |") and "| 10 |" in lines[3]


def test_the_blt_table_states_its_groups_and_one_row_per_epsilon() -> None:
    """A small case: q = 0.1 gives b = 10 groups and k = 4 participations in 40 steps; BLT's sigma (k unamplified
    steps) is above DP-SGD's (amplified), and the error ratio is positive."""
    text = _bands_script().blt_table(40, 0.1, (3.0, 8.0), 1e-5, 2)
    lines = text.splitlines()
    assert "b = 10, k = 4 unamplified steps, d = 2" in lines[0] and len(lines) == 4
    for line, epsilon in zip(lines[2:], ("3", "8"), strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0] == epsilon and float(cells[2]) > float(cells[1]) > 0 and float(cells[3]) > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "marker",
    ["bands", "bands-digits", "blt-digits", "blt-10-epochs", "bands-cifar", "blt-cifar", "bands-sst2", "blt-sst2"],
)
def test_the_band_tables_on_the_page_are_the_scripts_output(marker) -> None:
    """Each table on the page is the output of the command printed above it (about 20 s for n = 1000, a minute for
    the BLT at n = 10,000)."""
    import shlex

    script = _bands_script()
    start, end = script.markers(marker)
    block = script.PAGE.read_text(encoding="utf-8").split(start, 1)[1].split(end, 1)[0]
    command = block.split("```bash\n", 1)[1].split("\n```", 1)[0]
    words = shlex.split(command)
    assert words[:2] == ["python", "scripts/banded_bands.py"]
    args = script.parse_args(words[2:])
    assert args.marker == marker and script.table_of(args) in block
