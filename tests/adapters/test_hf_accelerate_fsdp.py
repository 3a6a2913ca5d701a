"""DPTrainer under accelerate's FSDP2 configuration: ``accelerate launch --config_file
configs/accelerate/fsdp2_2_processes.yaml`` (2 CPU processes over gloo) with an UNSHARDED model, which DPTrainer
shards itself with the config's wrap policy (lightning_dp/hf/accelerate_fsdp.py).

``hf_accelerate_fsdp_script.py`` trains a tiny float64 Llama (two blocks, tied embeddings) loaded with
``from_pretrained`` on every rank (see its docstring). Checked: every transformer block and the root were sharded and
accelerate's own FSDP stayed off; with zero noise the run equals the same launch without the FSDP request (unsharded
training on the same processes), for full fine-tuning, for LoRA, when rank 1's weights were on the ``meta`` device
(filled from rank 0), and with HF's activation checkpointing of every block; each rank holds about half of the
parameters' bytes; epsilon is the single-process accountant's at the global q and reaches the logs; the launcher's
variables are back after each Trainer. The sharded
engine itself (norms, noise on shards, checkpoints) is tested in tests/engine/test_fsdp.py and
tests/adapters/test_hf_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch
from process_helpers import ROOT, SCRIPTS, accelerate_launch
from torch import nn

from lightning_dp.accounting.calibration_helpers import epsilon_for
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.hf.accelerate_fsdp import (
    USE_FSDP_VARIABLE,
    _materialise_meta,
    fsdp2_settings_from_launcher,
    hidden_from_accelerate,
)

pytest.importorskip("peft")

WORLD = 2
FSDP2_CONFIG = ROOT / "configs" / "accelerate" / "fsdp2_2_processes.yaml"
SHARDED_RUNS = ("sharded", "lora sharded", "noisy", "meta", "checkpointed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run hf_accelerate_fsdp_script.py under the FSDP2 accelerate config (about 30 s on 2 cores)."""
    out = tmp_path_factory.mktemp("hf_accelerate_fsdp")
    accelerate_launch(SCRIPTS / "hf_accelerate_fsdp_script.py", str(out), config=FSDP2_CONFIG)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_dptrainer_shards_every_block_and_the_root_and_accelerate_does_not(ranks) -> None:
    for rank in ranks:
        assert rank["environment"]["ACCELERATE_USE_FSDP"] == "true" and rank["environment"]["FSDP_VERSION"] == "2"
        assert rank["environment after"] == rank["environment"]
        for name in SHARDED_RUNS:
            run = rank[name]
            root = "FSDPPeftModel" if name.startswith("lora") else "FSDPLlamaForCausalLM"
            assert run["sharded"] and run["fsdp modules"] == sorted(["FSDPLlamaDecoderLayer"] * 2 + [root]), name
            assert not run["fsdp enabled in accelerate"] and run["steps"] == 3, name
        assert not rank["replicated"]["sharded"] and not rank["lora replicated"]["sharded"]
    assert ranks[1]["meta"]["loaded on meta"] and not ranks[0]["meta"]["loaded on meta"]


@pytest.mark.parametrize("kind", ["", "lora ", "meta", "checkpointed"])
def test_zero_noise_training_equals_the_unsharded_run(ranks, kind) -> None:
    name = {"": "sharded", "lora ": "lora sharded"}.get(kind, kind)
    reference = "lora replicated" if kind == "lora " else "replicated"
    for rank in ranks:
        sharded, replicated = rank[name]["params"], rank[reference]["params"]
        assert sharded.keys() == replicated.keys()
        for key, value in sharded.items():
            torch.testing.assert_close(value, replicated[key], rtol=0, atol=1e-12, msg=key)
        moved = [k for k, v in sharded.items() if not torch.equal(v, rank[reference]["before"][k])]
        assert moved, "training changed nothing"
    assert all(torch.equal(ranks[0][name]["params"][k], ranks[1][name]["params"][k]) for k in ranks[0][name]["params"])


def test_each_rank_holds_about_half_of_the_parameters(ranks) -> None:
    for rank in ranks:
        sharded, replicated = rank["sharded"]["local parameter bytes"], rank["replicated"]["local parameter bytes"]
        assert sharded == pytest.approx(replicated / WORLD, rel=0.05)


def test_epsilon_is_the_single_process_accountants_at_the_global_rate_and_is_logged(ranks) -> None:
    run = ranks[0]["noisy"]
    assert run["sample_rate"] == 4 * 2 * WORLD / 32
    expected = epsilon_for(PoissonSampledEvent(run["sample_rate"], GaussianEvent(1.0)), 3, run["delta"], "rdp")
    assert run["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert run["logged epsilons"][-1] == pytest.approx(run["epsilon"], rel=1e-12)


# ------------------------------------------------------------------------------- one process: the settings
def _launcher_environment(monkeypatch, **settings: str) -> None:
    monkeypatch.setenv(USE_FSDP_VARIABLE, "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    for name, value in settings.items():
        monkeypatch.setenv(name, value)


def test_no_settings_without_the_launchers_request(monkeypatch) -> None:
    monkeypatch.delenv(USE_FSDP_VARIABLE, raising=False)
    assert fsdp2_settings_from_launcher() is None


def test_the_launchers_fsdp2_settings_are_read(monkeypatch) -> None:
    _launcher_environment(
        monkeypatch,
        FSDP_RESHARD_AFTER_FORWARD="false",
        FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
        FSDP_TRANSFORMER_CLS_TO_WRAP="Block",
    )
    settings = fsdp2_settings_from_launcher()
    assert settings.fsdp_version == 2 and settings.reshard_after_forward is False
    assert settings.transformer_cls_names_to_wrap == ["Block"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"FSDP_VERSION": "1"}, "set fsdp_version: 2"),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params"),
        ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "fsdp_activation_checkpointing"),
    ],
)
def test_settings_dptrainer_does_not_honour_are_refused(monkeypatch, settings, message) -> None:
    _launcher_environment(monkeypatch, **settings)
    with pytest.raises(ValueError, match=message):
        fsdp2_settings_from_launcher()


def test_the_request_is_hidden_within_the_block_and_restored_after(monkeypatch) -> None:
    _launcher_environment(monkeypatch)
    with hidden_from_accelerate():
        assert USE_FSDP_VARIABLE not in __import__("os").environ
    assert __import__("os").environ[USE_FSDP_VARIABLE] == "true"


def test_meta_tensors_are_allocated_once_per_tensor_keeping_ties_and_trainability() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(3, 5), nn.BatchNorm1d(5)).to("meta")
    model[1].weight = model[0].weight
    model[1].bias.requires_grad_(False)
    _materialise_meta(model, torch.device("cpu"))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model[1].weight is model[0].weight and isinstance(model[0].weight, nn.Parameter)
    assert model[0].weight.requires_grad and not model[1].bias.requires_grad
    assert not isinstance(model[2].running_mean, nn.Parameter)


def test_a_transformers_models_ties_broken_by_meta_are_restored() -> None:
    from hf_helpers import tiny_llama

    model = tiny_llama().to("meta")  # moving to meta unties lm_head from the embedding
    _materialise_meta(model, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
