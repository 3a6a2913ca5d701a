"""DPTrainer on an FSDP2-sharded model (``fully_shard`` applied by the user before DPTrainer), 2 CPU processes over
gloo, launched by ``accelerate launch --config_file configs/accelerate/ddp_2_processes.yaml``.

``hf_fsdp_script.py`` trains a tiny float64 Llama with tied embeddings several times in one launch (see its
docstring). Checked: the gathered parameters are identical on both ranks and moved; each rank holds about half of
the parameters' and the optimizer state's bytes (local shards, against the unsharded run); with zero noise the
sharded run equals the unsharded run on the same processes, for full fine-tuning, for LoRA and with empty Poisson
batches, whose stand-in batch must add exactly nothing (float64 round-off); epsilon is the single-process
accountant's at the global q and reaches the Trainer's logs; ``save_model`` writes the full weights, which reload
with ``from_pretrained`` and give the sharded model's logits; ``generate`` runs on the sharded model on every rank;
resuming from a checkpoint restores the model's and the optimizer's shards (also for LoRA) and continues epsilon;
``load_best_model_at_end`` restores the best checkpoint's shards; per-sample momentum (with stand-in batches and an
evaluation between steps, before and after a resume) trains as unsharded, the momentum's iterates are shards (half the
bytes) and resume from the checkpoint; banded and BLT correlated noise stream the strategy over each shard's draws,
and with ``exact_resume`` a resumed run equals the uninterrupted one.
The engine's sharded numbers (norms of every engine, the noise on shards) are
tested in tests/engine/test_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch
from correlation_helpers import noise_per_step
from helpers import nested_equal
from process_helpers import SCRIPTS, accelerate_launch
from torch.distributed.tensor import DTensor

from lightning_dp.accounting.calibration_helpers import epsilon_for
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent

pytest.importorskip("peft")

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run hf_fsdp_script.py under ``accelerate launch`` (about 40 s on 2 cores); what each rank wrote."""
    out = tmp_path_factory.mktemp("hf_fsdp")
    accelerate_launch(SCRIPTS / "hf_fsdp_script.py", str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


RUNS = ("noisy", "sharded", "replicated", "lora sharded", "lora replicated", "lora resumed", "small batches")
RUNS += ("small sharded", "small replicated", "resumed", "best", "lowpass sharded", "lowpass replicated")
RUNS += ("lowpass resumed", "momentum sharded", "momentum replicated", "momentum resumed sharded")
RUNS += ("momentum resumed replicated",)


def test_ranks_agree_and_the_parameters_move(ranks) -> None:
    a, b = ranks
    assert (a["rank"], b["rank"], a["world_size"]) == (0, 1, WORLD)
    for name in RUNS:
        assert a[name]["sharded"] == ("replicated" not in name), name
        assert nested_equal(a[name]["state"], b[name]["state"]) and a[name]["steps"] == 3, name
        params_a, params_b = a[name]["params"], b[name]["params"]
        assert all(torch.equal(params_a[k], params_b[k]) for k in params_a), name
    noisy = a["noisy"]["params"]
    assert all(not torch.equal(noisy[k], a["initial"][k]) for k in noisy)


def test_each_rank_holds_about_half_of_the_parameters_and_optimizer_state(ranks) -> None:
    for rank in ranks:
        sharded, replicated = rank["sharded"]["local bytes"], rank["replicated"]["local bytes"]
        for what in ("parameters", "optimizer state"):
            assert sharded[what] == pytest.approx(replicated[what] / WORLD, rel=0.05), what


@pytest.mark.parametrize("kind", ["", "lora ", "small ", "lowpass ", "momentum ", "momentum resumed "])
def test_zero_noise_sharded_training_equals_unsharded_training(ranks, kind) -> None:
    sharded, replicated = ranks[0][f"{kind}sharded"]["params"], ranks[0][f"{kind}replicated"]["params"]
    assert sharded.keys() == replicated.keys()
    for name, value in sharded.items():
        torch.testing.assert_close(value, replicated[name], rtol=0, atol=1e-12, msg=name)
    if kind == "lora ":  # the adapters trained (B starts at zero)
        assert any("lora_B" in name and value.abs().max() > 0 for name, value in sharded.items())
    if kind == "small ":  # batch 1: empty micro-batches ran the stand-in batch, which added exactly nothing
        assert sum(rank["small sharded"]["stand-in batches"] for rank in ranks) > 0
    if kind.startswith("momentum"):  # the stand-in batches, re-run at the stored iterates, added nothing
        assert sum(rank[f"{kind}sharded"]["stand-in batches"] for rank in ranks) > 0
        losses = [ranks[0][f"small {how}"]["logged losses"] for how in ("sharded", "replicated")]
        assert losses[0] == pytest.approx(losses[1], rel=1e-12)


@pytest.mark.parametrize("name", ["noisy", "small batches"])
def test_epsilon_is_the_single_process_accountants_at_the_global_rate_and_is_logged(ranks, name) -> None:
    run = ranks[0][name]
    batch = 4 * 2 if name == "noisy" else 1
    assert run["sample_rate"] == batch * WORLD / 32
    expected = epsilon_for(PoissonSampledEvent(run["sample_rate"], GaussianEvent(1.0)), 3, run["delta"], "rdp")
    assert run["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert run["logged epsilons"][-1] == pytest.approx(run["epsilon"], rel=1e-12)


def test_empty_poisson_batches_run_the_stand_in_batch(ranks) -> None:
    assert sum(r["small batches"]["stand-in batches"] for r in ranks) > 0


def test_saved_model_reloads_with_the_trained_weights_and_generate_runs_sharded(ranks) -> None:
    a, b = ranks
    torch.testing.assert_close(a["logits saved"], a["logits sharded"], rtol=0, atol=1e-12)
    assert torch.equal(a["generated sharded"], b["generated sharded"])
    assert a["generated sharded"].shape == (1, 8)


@pytest.mark.parametrize("kind", ["", "lora "])
def test_resume_restores_the_shards_and_continues_epsilon(ranks, kind) -> None:
    """``resume_from_checkpoint``: the weights and the optimizer state (gathered, on rank 0) at the start of the
    resumed run are those written at step 2, and the ledger continues to the uninterrupted run's epsilon."""
    a, b = ranks
    first = "lora sharded" if kind else "noisy"
    saved_params, saved_optimizer = a[first]["snapshots"]["save 2"]
    start_params, start_optimizer = a[f"{kind}resumed"]["snapshots"]["begin"]
    assert all(torch.equal(saved_params[k], start_params[k]) for k in saved_params)
    assert saved_optimizer["state"] and nested_equal(saved_optimizer, start_optimizer)
    if kind:  # nothing to compare for epsilon without noise
        return
    for rank in (a, b):
        resumed, uninterrupted = rank["resumed"], rank["noisy"]
        assert resumed["steps"] == 3 and resumed["epsilon"] == pytest.approx(uninterrupted["epsilon"], rel=1e-12)
        assert resumed["logged epsilons"][0] == pytest.approx(uninterrupted["logged epsilons"][2], rel=1e-12)


def test_load_best_model_at_end_restores_the_best_checkpoints_shards(ranks) -> None:
    run = ranks[0]["best"]
    assert run["best step"] in (1, 2, 3)
    best_params, _ = run["snapshots"][f"save {run['best step']}"]
    assert all(torch.equal(best_params[k], run["params"][k]) for k in best_params)


def test_the_lowpass_filters_history_is_checkpointed_gathered_and_resumed(ranks) -> None:
    """The filter's past ``m`` and ``vbar`` at step 2 are written as full tensors (gathered over the ranks), read
    back whole at the resume, and the resumed run takes each rank's shard of them and trains on."""
    for rank in ranks:
        saved = rank["lowpass sharded"]["lowpass snapshots"]["save 2"]
        restored = rank["lowpass resumed"]["lowpass snapshots"]["begin"]
        assert saved["steps"] == restored["steps"] == 2 and len(saved["m"]) == len(saved["vbar"]) == 1
        for key in ("m", "vbar"):
            for before, after in zip(saved[key][0], restored[key][0], strict=True):
                assert not isinstance(before, DTensor) and torch.equal(before, after)
        params = rank["lowpass sharded"]["params"]
        assert all(saved["m"][0][i].shape == p.shape for i, p in enumerate(params.values()))
        assert rank["lowpass resumed"]["steps"] == 3


def test_momentum_iterates_are_shards_and_resume_from_the_checkpoint(ranks) -> None:
    """Each rank holds about half of the stored iterates' bytes; the iterates at step 2 are written as full tensors
    (gathered over the ranks), read back whole at the resume, and the resumed run takes each rank's shard of them."""
    for rank in ranks:
        held = {how: rank[f"momentum {how}"]["local bytes"]["momentum iterates"] for how in ("sharded", "replicated")}
        assert held["replicated"] > 0 and held["sharded"] == pytest.approx(held["replicated"] / WORLD, rel=0.05)
        saved = rank["momentum sharded"]["momentum snapshots"]["save 2"]["iterates"]
        restored = rank["momentum resumed sharded"]["momentum snapshots"]["begin"]["iterates"]
        assert len(saved) == len(restored) == 2 and list(saved[0]) == list(restored[0])
        for before, after in zip(saved, restored, strict=True):
            assert all(not isinstance(v, DTensor) and torch.equal(v, after[k]) for k, v in before.items())
        assert rank["momentum resumed sharded"]["steps"] == 3


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_correlated_noise_streams_the_strategy_over_each_shards_draws(ranks, kind) -> None:
    """With zero gradients and SGD at learning rate 1 every update is the noise over the expected batch: on each rank
    the sharded run's noise at step ``t`` is ``(C^{-1} s Z)_t`` of the draws ``Z`` the independent-noise run of the
    same seed adds (the same shard-keyed streams), as under Lightning's DPModelParallelStrategy
    (tests/correlated_noise/test_correlated_fsdp.py); the ranks agree and epsilon is the plan's."""
    for rank in ranks:
        run, independent = rank[f"correlated {kind}"], rank["correlated independent"]
        assert run["sharded"] and independent["sharded"]
        noise, draws = noise_per_step(run), noise_per_step(independent)
        inverse = torch.as_tensor(run["strategy"].inverse_dense(noise.shape[0]))
        assert not torch.allclose(noise, run["scale"] * draws, atol=1e-3)  # correlated, not independent
        expected = inverse @ (run["scale"] * draws)
        torch.testing.assert_close(noise, expected, rtol=1e-6, atol=1e-9 * float(draws.abs().max()))
    a, b = (rank[f"correlated {kind}"] for rank in ranks)
    assert torch.equal(a["params"], b["params"]) and a["epsilon"] == b["epsilon"] == a["summary"]["epsilon"]
    assert a["summary"]["noise_correlation"] == kind
    assert a["summary"]["accountant"] == {"banded": "banded-mf", "blt": "blt-minsep"}[kind]


def test_an_exact_resume_of_a_sharded_run_equals_the_uninterrupted_run(ranks) -> None:
    """``exact_resume=True``, unseeded, BLT noise: resumed from the step-2 checkpoint (every rank's shard-keyed
    generator states and the buffers gathered into it, each rank taking back its own), the run's parameters at steps
    2-4 are the uninterrupted run's bit for bit, on both ranks."""
    for rank in ranks:
        whole, resumed = rank["exact whole"]["params"], rank["exact resumed"]["params"]
        assert whole.shape[0] == 5 and resumed.shape[0] == 3
        assert torch.equal(resumed, whole[2:]) and not torch.equal(whole[3] - whole[2], whole[4] - whole[3])
