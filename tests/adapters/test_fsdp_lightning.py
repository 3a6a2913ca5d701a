"""DPModelParallelStrategy: DP training of an FSDP2-sharded model under Lightning (docs/design.md section 8.1), 2 CPU
processes over gloo.

``fsdp_fit_script.py`` runs in a subprocess, which Lightning's own launcher turns into 2 ranks; in one launch it trains
a tiny float32 Llama (tied embeddings, sharded with ``fully_shard`` in ``configure_model``) several times (see its
docstring). Checked: the gathered parameters are identical on both ranks and changed; epsilon (engine and
``PrivacyAccountantCallback``) is the single-process accountant's at the same q and steps; two runs with one seed give
identical parameters; a sharded checkpoint (DCP folder, privacy state in ``meta.pt``), and a full one in one file,
restore the weights and resume with the uninterrupted run's step count and epsilon; ``generate`` works on the gathered
weights on rank 0 and on the sharded model; a refused load (a checkpoint without privacy state, whose weights
ModelParallelStrategy loads before the check) refuses a fit without a checkpoint until one is loaded;
``Trainer(strategy="dp_fsdp")`` trains at epsilon 3; the low-pass filter's history resumes from a sharded checkpoint;
per-sample momentum, with zero noise, trains exactly as under DPDDPStrategy on the unsharded model, and its iterates
resume from a sharded checkpoint (epsilon continues). The engine's own sharded numbers (norms, the clipped sum, the
noise) are tested in tests/engine/test_fsdp.py. Arguments that are not supported fail at construction.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from process_helpers import SCRIPTS, launch_env

from lightning_dp import DPModelParallelStrategy
from lightning_dp.accounting.calibration_helpers import epsilon_for
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent

pytest.importorskip("transformers")

WORLD = 2
FITS = ("a", "b", "part", "resumed", "part (one file)", "resumed (one file)", "name", "layers only")
FITS += ("lowpass part", "lowpass resumed", "momentum sharded", "momentum replicated", "momentum part")
FITS += ("momentum resumed",)  # and "refused": four fits on one trainer


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[dict], str]:
    """Run fsdp_fit_script.py once (about 30 s on 2 cores); each rank's results and the launch's stderr."""
    out = tmp_path_factory.mktemp("fsdp_lightning")
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "fsdp_fit_script.py"), str(out)],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)], done.stderr


@pytest.fixture(scope="module")
def ranks(launched) -> list[dict]:
    return launched[0]


def _single_process_epsilon(run: dict) -> float:
    event = PoissonSampledEvent(run["sample_rate"], GaussianEvent(run["noise_multiplier"]))
    return epsilon_for(event, run["steps"], run["delta"], run["summary"]["accountant"])


def test_every_rank_trained_on_a_non_empty_batch_every_step(ranks):
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {WORLD}
    for rank in ranks:
        for name in FITS:
            assert rank[name]["batch_sizes"] and min(rank[name]["batch_sizes"]) > 0, name


@pytest.mark.parametrize("name", ["a", "name"], ids=["instance", "registered_name"])
def test_gathered_parameters_identical_on_both_ranks_and_changed(ranks, name):
    a, b = (r[name] for r in ranks)
    assert a["strategy"] == b["strategy"] == "DPModelParallelStrategy"
    assert a["steps"] == b["steps"] == a["global_step"] == 3
    assert a["params"].keys() == a["initial"].keys() and len(a["params"]) == 20  # tied: the embedding once
    for key, value in a["params"].items():
        assert torch.equal(value, b["params"][key]), key
        assert not torch.equal(value, a["initial"][key]), key
        assert torch.equal(a["initial"][key], b["initial"][key])  # the seeded initialisation
        assert torch.equal(a["start params"][key], a["initial"][key])  # sharding kept it


def test_unsharded_parameters_start_from_rank_0_and_stay_identical(ranks):
    """Only the decoder layers sharded: the embedding and the final norm are plain tensors, copied from rank 0 at
    setup (rank 1 changed its norm weight) and updated from the all-reduced clipped sums, next to sharded ones."""
    a, b = (r["layers only"] for r in ranks)
    assert torch.equal(a["norm before setup"], a["initial"]["model.norm.weight"])
    assert torch.equal(b["norm before setup"], a["initial"]["model.norm.weight"] + 1.0)  # rank 1's own
    for key, value in a["params"].items():
        assert torch.equal(b["start params"][key], a["initial"][key]), key  # rank 0's
        assert torch.equal(value, b["params"][key]), key
        assert not torch.equal(value, a["initial"][key]), key
    assert a["steps"] == 3 and a["epsilon"] == pytest.approx(ranks[0]["a"]["epsilon"], rel=1e-12)


@pytest.mark.parametrize("name", ["a", "name"], ids=["instance", "registered_name"])
def test_epsilon_equals_the_single_process_accountant(ranks, name):
    first = ranks[0][name]
    assert first["sample_rate"] == pytest.approx(16 * WORLD / 64) and first["num_samples"] == 64
    expected = _single_process_epsilon(first)
    for rank in ranks:
        run = rank[name]
        assert run["epsilon"] == pytest.approx(expected, rel=1e-12)
        assert (run["sample_rate"], run["delta"], run["noise_multiplier"]) == (
            first["sample_rate"],
            first["delta"],
            first["noise_multiplier"],
        )
    assert first["summary"]["epsilon"] == pytest.approx(expected, rel=1e-12)  # PrivacyAccountantCallback
    if name == "name":  # "dp_fsdp": target_epsilon 3, the noise calibrated for the 3 planned steps
        assert 2.5 < expected <= 3.0 + 1e-9 and first["summary"]["clipping"] == "mixed"
    else:
        assert first["noise_multiplier"] == 1.0


def test_the_same_seed_gives_identical_parameters(ranks):
    for rank in ranks:
        first, second = rank["a"]["params"], rank["b"]["params"]
        assert rank["a"]["batch_sizes"] == rank["b"]["batch_sizes"]
        assert all(torch.equal(first[key], second[key]) for key in first)


def test_sharded_checkpoint_resumes_the_privacy_ledger(ranks):
    checkpoint = ranks[0]["checkpoint"]
    assert Path(checkpoint["path"]).name == "epoch=0-step=2.ckpt"
    assert {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(checkpoint["files"])  # a shard per rank
    meta = checkpoint["meta"]
    assert meta["global_step"] == 2 and "state_dict" not in meta  # the tensors are in the shards
    ((event, count),) = meta["lightning_dp"]["accountant"]["ledger"]  # the privacy state: 2 steps at q = 0.5
    assert count == 2 and event["sample_rate"] == 0.5
    uninterrupted = ranks[0]["a"]
    for rank in ranks:
        part, resumed = rank["part"], rank["resumed"]
        assert (part["steps"], part["global_step"]) == (2, 2)
        assert len(resumed["batch_sizes"]) == 1  # only the third step ran after resuming
        assert all(torch.equal(resumed["start params"][k], v) for k, v in part["params"].items())  # the weights
        assert (resumed["steps"], resumed["global_step"]) == (3, 3) == (uninterrupted["steps"], 3)
        assert part["epsilon"] < resumed["epsilon"] == pytest.approx(uninterrupted["epsilon"], rel=1e-12)
        assert resumed["summary"]["epsilon"] == pytest.approx(uninterrupted["epsilon"], rel=1e-12)
    first, second = (r["resumed"]["params"] for r in ranks)
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_a_refused_load_refuses_a_fit_without_a_checkpoint_until_one_is_loaded(ranks):
    """ModelParallelStrategy loads a checkpoint's weights before its privacy state is checked: after the refusal of a
    checkpoint without privacy state, a fit without a checkpoint would train those weights from an empty ledger. A
    resume into the module a fit trained is not refused: the sharded load writes every trainable weight."""
    uninterrupted = ranks[0]["a"]
    for rank in ranks:
        stripped, no_checkpoint = rank["refused"]["errors"]
        assert "holds no privacy state" in stripped
        assert no_checkpoint.startswith("A checkpoint loaded into this run was not trained from")
        assert rank["refused"]["steps"] == 3
        assert rank["refused"]["epsilon"] == pytest.approx(uninterrupted["epsilon"], rel=1e-12)


def test_full_checkpoint_in_one_file_resumes_the_privacy_ledger(ranks):
    """``save_distributed_checkpoint=False``: ModelParallelStrategy gathers the full state into one file. Without a
    trainable weight, such a file is refused even with ``strict_loading=False`` (Lightning would write the missing
    weight with the module's own value)."""
    assert ranks[0]["one file"]
    for rank in ranks:
        missing = "did not write trainable parameter(s) 'model.model.layers.0.self_attn.o_proj.weight'"
        assert missing in rank["missing weight"]
    uninterrupted = ranks[0]["a"]
    for rank in ranks:
        part, resumed = rank["part (one file)"], rank["resumed (one file)"]
        assert (part["steps"], resumed["steps"], resumed["global_step"], len(resumed["batch_sizes"])) == (2, 3, 3, 1)
        assert resumed["epsilon"] == pytest.approx(uninterrupted["epsilon"], rel=1e-12)
        assert all(torch.equal(resumed["start params"][k], v) for k, v in part["params"].items())


def test_generate_on_the_gathered_weights_and_on_the_sharded_model(ranks):
    first, second = ranks
    full = first["full state dict"]
    assert second["full state dict"] == {}  # only rank 0 receives the full weights
    for key, value in first["a"]["params"].items():
        assert torch.equal(full[key], value), key
    assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])  # the tie survives
    torch.testing.assert_close(first["logits sharded"], first["logits on rank 0"], rtol=1e-5, atol=1e-6)
    generated = first["generated on rank 0"]
    assert generated.shape == (1, 4 + 6) and torch.equal(generated[:, :4], torch.tensor([[5, 17, 256, 999]]))
    assert torch.equal(first["generated sharded"], generated) and torch.equal(second["generated sharded"], generated)


# ----------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("size", [2, "auto"])
def test_tensor_parallelism_is_refused(size):
    with pytest.raises(ValueError, match="over tensor parallelism is not supported"):
        DPModelParallelStrategy(noise_multiplier=1.0, tensor_parallel_size=size)


def test_defaults_data_parallel_over_every_process_with_the_independence_check():
    strategy = DPModelParallelStrategy(noise_multiplier=1.0, save_distributed_checkpoint=False)
    assert strategy.privacy_engine.config.check_batch_independence is True  # in lockstep over the ranks
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == ("auto", 1)
    assert strategy._save_distributed_checkpoint is False  # ModelParallelStrategy's own arguments pass through


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "dp_optimizer"])
def test_optimizer_state_is_collected_without_a_dp_step(wrapped):
    """torch's get_optimizer_state_dict steps an optimizer without state (plain SGD) to create it: the strategy
    collects the state from the user's optimizer, so no noise is drawn and no privacy step recorded."""
    from lightning_dp.mechanisms import make_mechanism
    from lightning_dp.optim import DPOptimizer, DPRandomness

    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    recorded: list[int] = []
    optimizer = DPOptimizer(
        sgd,
        mechanism=make_mechanism("gaussian", max_grad_norm=1.0, noise_multiplier=1.0),
        expected_batch_size=4.0,
        randomness=DPRandomness(0),
        on_step=lambda: recorded.append(1),
    )
    strategy = DPModelParallelStrategy(noise_multiplier=1.0)
    strategy.model = model
    before = [p.detach().clone() for p in model.parameters()]
    state = strategy.optimizer_state(optimizer if wrapped else sgd)
    assert recorded == [] and "param_groups" in state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_the_lowpass_filters_history_resumes_from_the_sharded_checkpoint(ranks):
    """A low-pass filter on a sharded model: the history at step 2 is saved gathered (full tensors, in the
    checkpoint's privacy state), restored whole on every rank, and the resumed run takes its shards and trains on."""
    for rank in ranks:
        part, resumed = rank["lowpass part"], rank["lowpass resumed"]
        saved, restored = part["lowpass"], resumed["start lowpass"]
        assert saved["steps"] == restored["steps"] == 2 and len(saved["m"]) == len(saved["vbar"]) == 1
        for key in ("m", "vbar"):
            assert all(torch.equal(a, b) for a, b in zip(saved[key][0], restored[key][0], strict=True))
        assert [tuple(t.shape) for t in saved["m"][0]] == [tuple(p.shape) for p in part["params"].values()]
        assert resumed["steps"] == 3 and resumed["lowpass"]["steps"] == 3


def test_zero_noise_momentum_equals_unsharded_training(ranks):
    """Per-sample momentum (3 iterates), with an evaluation forward after every step: the sharded model under
    DPModelParallelStrategy trains as the unsharded one under DPDDPStrategy, to float64 round-off."""
    sharded, replicated = (ranks[0][f"momentum {how}"] for how in ("sharded", "replicated"))
    assert sharded["strategy"] == "DPModelParallelStrategy" and replicated["strategy"] == "DPDDPStrategy"
    assert sharded["batch_sizes"] == replicated["batch_sizes"] and sharded["steps"] == replicated["steps"] == 3
    assert sharded["params"].keys() == replicated["params"].keys()
    for key, value in sharded["params"].items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(value, replicated["params"][key], rtol=0, atol=1e-12, msg=key)
        assert not torch.equal(value, sharded["initial"][key]), key
    assert len(sharded["momentum"]["iterates"]) == 2


def test_the_momentum_iterates_resume_from_the_sharded_checkpoint_and_epsilon_continues(ranks):
    """The iterates at step 2 are saved gathered (full tensors, in the checkpoint's privacy state), restored on
    every rank, and the resumed run takes its shards, re-runs its step at them and reaches the uninterrupted run's
    epsilon."""
    for rank in ranks:
        part, resumed = rank["momentum part"], rank["momentum resumed"]
        saved, restored = part["momentum"]["iterates"], resumed["start momentum"]["iterates"]
        assert len(saved) == len(restored) == 2 and [k.removeprefix("model.") for k in saved[0]] == list(part["params"])
        for before, after in zip(saved, restored, strict=True):
            assert all(type(after[k]) is torch.Tensor and torch.equal(v, after[k]) for k, v in before.items())
        assert (part["steps"], resumed["steps"]) == (2, 3)
        sizes = resumed["batch_sizes"]  # one step: its batch at the current iterate and at the 2 restored ones
        assert len(sizes) == 3 and len(set(sizes)) == 1
        assert part["epsilon"] < resumed["epsilon"] == pytest.approx(rank["a"]["epsilon"], rel=1e-12)
