"""Group-wise clipping through the privacy options: the noise is scaled to the sensitivity ``sqrt(sum_g C_g^2)``
(measured on the noise a step adds), calibration and accounting are flat clipping's at that bound, the summary and
the start-up block show the groups' bounds, the settings refused on every surface, and short Lightning and HF runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from clipping_helpers import noise_of_one_step
from helpers import TinyRegressor, make_trainer
from hf_helpers import TokenDataset, tiny_bert_classifier
from hf_helpers import make_trainer as make_hf_trainer
from torch import nn
from transformers import HfArgumentParser, TrainingArguments

from lightning_dp import DPStrategy, PrivacyEngine
from lightning_dp.config import PrivacyConfig
from lightning_dp.hf import PrivacyArguments
from lightning_dp.lightning import PrivacyAccountantCallback
from lightning_dp.mechanisms import make_mechanism
from lightning_dp.recipes.config import config_as_flags

BOUNDS = [0.6, 1.2]  # two layers: sensitivity sqrt(0.36 + 1.44) = sqrt(1.8)
SENSITIVITY = math.sqrt(1.8)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 100), nn.Tanh(), nn.Linear(100, 1))


def _prepared(**options) -> PrivacyEngine:
    engine = PrivacyEngine(**{"seed": 0, **options})
    engine.attach(_model())
    engine.prepare(num_samples=1000, sample_rate=0.01, total_steps=200)
    return engine


def test_the_noise_added_has_std_sigma_times_the_l2_sum_of_the_bounds() -> None:
    """One step on zero clipped sums: each of the 30k coordinates moves by noise / (q N); its std is
    ``sigma sqrt(sum C_g^2)``, not ``sigma max C_g`` nor ``sigma sum C_g``."""
    engine = _prepared(noise_multiplier=1.5, max_grad_norm=BOUNDS, clipping_groups="per_layer")
    assert engine.mechanism.max_grad_norm == pytest.approx(SENSITIVITY, rel=1e-15)
    noise = noise_of_one_step(engine) * (0.01 * 1000)
    assert noise.numel() > 30_000
    assert float(noise.std()) == pytest.approx(1.5 * SENSITIVITY, rel=0.02)  # 3 standard errors ~ 1.2 %


def test_calibration_and_epsilon_are_flat_clippings_at_the_sensitivity() -> None:
    grouped = _prepared(target_epsilon=2.0, max_grad_norm=BOUNDS, clipping_groups="per_layer", accountant="rdp")
    flat = _prepared(target_epsilon=2.0, max_grad_norm=SENSITIVITY, accountant="rdp")
    assert grouped.mechanism.noise_multiplier == flat.mechanism.noise_multiplier
    assert grouped.mechanism.max_grad_norm == pytest.approx(flat.mechanism.max_grad_norm, rel=1e-15)
    fixed = [_prepared(noise_multiplier=1.1, **bounds) for bounds in (dict(max_grad_norm=1.0), GROUPED_OPTIONS)]
    for engine in fixed:
        for _ in range(50):
            engine.record_step()
    assert fixed[0].step_event() == fixed[1].step_event()
    assert fixed[0].epsilon() == fixed[1].epsilon() > 0


GROUPED_OPTIONS = dict(max_grad_norm=2.0, clipping_groups=[["0.*"], ["2.*"]])  # 2 groups of sqrt(2) each


def test_summary_and_startup_block_show_the_bounds_and_the_sensitivity() -> None:
    engine = _prepared(noise_multiplier=1.0, **GROUPED_OPTIONS)
    engine.record_step()
    summary = engine.summary()
    assert summary["max_grad_norm"] == 2.0  # the sensitivity the noise is scaled to
    assert summary["clipping_groups"] == {"0.*": pytest.approx(math.sqrt(2)), "2.*": pytest.approx(math.sqrt(2))}
    assert summary["clipping"] == "mixed"  # 'auto' resolves as without groups
    (row,) = [line for line in engine.startup_lines() if "clipping groups" in line]
    assert "2 group(s) (patterns): 0.* 1.414, 2.* 1.414; sensitivity sqrt(sum C_g^2) = 2" in row
    engine.detach()
    assert engine.summary()["clipping_groups"] == summary["clipping_groups"]  # kept after the run


def test_a_checkpoint_resumes_at_the_same_sensitivity_only() -> None:
    """The privacy state holds the mechanism, whose bound is the sensitivity: a run with groups of the same
    sensitivity continues the ledger; a run whose sensitivity differs is refused."""
    engine = _prepared(noise_multiplier=1.0, max_grad_norm=BOUNDS, clipping_groups="per_layer")
    for _ in range(3):
        engine.record_step()
    state = engine.state_dict()
    assert state["mechanism"]["max_grad_norm"] == pytest.approx(SENSITIVITY)
    same = PrivacyEngine(noise_multiplier=1.0, max_grad_norm=BOUNDS, clipping_groups="per_layer")
    same.load_state_dict(state)
    assert same.accountant.steps == 3
    other = PrivacyEngine(noise_multiplier=1.0, max_grad_norm=[0.6, 0.6], clipping_groups="per_layer")
    with pytest.raises(ValueError, match="resume with the same clipping bound"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(max_grad_norm=[1.0, 2.0], noise_multiplier=1.0), "clipping_groups is not set"),
        (dict(max_grad_norm=[1.0, 0.0], clipping_groups="per_layer", noise_multiplier=1.0), "positive finite"),
        (dict(clipping_groups="layers", noise_multiplier=1.0), "must be 'per_layer'"),
        (dict(noise="laplace", noise_params={"noise_scale": 1.0}, clipping_groups="per_layer"), "l2 mechanism"),
        (dict(clipping="hutch", clipping_groups="per_layer", noise_multiplier=1.0), "exact clipping engine"),
        (dict(target_unclipped_quantile=0.5, clipping_groups="per_layer", noise_multiplier=1.0), "adaptive clipping"),
        (dict(max_grad_norm=[1.0], clipping_groups=[["a*"], ["b*"]], noise_multiplier=1.0), "1 bounds but"),
    ],
)
def test_refused_on_every_surface(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        PrivacyConfig(**options)
    with pytest.raises(ValueError, match=match):
        DPStrategy(**options)
    hf = {("per_sample_max_grad_norm" if k == "max_grad_norm" else k): v for k, v in options.items()}
    if isinstance(hf.get("noise_params"), dict):
        hf["noise_params"] = json.dumps(hf["noise_params"])
    with pytest.raises(ValueError, match=match):
        PrivacyArguments(**hf)


def test_a_mechanism_instance_must_carry_the_sensitivity() -> None:
    mechanism = make_mechanism("gaussian", noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"sensitivity sqrt\(sum C_g\^2\) = 1.3416"):
        PrivacyConfig(noise=mechanism, max_grad_norm=BOUNDS, clipping_groups="per_layer")
    ok = make_mechanism("gaussian", noise_multiplier=1.0, max_grad_norm=math.sqrt(0.6**2 + 1.2**2))
    assert PrivacyConfig(noise=ok, max_grad_norm=BOUNDS, clipping_groups="per_layer").sensitivity == SENSITIVITY


def test_the_audits_refuse_group_clipping() -> None:
    from lightning_dp.audit.controls import scale_clipping_for_testing

    engine = _prepared(noise_multiplier=1.0, **GROUPED_OPTIONS)
    with pytest.raises(ValueError, match="clips by groups"):
        scale_clipping_for_testing(engine.clipper, 10.0)


# ------------------------------------------------------------------------------------------------- Lightning
def test_lightning_trains_with_per_layer_bounds_and_reports_them() -> None:
    module = TinyRegressor()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=BOUNDS, clipping_groups="per_layer", seed=0)
    callback = PrivacyAccountantCallback()
    make_trainer(strategy, max_steps=3, callbacks=[callback]).fit(module)
    summary = strategy.privacy_summary()
    assert summary["steps"] == 3 and summary["clipping_groups"] == {"net.0": 0.6, "net.2": 1.2}
    assert summary["max_grad_norm"] == pytest.approx(SENSITIVITY) and callback.summary == summary
    assert all(not torch.equal(before[n], p.detach()) for n, p in module.named_parameters())


# ------------------------------------------------------------------------------------------------------ HF
def test_privacy_arguments_take_groups_from_the_command_line_and_yaml(tmp_path) -> None:
    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    flags = ["--output_dir", str(tmp_path), "--noise_multiplier", "1"]
    _, per_layer = parser.parse_args_into_dataclasses([*flags, "--clipping_groups", "per_layer"])
    assert (per_layer.clipping_groups, per_layer.per_sample_max_grad_norm) == ("per_layer", 1.0)
    groups = '[["bert.*"], ["classifier.*"]]'
    _, listed = parser.parse_args_into_dataclasses(
        [*flags, "--clipping_groups", groups, "--per_sample_max_grad_norm", "0.5", "0.7"]
    )
    assert listed.clipping_groups == [["bert.*"], ["classifier.*"]] and listed.per_sample_max_grad_norm == [0.5, 0.7]
    _, one = parser.parse_args_into_dataclasses([*flags, "--per_sample_max_grad_norm", "0.5"])
    assert one.per_sample_max_grad_norm == 0.5 and one.to_config().max_grad_norm == 0.5
    yaml_values = {"clipping_groups": [["bert.*"], ["classifier.*"]], "per_sample_max_grad_norm": [0.5, 0.7]}
    assert config_as_flags(yaml_values) == [
        "--clipping_groups",
        '[["bert.*"], ["classifier.*"]]',
        "--per_sample_max_grad_norm",
        "0.5",
        "0.7",
    ]


def test_dp_trainer_trains_a_bert_classifier_with_pattern_groups(tmp_path) -> None:
    model = tiny_bert_classifier()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    privacy = PrivacyArguments(
        noise_multiplier=1.0,
        per_sample_max_grad_norm="[0.3, 0.4]",
        clipping_groups='[["bert.*"], ["classifier.*"]]',
        accountant="rdp",
        dp_seed=0,
    )
    trainer = make_hf_trainer(model, tmp_path, TokenDataset(n=32, task="cls"), privacy=privacy)
    trainer.train()
    summary = trainer.privacy_summary()
    assert summary["steps"] == 3 and summary["max_grad_norm"] == pytest.approx(0.5)
    assert summary["clipping_groups"] == {"bert.*": 0.3, "classifier.*": 0.4}
    final = next(row for row in trainer.state.log_history if "train_runtime" in row)
    assert final["dp/clipping_groups/0"] == 0.3 and final["dp/max_grad_norm"] == pytest.approx(0.5)
    assert all(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters() if p.requires_grad)
