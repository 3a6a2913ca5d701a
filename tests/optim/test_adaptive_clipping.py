"""Adaptive clipping (Andrew et al. 2021; lightning_dp/optim/adaptive_clipping.py).

Checked: without noise on the count the bound converges to the target quantile of a fixed norm distribution; the
sum's noise multiplier is Theorem 1's, so that the pair (sum, centred count) is one Gaussian at ``sigma`` and the
accountant's epsilon is dp-accounting's for that Gaussian; the count's noise has std ``sigma_b`` (recovered from the
bounds a run released, KS test); the clipper and the sum's noise follow the bound; a checkpoint carries it; the
options are validated; Lightning and HF log the bound; two processes give exactly the single-process run on the
union of their examples.
"""

from __future__ import annotations

import math
from pathlib import Path

import dp_accounting
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from process_helpers import free_port
from scipy import stats
from torch import nn

from lightning_dp import PrivacyEngine
from lightning_dp.config import PrivacyConfig
from lightning_dp.optim.adaptive_clipping import AdaptiveClipping, sum_noise_multiplier
from lightning_dp.runtime.distributed import distributed_context

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=generator).double(), torch.randint(0, 3, (n,), generator=generator)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def _engine(**options) -> PrivacyEngine:
    defaults = dict(max_grad_norm=5.0, noise_multiplier=1.0, seed=3, target_unclipped_quantile=0.5, clipping="mixed")
    return PrivacyEngine(**{**defaults, **options})


def _train(engine: PrivacyEngine, model: nn.Module, steps: int, batches, *, distributed=None) -> list[float]:
    """``steps`` steps, the micro-batches of step ``t`` being ``batches(t)``; the bound after each step."""
    engine.start_run(model, distributed)
    engine.prepare(num_samples=64, sample_rate=0.5, total_steps=None)
    collectives = {} if distributed is None else {"reduce_clipped_sum": distributed.reduce_clipped_sum}
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), **collectives)
    bounds = []
    for step in range(steps):
        optimizer.zero_grad()
        for x, y in batches(step):
            engine.clip(_loss(model, x, y))
        optimizer.step()
        bounds.append(engine.current_max_grad_norm)
    return bounds


# ------------------------------------------------------------------------------------------------- the update
@pytest.mark.parametrize("quantile", [0.1, 0.5, 0.9])
def test_without_count_noise_the_bound_converges_to_the_quantile(quantile) -> None:
    norms = torch.linspace(0.1, 10.0, 200, dtype=torch.float64)  # a fixed distribution of per-sample norms
    adaptive = AdaptiveClipping(
        initial_bound=50.0,
        target_unclipped_quantile=quantile,
        clipbound_learning_rate=0.2,
        unclipped_num_std=0.0,
        expected_batch_size=len(norms),
    )
    for _ in range(400):
        adaptive.count(norms)
        adaptive.update(torch.zeros(()))
    unclipped = float((norms <= adaptive.bound).double().mean())
    assert unclipped == pytest.approx(quantile, abs=0.02)
    assert adaptive.bound == pytest.approx(float(torch.quantile(norms, quantile)), rel=0.05)


def test_the_count_is_centred_summed_over_micro_batches_and_restarts() -> None:
    adaptive = AdaptiveClipping(
        initial_bound=1.0,
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.5,
        unclipped_num_std=1.0,
        expected_batch_size=4.0,
        min_clipbound=0.9,
    )
    adaptive.count(torch.tensor([0.5, 2.0, float("nan")]))  # 1 unclipped of 3: 1 - 1.5
    adaptive.count(torch.tensor([0.1, float("inf")]))  # 1 of 2: 1 - 1
    assert float(adaptive.count_tensor(torch.device("cpu"))) == -0.5
    bound = adaptive.update(torch.tensor(0.5))  # fraction (-0.5 + 0.5) / 4 + 1/2 = 0.5: no move
    assert bound == 1.0 and adaptive.centred_count is None
    adaptive.count(torch.tensor([5.0, 5.0]))  # none unclipped: fraction (-1) / 4 + 1/2 = 1/4 -> grows
    assert adaptive.update(torch.zeros(())) == pytest.approx(math.exp(0.5 * 0.25))
    adaptive.count(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))  # all unclipped -> shrinks, down to the clamp
    assert adaptive.update(torch.zeros(())) == 0.9


# ------------------------------------------------------------------------------------------------- privacy
@pytest.mark.parametrize(("sigma", "count_std"), [(1.0, 1.6), (0.8, 10.0), (2.5, 1.3)])
def test_theorem_one_the_pair_is_one_gaussian_at_sigma(sigma, count_std) -> None:
    """sigma_sum^-2 + (2 sigma_b)^-2 = sigma^-2: the pair's sensitivity in units of its noise is 1/sigma."""
    sum_sigma = sum_noise_multiplier(sigma, count_std)
    assert sum_sigma > sigma
    assert (sum_sigma**-2 + (2 * count_std) ** -2) ** -0.5 == pytest.approx(sigma, rel=1e-12)


def test_count_noise_that_costs_the_whole_step_is_refused() -> None:
    with pytest.raises(ValueError, match="unclipped_num_std > noise_multiplier / 2"):
        sum_noise_multiplier(1.0, 0.5)
    assert sum_noise_multiplier(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="unclipped_num_std"):
        PrivacyConfig(noise_multiplier=2.0, target_unclipped_quantile=0.5, unclipped_num_std=0.9)


def test_epsilon_is_dp_accountings_for_the_gaussian_at_sigma_and_the_sum_is_noised_at_sigma_sum() -> None:
    model, (x, y) = _model(), _data()
    engine = _engine(accountant="rdp")
    bounds = _train(engine, model, 12, lambda t: [(x[:32], y[:32])])
    event = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.0))
    reference = dp_accounting.rdp.RdpAccountant().compose(event, 12).get_epsilon(engine.target_delta)
    assert engine.epsilon() == pytest.approx(reference, rel=1e-6)
    assert engine.mechanism.noise_multiplier == 1.0  # the accounted Gaussian
    expected_std = 64 * 0.5 / 20  # q N / 20, the default
    assert engine.adaptive.unclipped_num_std == expected_std
    assert engine.sum_mechanism.noise_multiplier == pytest.approx(sum_noise_multiplier(1.0, expected_std))
    assert engine.sum_mechanism.max_grad_norm == engine.clipper.max_grad_norm == bounds[-1] != 5.0
    assert "unclipped_num_std = q N / 20 = 1.6" in " ".join(engine.defaults_applied)
    assert any(line.strip().startswith("adaptive clipping") for line in engine.startup_lines())


def test_the_count_noise_has_std_sigma_b() -> None:
    """Recover each step's count noise from the released bounds: ln(C_t / C_t+1) / eta + gamma - 1/2 = (count +
    noise) / (q N), with the count known (every norm far below the bound: all unclipped)."""
    model, (x, y) = _model(), _data()
    engine = _engine(max_grad_norm=1e6, unclipped_num_std=3.0, clipbound_learning_rate=1e-3)
    bounds = [1e6, *_train(engine, model, 400, lambda t: [(x[:32], y[:32])])]
    count = 32 - 0.5 * 32
    noise = [(math.log(bounds[t] / bounds[t + 1]) / 1e-3 + 0.5 - 0.5) * 32 - count for t in range(len(bounds) - 1)]
    assert stats.kstest(noise, stats.norm(scale=3.0).cdf).pvalue > 1e-3


def test_calibration_for_a_target_epsilon_fixes_sigma_and_derives_sigma_sum() -> None:
    model = _model()
    engine = PrivacyEngine(max_grad_norm=1.0, target_epsilon=3.0, target_unclipped_quantile=0.5, accountant="rdp")
    engine.attach(model)
    engine.prepare(num_samples=6400, sample_rate=0.02, total_steps=100)
    sigma = engine.mechanism.noise_multiplier
    plain = PrivacyEngine(max_grad_norm=1.0, target_epsilon=3.0, accountant="rdp")
    plain.attach(_model())
    plain.prepare(num_samples=6400, sample_rate=0.02, total_steps=100)
    assert sigma == plain.mechanism.noise_multiplier
    assert engine.sum_mechanism.noise_multiplier == pytest.approx(sum_noise_multiplier(sigma, 6.4))


@pytest.mark.parametrize("clipping", ["flat", "ghost", "fgc"])
def test_every_exact_engine_moves_the_bound_as_mixed_does(clipping) -> None:
    """Exact engines give the same norms, so the same counts and, with the same seed, the same bounds."""
    (x, y) = _data()
    batches = lambda t: [(x[:16], y[:16]), (x[16:32], y[16:32])]  # noqa: E731 - two micro-batches per step
    reference = _train(_engine(), _model(), 6, batches)
    bounds = _train(_engine(clipping=clipping), _model(), 6, batches)
    assert bounds == pytest.approx(reference, rel=1e-9) and len(set(bounds)) == 6


def test_each_step_clips_and_is_noised_at_one_bound_moved_only_after_its_noise() -> None:
    model, (x, y) = _model(), _data()
    engine = _engine()
    seen: list[tuple[str, float]] = []
    _train(engine, model, 0, lambda t: [])  # set up: the clipper and the sum's mechanism exist
    clipper, mechanism = engine.clipper, engine.sum_mechanism
    backward, sample = clipper.backward, mechanism.sample
    clipper.backward = lambda *a, **k: seen.append(("clip", clipper.max_grad_norm)) or backward(*a, **k)
    mechanism.sample = lambda *a, **k: seen.append(("noise", mechanism.max_grad_norm)) or sample(*a, **k)
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    bounds = [engine.current_max_grad_norm]
    for _ in range(4):
        optimizer.zero_grad()
        for part in (slice(0, 16), slice(16, 32)):
            engine.clip(_loss(model, x[part], y[part]))
        optimizer.step()
        bounds.append(engine.current_max_grad_norm)
    per_step = len(seen) // 4
    for t in range(4):
        step = seen[t * per_step : (t + 1) * per_step]
        assert [kind for kind, _ in step][:2] == ["clip", "clip"] and {c for _, c in step} == {bounds[t]}, t
    assert len(set(bounds)) == 5


def test_prepared_again_the_sums_mechanism_is_the_one_the_first_optimizer_holds() -> None:
    """A second fit prepares the engine again: an optimizer wrapped before must keep noising at the current bound."""
    model, (x, y) = _model(), _data()
    engine = _engine()
    _train(engine, model, 2, lambda t: [(x[:32], y[:32])])
    held = engine.sum_mechanism
    engine.prepare(num_samples=64, sample_rate=0.5, total_steps=None)
    assert engine.sum_mechanism is held and held.max_grad_norm == engine.current_max_grad_norm


def test_a_count_left_by_an_interrupted_step_is_discarded_at_the_next_run() -> None:
    model, (x, y) = _model(), _data()
    engine = _engine()
    _train(engine, model, 2, lambda t: [(x[:32], y[:32])])
    engine.clip(_loss(model, x[:8], y[:8]))  # a step cut off before its optimizer step
    assert engine.adaptive.centred_count is not None
    engine.detach()
    engine.start_run(model, None)
    assert engine.adaptive.centred_count is None


def test_the_summary_reports_the_current_bound_the_initial_one_and_the_sums_noise() -> None:
    model, (x, y) = _model(), _data()
    engine = _engine()
    bounds = _train(engine, model, 3, lambda t: [(x[:32], y[:32])])
    summary = engine.summary()
    assert summary["max_grad_norm"] == bounds[-1] and summary["initial_max_grad_norm"] == 5.0
    assert (
        summary["noise_multiplier"] == 1.0 and summary["sum_noise_multiplier"] == engine.sum_mechanism.noise_multiplier
    )
    from lightning_dp.lightning.callbacks import tracker_params

    params = tracker_params(summary)  # the trackers' parameters are fixed for the run (MLflow's cannot change)
    assert "dp/max_grad_norm" not in params and params["dp/initial_max_grad_norm"] == 5.0


# ------------------------------------------------------------------------------------------------- state
def test_a_checkpoint_carries_the_bound_and_a_mismatch_is_refused() -> None:
    model, (x, y) = _model(), _data()
    engine = _engine()
    bounds = _train(engine, model, 5, lambda t: [(x[:32], y[:32])])
    state = engine.state_dict()
    assert state["adaptive_clipping"] == {"bound": bounds[-1]}
    resumed = _engine()
    resumed.load_state_dict(state)
    resumed.attach(_model())
    resumed.prepare(num_samples=64, sample_rate=0.5, total_steps=None)
    assert resumed.current_max_grad_norm == resumed.clipper.max_grad_norm == bounds[-1]
    assert resumed.sum_mechanism.max_grad_norm == bounds[-1] and resumed.max_grad_norm == 5.0
    with pytest.raises(ValueError, match="adaptive clipping, this run clips at a fixed bound"):
        PrivacyEngine(max_grad_norm=5.0, noise_multiplier=1.0, seed=3, clipping="mixed").load_state_dict(state)
    fixed = PrivacyEngine(max_grad_norm=5.0, noise_multiplier=1.0, seed=3, clipping="mixed")
    _train(fixed, _model(), 1, lambda t: [(x[:32], y[:32])])
    with pytest.raises(ValueError, match="a fixed clipping bound, this run clips adaptively"):
        _engine().load_state_dict(fixed.state_dict())
    engine.load_state_dict(state)  # into the engine that moved its bound since: C_0 is what is compared
    assert engine.current_max_grad_norm == bounds[-1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(target_unclipped_quantile=1.0), "target_unclipped_quantile must be in"),
        (dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.0), "clipbound_learning_rate"),
        (dict(target_unclipped_quantile=0.5, min_clipbound=2.0, max_clipbound=1.0), "below max_clipbound"),
        (dict(target_unclipped_quantile=0.5, min_clipbound=-1.0), "min_clipbound must be > 0"),
        (dict(max_clipbound=3.0), "without target_unclipped_quantile"),
        (dict(target_unclipped_quantile=0.5, noise="laplace", noise_params={"noise_scale": 1.0}), "gaussian"),
        (dict(target_unclipped_quantile=0.5, clipping="hutch"), "exact clipping engine"),
        (dict(target_unclipped_quantile=0.5, min_clipbound=2.0), "lies outside"),
    ],
)
def test_bad_options_fail_early_naming_them(options, message) -> None:
    options = {"noise_multiplier": 1.0, **options}
    if "noise_params" in options:
        del options["noise_multiplier"]
    with pytest.raises(ValueError, match=message):
        PrivacyConfig(**options)


# ------------------------------------------------------------------------------------------------- trainers
def test_lightning_logs_the_bound_every_step(tmp_path) -> None:
    from helpers import TinyRegressor, make_trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_dp import DPStrategy, PrivacyAccountantCallback

    strategy = DPStrategy(
        max_grad_norm=1.0, noise_multiplier=1.0, seed=0, target_unclipped_quantile=0.5, unclipped_num_std=4.0
    )
    logger = CSVLogger(tmp_path)
    callbacks = [PrivacyAccountantCallback(plot=False)]
    trainer = make_trainer(strategy, max_steps=4, logger=logger, log_every_n_steps=1, callbacks=callbacks)
    trainer.fit(TinyRegressor())
    metrics = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    column = metrics[0].split(",").index("dp/max_grad_norm")
    logged = [float(row.split(",")[column]) for row in metrics[1:] if row.split(",")[column]]
    assert len(logged) == 4 + 1 and len(set(logged)) > 1  # after each step, then the final summary's
    assert logged[-1] == pytest.approx(strategy.privacy_engine.current_max_grad_norm, rel=1e-6)  # float32


def test_hf_logs_the_bound_with_epsilon(tmp_path) -> None:
    pytest.importorskip("transformers")
    from hf_helpers import LogRecorder, make_trainer, tiny_gpt2

    from lightning_dp.hf import PrivacyArguments

    privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0, target_unclipped_quantile=0.5, unclipped_num_std=4.0)
    trainer = make_trainer(tiny_gpt2(), tmp_path, privacy=privacy, args=dict(max_steps=3, logging_steps=1))
    recorder = LogRecorder()
    trainer.add_callback(recorder)
    trainer.train()
    logged = [log["dp/max_grad_norm"] for log in recorder.logs if "loss" in log]
    assert len(logged) == 3 and logged[-1] == trainer.privacy_engine.current_max_grad_norm


# ------------------------------------------------------------------------------------------------- 2 processes
def _worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x, y = _data()
        model = _model()
        batches = lambda t: [(x[8 * t + rank : 8 * t + 8 : world], y[8 * t + rank : 8 * t + 8 : world])] * 2  # noqa: E731
        bounds = _train(_engine(seed=11), model, 6, batches, distributed=distributed_context())
        torch.save({"bounds": bounds, "params": [p.detach() for p in model.parameters()]}, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_equal_one_process_on_the_union(tmp_path) -> None:
    """Each rank clips its half of each step's examples (two micro-batches); with the same seed the bounds and the
    parameters equal a single process clipping the union (float64: the all-reduce only reorders the sums)."""
    mp.spawn(_worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)]
    x, y = _data()
    model = _model()
    single = _train(_engine(seed=11), model, 6, lambda t: [(x[8 * t : 8 * t + 8], y[8 * t : 8 * t + 8])] * 2)
    for rank in ranks:
        assert rank["bounds"] == pytest.approx(single, rel=1e-12) and len(set(single)) == 6
        for got, want in zip(rank["params"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)


def test_the_audits_refuse_a_run_whose_bound_moves(tmp_path) -> None:
    from helpers import TinyRegressor, make_trainer

    from lightning_dp import DPStrategy
    from lightning_dp.audit.callback import GradientCanaryAudit

    strategy = DPStrategy(noise_multiplier=1.0, seed=0, target_unclipped_quantile=0.5, unclipped_num_std=4.0)
    trainer = make_trainer(strategy, max_steps=2, callbacks=[GradientCanaryAudit(4, seed=0)])
    with pytest.raises(ValueError, match="adaptive clipping"):
        trainer.fit(TinyRegressor())
