"""Clipped gradient canaries (canary examples the run's clipper clips) and the TEST-ONLY broken-clipper control: the
new mode catches a clipper that clips to 10 C, the post-clipping Dirac mode cannot, and orthogonal input canaries
catch both a tenth of the noise and the clipper at 10 C."""

import math

import numpy as np
import pytest
import torch
from helpers import make_trainer
from torch.utils.data import DataLoader

from lightning_dp import DPStrategy
from lightning_dp.audit import (
    AuditConfig,
    ClippedGradientCanaries,
    ClippedGradientCanaryAudit,
    ScaleClippingForTesting,
    per_sample_loss_with_canaries,
    run_audit,
    scale_clipping_for_testing,
)
from lightning_dp.audit.setups import make_setup
from lightning_dp.clipping import PerSampleClipper


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fit_noiseless(scale, clipping_factor=None, num_canaries=400, epochs=3):
    setup = make_setup("linear")
    canaries = ClippedGradientCanaries(
        num_canaries, features=setup.unused_features, width=250, classes=10, input_scale=scale, seed=0
    )
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1.0, seed=0)
    callbacks = [ClippedGradientCanaryAudit(canaries, layer="layer")]
    if clipping_factor is not None:
        callbacks.insert(0, ScaleClippingForTesting(clipping_factor))
    train = canaries.training_set(setup.train_set)
    make_trainer(strategy, max_epochs=epochs, callbacks=callbacks).fit(
        setup.module, train_dataloaders=DataLoader(train, batch_size=100)
    )
    return canaries, strategy


@pytest.mark.parametrize(("clipping_factor", "clipped_norm"), [(None, 1.0), (10.0, 10.0)])
def test_canaries_are_clipped_by_the_runs_clipper(clipping_factor, clipped_norm):
    # Without noise an OUT canary's coordinate never moves; an IN canary adds, per sampled step, its gradient clipped
    # to the clipper's threshold: clipped_norm * s / sqrt(s^2 + 1) in its coordinate, divided by q N = 100.
    scale = 20.0
    canaries, strategy = _fit_noiseless(scale, clipping_factor)
    scores, included = canaries.scores, canaries.included.numpy()
    assert canaries.steps_observed == strategy.privacy_engine.steps
    assert np.all(scores[~included] == 0.0)
    unit = clipped_norm * scale / math.sqrt(scale**2 + 1) / 100
    sampled = scores[included] / unit
    np.testing.assert_allclose(sampled, np.round(sampled), atol=1e-3)
    q, steps = strategy.privacy_engine.sample_rate, strategy.privacy_engine.steps
    assert sampled.mean() == pytest.approx(q * steps, rel=0.15)
    broken = strategy.privacy_engine.summary().get("BROKEN_FOR_TESTING")
    assert (broken is not None) == (clipping_factor is not None)


def test_correct_run_audits_below_and_a_clipper_at_10c_above_the_reported_epsilon():
    config = dict(mode="clipped-gradient", target_epsilon=2.0, num_canaries=2000)
    correct = run_audit(AuditConfig(**config))
    assert correct.mode == "clipped-gradient" and not correct.violated
    assert correct.audit.epsilon_lower_bound < correct.reported_epsilon
    broken = run_audit(AuditConfig(**config, clipping_factor_for_testing=10.0))
    assert broken.violated and broken.audit.epsilon_lower_bound > broken.reported_epsilon


def test_post_clipping_dirac_canaries_cannot_see_a_clipper_at_10c():
    # The point of the clipped mode: Dirac canaries are added after clipping, so a broken clipper leaves them alone.
    config = dict(mode="gradient", target_epsilon=2.0, num_canaries=2000)
    correct = run_audit(AuditConfig(**config))
    broken = run_audit(AuditConfig(**config, clipping_factor_for_testing=10.0))
    assert not broken.violated
    assert broken.audit.epsilon_lower_bound == pytest.approx(correct.audit.epsilon_lower_bound)


def test_clipped_canaries_catch_a_tenth_of_the_noise():
    config = AuditConfig(mode="clipped-gradient", target_epsilon=2.0, num_canaries=2000, noise_factor_for_testing=0.1)
    assert run_audit(config).violated


@pytest.mark.parametrize(
    "broken", [{}, {"noise_factor_for_testing": 0.1}, {"clipping_factor_for_testing": 10.0}], ids=str
)
def test_orthogonal_input_canaries_catch_a_tenth_of_the_noise_and_a_clipper_at_10c(broken):
    config = AuditConfig(mode="input", input_candidates="orthogonal", target_epsilon=2.0, num_canaries=200, **broken)
    report = run_audit(config)
    assert report.violated == bool(broken)


def test_canary_loss_is_the_logit_and_leaves_other_rows_cross_entropy():
    logits = torch.randn(4, 3, requires_grad=True)
    labels = torch.tensor([0, -3, 2, -1])
    loss = per_sample_loss_with_canaries(logits, labels)
    ce = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    assert torch.allclose(loss[[0, 2]], ce[[0, 2]])
    assert torch.equal(loss[[1, 3]], logits[[1, 3], [2, 0]])
    (grad,) = torch.autograd.grad(loss[1], logits)
    assert torch.equal(grad, torch.zeros(4, 3).index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(1.0)))
    with pytest.raises(ValueError, match="outside"):
        per_sample_loss_with_canaries(logits, torch.tensor([0, -4, 0, 0]))
    with pytest.raises(ValueError, match=r"\[B\]"):
        per_sample_loss_with_canaries(logits, labels[:3])


def test_clipped_canary_errors():
    features = torch.arange(50, 250)
    with pytest.raises(ValueError, match="pairs"):
        ClippedGradientCanaries(2001, features=features, width=250, classes=10, input_scale=10.0)
    with pytest.raises(ValueError, match="input_scale"):
        ClippedGradientCanaries(5, features=features, width=250, classes=10, input_scale=0.0)
    with pytest.raises(ValueError, match="features"):
        ClippedGradientCanaries(5, features=torch.tensor([250]), width=250, classes=10, input_scale=10.0)
    with pytest.raises(ValueError, match="exceed max_grad_norm"):
        _fit_noiseless(0.5, epochs=1)
    with pytest.raises(ValueError, match="canary_norm"):
        AuditConfig(mode="clipped-gradient", canary_norm=1.0)
    with pytest.raises(ValueError, match="unused input features"):
        run_audit(AuditConfig(setup="digits", mode="clipped-gradient", num_canaries=10))
    with pytest.raises(ValueError, match="input_candidates"):
        AuditConfig(mode="input", input_candidates="random")
    with pytest.raises(ValueError, match="linear setup"):
        make_setup("digits", input_candidates="orthogonal")
    with pytest.raises(ValueError, match="factor"):
        ScaleClippingForTesting(1.0)


def test_scale_clipping_for_testing_changes_only_the_instance():
    layer = torch.nn.Linear(3, 2)
    clipper = PerSampleClipper(layer, max_grad_norm=1.0)
    other = PerSampleClipper(torch.nn.Linear(3, 2), max_grad_norm=1.0)
    scale_clipping_for_testing(clipper, 10.0)
    assert clipper.max_grad_norm == 10.0 and other.max_grad_norm == 1.0
    x = torch.randn(5, 3) * 100
    norms = clipper.backward(layer(x).sum(1))
    assert torch.all(norms > 10.0)
    total = torch.cat([p.grad.flatten() for p in layer.parameters()]).norm()
    assert total <= 5 * 10.0 + 1e-3 and total > 5 * 1.0  # each sample clipped to 10, not to 1
    with pytest.raises(ValueError, match="factor"):
        scale_clipping_for_testing(clipper, 0.5)
