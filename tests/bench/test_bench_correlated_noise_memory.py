"""bench/correlated_noise_memory.py: the state it measures is ``b - 1`` (banded) or ``d`` (BLT) float32 copies of the
trainable parameters, at toy sizes; docs/correlated_noise.md holds what it renders at the real sizes."""

from __future__ import annotations

import pytest
import torch
from bench_helpers import ROOT, load_bench


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_state_is_one_float32_copy_of_the_trainable_parameters_per_buffer(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "correlated_noise_memory")
    row = bench.measure("llama-1b", "toy")  # bfloat16 weights: the state is float32
    model = bench.build_model(bench.model_spec("llama-1b", "toy"), torch.device("meta"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    vector = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    buffers = {f"band {b}": b - 1 for b in bench.BANDS} | {f"BLT d = {d}": d for d in bench.BUFFERS}
    assert row["state_bytes"] == {column: count * vector for column, count in buffers.items()}
    assert row["adamw_bytes"] == 2 * row["weights_bytes"]  # every parameter trained, moments in bfloat16
    lora = bench.measure("llama-1b-lora", "toy")
    assert lora["trainable"] < row["trainable"] and lora["weights_bytes"] > row["weights_bytes"]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_page_holds_the_rendering_of_the_real_sizes(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "correlated_noise_memory")
    rows = [bench.measure(name, "real") for name in bench.MODELS]  # on the meta device: no memory, about 10 s
    page = (ROOT / "docs" / "correlated_noise.md").read_text()
    assert f"{bench.START}\n{bench.markdown(rows, 'python bench/correlated_noise_memory.py')}\n{bench.END}" in page
