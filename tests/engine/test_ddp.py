"""DP on several processes (docs/design.md section 8), with 2 CPU processes over gloo.

Framework-agnostic parts run in 2 processes started with ``torch.multiprocessing.spawn``; the Lightning path runs
``ddp_fit_script.py`` in a subprocess, which Lightning's own launcher turns into 2 ranks. Checked: (a) parameters
bit-identical across ranks after steps; (b) the all-reduced clipped sum equals the single-process clipped sum over
the union of the ranks' examples; (c) the noise is ONE draw (the single-process draw and scale, for every mechanism,
not sqrt(2) times it); (d) the reported epsilon equals the single-process one for the same q and steps; plus the
sharded Poisson sampler and the argument checks.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import ClipBoundRecorder, TinyRegressor, make_trainer
from process_helpers import fit_on_two_processes, free_port
from torch import nn

from lightning_dp import DPDDPStrategy, DPStrategy, PrivacyEngine
from lightning_dp.data import PoissonBatchSampler
from lightning_dp.mechanisms import make_mechanism
from lightning_dp.optim import DPOptimizer, DPRandomness, distributed_context

WORLD = 2
CLIP = 0.5
NOISE_SIZE = 60_000  # coordinates of the pure-noise parameter: std estimates within ~1-3 %
MECHANISMS = {
    "gaussian": dict(noise_multiplier=1.3),
    "laplace": dict(noise_scale=2.5),
    "lap2": dict(noise_scale=0.8),
    "plrv": dict(gamma_shape=6.0, gamma_scale=0.4),
}


def _expected_std(name: str, params: dict) -> float:
    """Std of ONE draw per coordinate: sigma C; sqrt(2) b for Laplace; sqrt(2 E[1/u^2]) for PLRV, u ~ Gamma(k, th)."""
    if name == "gaussian":
        return params["noise_multiplier"] * CLIP
    if name == "plrv":
        k, theta = params["gamma_shape"], params["gamma_scale"]
        return math.sqrt(2.0 / (theta**2 * (k - 1) * (k - 2)))
    return math.sqrt(2.0) * params["noise_scale"]


def _model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    return model, x, y


def _per_sample_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        context = distributed_context()
        result: dict = {"rank": context.rank, "world_size": context.world_size}
        # (b) each rank clips its shard; the SUM all-reduce gives the clipped sum over the union
        model, x, y = _model_and_data()
        if rank == 1:
            for p in model.parameters():
                p.data.add_(1.0)  # a rank that starts elsewhere is brought back by the broadcast
        context.broadcast_module(model)
        engine = PrivacyEngine(max_grad_norm=CLIP, noise_multiplier=0.7, seed=None)
        clipper = engine.attach(model)
        clipper.backward(_per_sample_loss(model, x[rank::world], y[rank::world]))
        context.reduce_clipped_sum([p.grad for p in model.parameters()])
        result["clipped_sum"] = [p.grad.clone() for p in model.parameters()]
        # (a) two noisy steps through DPOptimizer, with OS-entropy seeds made common by the broadcast
        context.synchronize_randomness(engine.randomness)
        sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        optimizer = DPOptimizer(
            sgd,
            mechanism=engine.mechanism,
            expected_batch_size=6.0,
            randomness=engine.randomness,
            reduce_clipped_sum=context.reduce_clipped_sum,
        )
        for step in range(2):
            optimizer.zero_grad()
            shard = slice(rank + step, None, world)
            clipper.backward(_per_sample_loss(model, x[shard], y[shard]))
            optimizer.step()
        result["params"] = [p.detach().clone() for p in model.parameters()]
        # (c) pure noise (zero clipped sums): one draw per step, identical on every rank, for every mechanism
        for name, params in MECHANISMS.items():
            for seed in (None, 7):
                randomness = DPRandomness(seed)
                context.synchronize_randomness(randomness)
                weight = nn.Parameter(torch.zeros(NOISE_SIZE))
                weight.grad = torch.zeros(NOISE_SIZE)
                mechanism = make_mechanism(name, max_grad_norm=CLIP, **params)
                DPOptimizer(
                    torch.optim.SGD([weight], lr=1.0),
                    mechanism=mechanism,
                    expected_batch_size=1.0,
                    randomness=randomness,
                    reduce_clipped_sum=context.reduce_clipped_sum,
                ).privatise()
                result[("noise", name, seed)] = weight.grad.clone()
        try:
            context.check_identical("rank", rank)
        except RuntimeError as error:
            result["disagreement"] = str(error)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_spawn")
    mp.spawn(_worker, args=(WORLD, free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_ranks_know_their_place_and_disagreement_is_caught(spawned):
    assert [r["rank"] for r in spawned] == [0, 1] and {r["world_size"] for r in spawned} == {WORLD}
    assert all("ranks disagree on the rank" in r["disagreement"] for r in spawned)


def test_reduced_clipped_sum_equals_single_process_sum_over_the_union(spawned):
    model, x, y = _model_and_data()
    clipper = PrivacyEngine(max_grad_norm=CLIP, noise_multiplier=0.7).attach(model)
    clipper.backward(_per_sample_loss(model, x, y))
    for rank in spawned:
        for reduced, single in zip(rank["clipped_sum"], model.parameters(), strict=True):
            torch.testing.assert_close(reduced, single.grad, rtol=1e-5, atol=1e-6)
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


def test_parameters_bit_identical_across_ranks_after_noisy_steps(spawned):
    initial, _, _ = _model_and_data()
    for a, b, start in zip(spawned[0]["params"], spawned[1]["params"], initial.parameters(), strict=True):
        assert torch.equal(a, b)
        assert not torch.equal(a, start.detach())


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_noise_is_one_draw_identical_on_every_rank(spawned, name):
    params = MECHANISMS[name]
    for seed in (None, 7):
        noise = [r[("noise", name, seed)] for r in spawned]
        assert torch.equal(noise[0], noise[1])  # the same draw everywhere, even from OS entropy
        std, expected = noise[0].std().item(), _expected_std(name, params)
        assert std == pytest.approx(expected, rel=0.06)  # one draw; a sum of two would be sqrt(2) times larger
        assert abs(noise[0].mean().item()) < 5 * expected / math.sqrt(NOISE_SIZE)
    # with a seed the draw is exactly the single-process one (rank 0 keeps the single-process streams)
    mechanism = make_mechanism(name, max_grad_norm=CLIP, **params)
    single = mechanism.sample(torch.zeros(NOISE_SIZE), DPRandomness(7).noise_generator("cpu"))
    assert torch.equal(spawned[0][("noise", name, 7)], single)


# ------------------------------------------------------------------------------------------- Lightning
@pytest.fixture(scope="module")
def lightning_ranks(tmp_path_factory) -> list[dict]:
    return fit_on_two_processes(tmp_path_factory.mktemp("ddp_lightning"))


def test_lightning_ddp_trains_two_identical_ranks(lightning_ranks):
    a, b = lightning_ranks
    assert (a["rank"], b["rank"], a["world_size"]) == (0, 1, WORLD)
    for p, q, start in zip(a["params"], b["params"], a["initial"], strict=True):
        assert torch.equal(p, q)
        assert not torch.equal(p, start)
    assert a["steps"] == b["steps"] == a["global_step"] == 6
    assert a["sample_rate"] == pytest.approx(8 * WORLD / 64) and a["num_samples"] == 64
    assert a["ledger"] == b["ledger"]  # the same events on every rank


def test_lightning_ddp_periodic_independence_check_runs_on_the_same_steps_on_every_rank(tmp_path):
    """Every rank arms the same optimizer steps (the step count, not its local batch, decides) and checks its own
    examples there, without a collective; the ranks stay bit-identical."""
    a, b = fit_on_two_processes(tmp_path, "--independence-every", "2", "--seed", "0")  # seeded: no batch below 2
    expected = {"gradient": [0, 2, 4], "leave_half_out": [0, 2, 4]}
    assert a["checked_steps"] == b["checked_steps"] == expected
    assert a["steps"] == b["steps"] == 6
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))


def test_lightning_ddp_epsilon_equals_single_process(lightning_ranks):
    single = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, seed=0)
    make_trainer(single, max_steps=6).fit(TinyRegressor(batch_size=8 * WORLD))  # the same q = 16 / 64
    engine = single.privacy_engine
    assert engine.sample_rate == pytest.approx(lightning_ranks[0]["sample_rate"])
    for rank in lightning_ranks:
        assert rank["epsilon"] == pytest.approx(engine.epsilon(), rel=1e-12)
        assert rank["delta"] == engine.target_delta and rank["steps"] == engine.steps
    assert lightning_ranks[0]["summary"]["epsilon"] == pytest.approx(engine.epsilon(), rel=1e-12)


def test_lightning_ddp_user_level_equals_single_process_accounting(tmp_path):
    """privacy_unit='user' on two processes: every rank regroups the same users and samples its shard of them; the
    ranks stay identical and the accounting is the single process's, over users (q = 2 x 2 / 10 users)."""
    from helpers import USER_OPTIONS

    a, b = fit_on_two_processes(tmp_path, "--users", "--seed", "0")
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))
    assert any(not torch.equal(p, start) for p, start in zip(a["params"], a["initial"], strict=True))
    assert a["num_samples"] == 10 and a["sample_rate"] == pytest.approx(2 * WORLD / 10)
    single = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, seed=0, **USER_OPTIONS)
    torch.manual_seed(0)
    make_trainer(single, max_steps=6).fit(TinyRegressor(batch_size=2 * WORLD))
    engine = single.privacy_engine
    assert (engine.num_samples, engine.sample_rate) == (a["num_samples"], pytest.approx(a["sample_rate"]))
    assert a["epsilon"] == b["epsilon"] == pytest.approx(engine.epsilon(), rel=1e-12)
    assert a["summary"]["num_users"] == 10


def test_lightning_ddp_adaptive_clipping_equals_single_process(tmp_path):
    """Adaptive clipping on two processes: the ranks' counts of unclipped examples are summed and noised once, so
    with the same seed every step clips at the single process's bound and the parameters follow it (q = 1: each
    step's sample is all 64 examples, split between the ranks)."""
    from helpers import ADAPTIVE_OPTIONS

    ranks = fit_on_two_processes(tmp_path, "--adaptive")
    single = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, **ADAPTIVE_OPTIONS)
    recorder = ClipBoundRecorder()
    torch.manual_seed(0)
    module = TinyRegressor(batch_size=8 * WORLD)
    make_trainer(single, max_steps=6, callbacks=[recorder]).fit(module)
    bounds = [*recorder.bounds, single.privacy_engine.current_max_grad_norm]
    assert len(bounds) == 7 and bounds[0] == 0.5 and len(set(bounds)) == 7  # the bound moved at every step
    for rank in ranks:
        assert [*rank["bounds"], rank["final_bound"]] == pytest.approx(bounds, rel=1e-12)
        assert rank["steps"] == 6 and rank["epsilon"] == pytest.approx(single.privacy_engine.epsilon(), rel=1e-12)
        for got, want in zip(rank["params"], module.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach())  # float32: the all-reduce only reorders the sum


@pytest.mark.slow
def test_lightning_ddp_resume_continues_the_epsilon_curve(tmp_path):
    first = fit_on_two_processes(tmp_path, "--max-epochs", "1")
    (ckpt,) = (tmp_path / "ckpt").iterdir()
    resumed = fit_on_two_processes(tmp_path, "--max-epochs", "2", "--resume", str(ckpt))
    steps_per_epoch = math.ceil(64 / (8 * WORLD))
    assert first[0]["steps"] == steps_per_epoch and [r["steps"] for r in resumed] == [2 * steps_per_epoch] * 2
    assert resumed[0]["epsilon"] == resumed[1]["epsilon"] > first[0]["epsilon"]
    assert all(torch.equal(p, q) for p, q in zip(resumed[0]["params"], resumed[1]["params"], strict=True))


# ----------------------------------------------------------------------------------- sharded sampling
def test_sharded_poisson_union_is_one_global_poisson_sample():
    n, q, world, steps = 50, 0.3, 3, 3000
    generators = []
    for rank in range(world):
        randomness = DPRandomness(seed=None)
        randomness.share(12345, rank=rank)  # as after the broadcast of rank 0's base seed
        generators.append(randomness.sampling)
    samplers = [
        PoissonBatchSampler(n, q, num_steps=steps, generator=g, rank=r, world_size=world)
        for r, g in enumerate(generators)
    ]
    assert sorted(torch.cat([s.shard for s in samplers]).tolist()) == list(range(n))  # shards partition
    counts, joint, sizes = torch.zeros(n), 0, []
    for batches in zip(*samplers, strict=True):
        union = sum(batches, [])
        assert len(union) == len(set(union))  # disjoint: every example at most once per step
        for rank, batch in enumerate(batches):
            assert all(i % world == rank for i in batch)
        counts[union] += 1
        sizes.append(len(union))
        joint += (0 in batches[0]) and (1 in batches[1])  # same position in two shards
    assert torch.allclose(counts / steps, torch.full((n,), q), atol=0.035)
    assert sum(sizes) / steps == pytest.approx(q * n, rel=0.03)  # expected global batch q N
    assert joint / steps == pytest.approx(q * q, abs=0.03)  # independent across ranks (q, not q, if coupled)


def test_shared_randomness_same_noise_independent_sampling():
    streams = []
    for rank in range(2):
        randomness = DPRandomness(seed=None)
        randomness.share(99, rank=rank)
        streams.append(randomness)
    draw = [torch.randn(8, generator=r.noise_generator("cpu")) for r in streams]
    assert torch.equal(draw[0], draw[1])
    sampled = [torch.rand(8, generator=r.sampling) for r in streams]
    assert not torch.equal(sampled[0], sampled[1])
    single = DPRandomness(seed=99)  # rank 0 keeps the single-process streams
    assert torch.equal(torch.rand(8, generator=single.sampling), sampled[0])


def test_bad_shard_arguments():
    with pytest.raises(ValueError, match="rank"):
        PoissonBatchSampler(10, 0.1, generator=torch.Generator(), rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        DPRandomness().share(1, rank=-1)


# ----------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs", [{"devices": 2}, {"num_nodes": 2}])
def test_dp_strategy_rejects_several_devices_or_nodes(kwargs):
    with pytest.raises(ValueError, match="DPDDPStrategy"):
        make_trainer(DPStrategy(noise_multiplier=1.0), **kwargs)


@pytest.mark.parametrize("kwargs", [{"find_unused_parameters": True}, {"ddp_comm_hook": lambda *a: None}])
def test_ddp_arguments_without_effect_are_rejected(kwargs):
    with pytest.raises(ValueError, match="remove"):
        DPDDPStrategy(noise_multiplier=1.0, **kwargs)


def test_dp_ddp_strategy_validates_privacy_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        DPDDPStrategy()
