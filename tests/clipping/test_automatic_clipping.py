"""Automatic clipping (``clipping_fn='automatic'``; Bu et al. 2023, Section 4; docs/design.md section 4.11): the factors
``C / (n + gamma)`` of every exact engine against a torch.func oracle (flat and per-group), the exact bound ``c nu <=
C`` of the factors for adversarial norms, one example of norm 1e30, 1e-30 or 0 moving the clipped sum by at most
``C``, the noise at ``sigma C``, the refusals on every surface, and short Lightning and HF runs."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import (
    PER_LAYER,
    VOCAB,
    TiedModel,
    expected_sum,
    group_norms,
    noise_of_one_step,
    oracle_grads,
    randomise,
)
from helpers import TinyRegressor, make_trainer
from hf_helpers import TokenDataset, tiny_bert_classifier
from hf_helpers import make_trainer as make_hf_trainer
from torch import nn
from transformers import HfArgumentParser, TrainingArguments

from lightning_dp import DPStrategy, PrivacyEngine
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.clip_functions import clip_factors
from lightning_dp.config import PrivacyConfig
from lightning_dp.hf import PrivacyArguments

ENGINES = ("flat", "ghost", "fgc", "mixed")
BATCH, SEQ = 6, 4
FLAT = dict.fromkeys(PER_LAYER, 0)


def _model() -> TiedModel:
    torch.manual_seed(0)
    return randomise(TiedModel(), 0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(2))  # type: ignore[return-value]


def _loss(forward, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ids, targets = inputs
    return F.cross_entropy(forward(ids).transpose(1, 2), targets, reduction="none").mean(1)


def _clipped_sum(model: nn.Module, engine: str, weights: torch.Tensor, keep: torch.Tensor, **options) -> torch.Tensor:
    """The clipped sum (flattened) of the examples ``keep`` of :func:`_batch`, each loss scaled by its weight."""
    ids, targets = _batch()
    model.zero_grad(set_to_none=True)
    clipper = PerSampleClipper(model, clipping=engine, sum_check_every=1, **options)
    try:
        clipper.backward(_loss(model, (ids[keep], targets[keep])) * weights[keep])
    finally:
        clipper.detach()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "per_layer"])
def test_clipped_sum_matches_the_oracle(engine: str, grouped: bool) -> None:
    """``sum_i C_g / (n_gi + gamma) g_gi`` of the float64 per-sample gradients (one group, or one per layer)."""
    model, inputs = _model(), _batch()
    grads = oracle_grads(model, inputs, _loss)
    group_of = PER_LAYER if grouped else FLAT
    bounds = [float(n.median()) for n in group_norms(grads, group_of)]
    expected = expected_sum(grads, group_of, bounds, gamma=0.01)
    clipper = PerSampleClipper(
        model,
        clipping=engine,
        max_grad_norm=bounds if grouped else bounds[0],
        clipping_groups="per_layer" if grouped else None,
        sum_check_every=1,
        clipping_fn="automatic",
        automatic_clipping_gamma=0.01,
    )
    norms = clipper.backward(_loss(model, inputs))
    torch.testing.assert_close(norms, group_norms(grads, FLAT)[0], rtol=1e-9, atol=1e-12)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
    clipper.detach()


def test_l1_clipping_divides_by_the_l1_norm_plus_gamma() -> None:
    """l1 (``flat``, the Laplace mechanism's norm): ``C / (||g||_1 + gamma)`` keeps the l1 sensitivity ``C``."""
    model, inputs = _model(), _batch()
    grads = oracle_grads(model, inputs, _loss)
    l1 = torch.cat([g.flatten(1) for g in grads.values()], 1).abs().sum(1)
    clipper = PerSampleClipper(model, max_grad_norm=0.5, norm=1, clipping_fn="automatic", automatic_clipping_gamma=0.1)
    clipper.backward(_loss(model, inputs))
    factors = 0.5 / (l1 + 0.1)
    for name, param in model.named_parameters():
        expected = torch.einsum("b,b...->...", factors, grads[name])
        torch.testing.assert_close(param.grad, expected, rtol=1e-9, atol=1e-12, msg=name)
    clipper.detach()


ADVERSARIAL = [0.0, 1e-45, 1e-40, 1e-30, 1e-6, 1.0, 1e6, 1e30, 1e38, math.inf]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [0.0, 0.01])
def test_factors_times_the_norm_bound_stay_within_one_rounding_of_c(dtype: torch.dtype, gamma: float) -> None:
    """Exactly (in rationals): ``c nu <= C (1 + eps)``, the factor's own rounding (``C`` in the dtype, the division)
    that the margin of the bound ``nu`` absorbs as for the standard factor, and ``c <= C / nu`` as computed; finite and
    >= 0 for zero, subnormal, tiny, huge and infinite bounds; a ``gamma`` below ``1e-6`` counts as ``1e-6``."""
    bound = 0.7
    nu = torch.tensor([ADVERSARIAL], dtype=dtype)
    factors = clip_factors(nu, [bound], "automatic", gamma)[0]
    assert factors.dtype == dtype and bool(torch.isfinite(factors).all()) and bool((factors >= 0).all())
    limit = Fraction(bound) * (1 + Fraction(torch.finfo(dtype).eps))
    for c, n in zip(factors.tolist(), nu[0].tolist(), strict=True):
        if math.isfinite(n):
            assert Fraction(c) * Fraction(n) <= limit
    unclamped = bound / nu[0]  # the standard factor where it clips
    assert bool((factors <= unclamped).all())
    if gamma == 0:  # the floor: C / (nu + 1e-6)
        assert float(factors[0]) == pytest.approx(bound / 1e-6, rel=1e-6)
        assert float(factors[3]) == pytest.approx(bound / 1e-6, rel=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("scale", [1e30, 1e-30, 0.0])
@pytest.mark.parametrize("gamma", [0.0, 0.01])
def test_one_example_moves_the_clipped_sum_by_at_most_c(engine: str, scale: float, gamma: float) -> None:
    """Add/remove adjacency with example 2's loss scaled by ``scale``: the clipped sums with and without it differ by
    at most ``C``; a huge gradient is normalised to about ``C``, a tiny or zero one adds about nothing (``gamma``
    counts as at least ``1e-6``)."""
    model, bound = _model(), 0.5
    weights = torch.ones(BATCH, dtype=torch.float64)
    weights[2] = scale
    options = dict(max_grad_norm=bound, clipping_fn="automatic", automatic_clipping_gamma=gamma)
    with_example = _clipped_sum(model, engine, weights, torch.arange(BATCH), **options)
    without = _clipped_sum(model, engine, weights, torch.tensor([0, 1, 3, 4, 5]), **options)
    assert bool(torch.isfinite(with_example).all())
    moved = float((with_example - without).norm())
    assert moved <= bound * (1 + 1e-9)
    if scale == 1e30:
        assert moved > bound * (1 - 1e-6)
    else:  # zero, or 1e-30 next to gamma >= 1e-6: nothing but the rounding of the other examples' sum
        assert moved < 1e-12


# ----------------------------------------------------------------------------------------- options and refusals
def _prepared(**options) -> PrivacyEngine:
    torch.manual_seed(0)
    engine = PrivacyEngine(**{"seed": 0, **options})
    engine.attach(nn.Sequential(nn.Linear(300, 100), nn.Tanh(), nn.Linear(100, 1)))
    engine.prepare(num_samples=1000, sample_rate=0.01, total_steps=200)
    return engine


def test_the_noise_is_sigma_c_and_the_startup_block_names_the_clip_function() -> None:
    """The sensitivity is ``C`` (``max_grad_norm``), so one step on zero clipped sums moves each of the 30k
    coordinates by noise of std ``sigma C`` / (q N); the accounting is that of standard clipping at ``C``."""
    engine = _prepared(noise_multiplier=1.5, max_grad_norm=0.7, clipping_fn="automatic")
    assert engine.mechanism.max_grad_norm == 0.7
    noise = noise_of_one_step(engine) * (0.01 * 1000)
    assert float(noise.std()) == pytest.approx(1.5 * 0.7, rel=0.02)  # 3 standard errors ~ 1.2 %
    (row,) = [line for line in engine.startup_lines() if "clip function" in line]
    assert "automatic: C / (||g|| + 0.01) (Bu et al. 2023), sensitivity C" in row
    standard = _prepared(noise_multiplier=1.5, max_grad_norm=0.7)
    assert not [line for line in standard.startup_lines() if "clip function" in line]
    standard.record_step()  # as the optimizer step above did for the automatic run
    assert engine.step_event() == standard.step_event() and engine.epsilon() == standard.epsilon()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(clipping_fn="Automatic"), "clipping_fn must be one of"),
        (dict(clipping_fn="automatic", automatic_clipping_gamma=-1.0), "finite number >= 0"),
        (dict(clipping_fn="automatic", automatic_clipping_gamma=math.nan), "finite number >= 0"),
        (dict(clipping_fn="automatic", clipping="hutchpp"), "needs an exact clipping engine"),
        (dict(clipping_fn="automatic", target_unclipped_quantile=0.5), "remove target_unclipped_quantile"),
    ],
)
def test_refused_on_every_surface(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        PrivacyConfig(noise_multiplier=1.0, **options)
    with pytest.raises(ValueError, match=match):
        DPStrategy(noise_multiplier=1.0, **options)
    with pytest.raises(ValueError, match=match):
        PrivacyArguments(noise_multiplier=1.0, **options)


def test_the_clipper_refuses_a_randomized_engine_and_a_bad_gamma() -> None:
    with pytest.raises(ValueError, match="needs an exact clipping engine"):
        PerSampleClipper(
            _model(),
            clipping="hutch",
            max_grad_norm=1.0,
            generator_for=lambda device: torch.Generator(device),
            clipping_fn="automatic",
        )
    with pytest.raises(ValueError, match="finite number >= 0"):
        PerSampleClipper(_model(), max_grad_norm=1.0, clipping_fn="automatic", automatic_clipping_gamma=math.inf)


def test_gamma_zero_is_normalised_sgd_and_is_accepted() -> None:
    config = PrivacyConfig(noise_multiplier=1.0, clipping_fn="automatic", automatic_clipping_gamma=0)
    assert config.sensitivity == 1.0 and config.automatic_clipping_gamma == 0


# ------------------------------------------------------------------------------------------------ the adapters
def test_lightning_trains_with_automatic_clipping() -> None:
    module = TinyRegressor()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    strategy = DPStrategy(noise_multiplier=1.0, clipping_fn="automatic", automatic_clipping_gamma=0.0, seed=0)
    make_trainer(strategy, max_steps=3).fit(module)
    assert strategy.privacy_summary()["steps"] == 3
    assert all(not torch.equal(before[n], p.detach()) for n, p in module.named_parameters())


def test_privacy_arguments_take_the_clip_function_from_the_command_line(tmp_path) -> None:
    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    flags = ["--output_dir", str(tmp_path), "--noise_multiplier", "1", "--clipping_fn", "automatic"]
    _, privacy = parser.parse_args_into_dataclasses([*flags, "--automatic_clipping_gamma", "0"])
    config = privacy.to_config()
    assert (config.clipping_fn, config.automatic_clipping_gamma) == ("automatic", 0.0)


def test_dp_trainer_trains_a_bert_classifier_with_automatic_clipping(tmp_path) -> None:
    model = tiny_bert_classifier()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    privacy = PrivacyArguments(noise_multiplier=1.0, clipping_fn="automatic", accountant="rdp", dp_seed=0)
    trainer = make_hf_trainer(model, tmp_path, TokenDataset(n=32, task="cls"), privacy=privacy)
    trainer.train()
    assert trainer.privacy_summary()["steps"] == 3
    assert all(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_factor_that_would_overflow_its_scaled_term_drops_the_example(engine: str) -> None:
    """float32, ``C = 1e30``: an example with a tiny input has a factor near ``C / 1e-6 = 1e36`` (``gamma`` counts as
    at least ``1e-6``), and its output gradient of 1e4 times that overflows. It is dropped (factor 0) instead of making
    the clipped sum non-finite, so the sum with it equals the sum without it; the other examples keep their factors."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False)
    inputs = torch.randn(4, 8)
    inputs[2] = 1e-38

    def clipped_sum(keep: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        clipper = PerSampleClipper(
            model, clipping=engine, max_grad_norm=1e30, clipping_fn="automatic", automatic_clipping_gamma=1e-37
        )
        try:
            clipper.backward((1e4 * model(inputs[keep])).sum(1))
        finally:
            clipper.detach()
        return model.weight.grad.clone()

    with_example, without = clipped_sum(torch.arange(4)), clipped_sum(torch.tensor([0, 1, 3]))
    assert bool(torch.isfinite(with_example).all())
    torch.testing.assert_close(with_example, without, rtol=0, atol=0)
    assert float(without.norm()) > 0.5e30
