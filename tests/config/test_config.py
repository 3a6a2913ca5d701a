"""One definition of the privacy options: DPStrategy, DPDDPStrategy, DPModelParallelStrategy, PrivacyArguments and
PrivacyEngine are derived from PrivacyConfig; these tests fail when a surface drifts from it."""

from __future__ import annotations

import dataclasses

import pytest
from jsonargparse import ArgumentParser

from lightning_dp import DPDDPStrategy, DPModelParallelStrategy, DPStrategy, PrivacyEngine
from lightning_dp.config import HF_NAMES, OPTION_NAMES, PrivacyConfig
from lightning_dp.hf import PrivacyArguments

CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PrivacyConfig)}


@pytest.mark.parametrize("strategy", [DPStrategy, DPDDPStrategy, DPModelParallelStrategy])
def test_strategies_take_exactly_the_options_as_keywords(strategy) -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(strategy, "strategy")  # what LightningCLI sees
    seen = {action.dest.removeprefix("strategy."): action.default for action in parser._actions}
    for name, default in CONFIG_DEFAULTS.items():
        assert name in seen, f"{strategy.__name__} does not expose the option {name!r} to LightningCLI"
        assert seen[name] == default, name
    help_text = " ".join(parser.format_help().split())  # argparse wraps to the terminal's width
    assert "per-sample clipping bound C > 0" in help_text  # the option's documentation, from PrivacyConfig
    built = strategy(noise_multiplier=1.3, clipping="ghost", seed=3, sample_rate=0.1)
    expected = PrivacyConfig(noise_multiplier=1.3, clipping="ghost", seed=3, sample_rate=0.1)
    assert built.privacy_engine.config == expected


def test_lightning_strategy_arguments_still_reach_lightning() -> None:
    strategy = DPDDPStrategy(noise_multiplier=1.0, start_method="popen", process_group_backend="gloo")
    assert strategy._start_method == "popen" and strategy._process_group_backend == "gloo"


def test_privacy_arguments_are_the_options_with_hf_names() -> None:
    fields = {f.name: f for f in dataclasses.fields(PrivacyArguments)}
    expected = {HF_NAMES.get(name, name): default for name, default in CONFIG_DEFAULTS.items()}
    hf_own = {"per_example_reduction", "disable_dp"}  # PrivacyArguments' own fields, not PrivacyConfig's
    assert {name: f.default for name, f in fields.items() if name not in hf_own} == expected
    assert list(fields)[: len(OPTION_NAMES)] == [HF_NAMES.get(name, name) for name in OPTION_NAMES]
    for name in expected:
        assert f"\n        {name}: " in PrivacyArguments.__doc__, f"{name} undocumented in PrivacyArguments"
        assert fields[name].metadata["help"], name
    args = PrivacyArguments(per_sample_max_grad_norm=0.5, target_epsilon=2.0, dp_seed=4, noise_params="{}")
    assert args.to_config() == PrivacyConfig(max_grad_norm=0.5, target_epsilon=2.0, seed=4, noise_params={})


def test_every_option_is_documented_once_and_reused() -> None:
    for f in dataclasses.fields(PrivacyConfig):
        assert f.metadata["doc"] and f.metadata["help"], f.name
        assert f"\n            {f.name}: " in PrivacyEngine.__doc__, f.name
        assert f"\n        {f.name}: " in DPStrategy.__mro__[1].__doc__, f.name  # DPStrategyMixin


def test_engine_takes_a_config_or_its_options() -> None:
    config = PrivacyConfig(max_grad_norm=2.0, noise_multiplier=1.0, momentum_length=2)
    assert PrivacyEngine(config).config is config
    assert PrivacyEngine(max_grad_norm=2.0, noise_multiplier=1.0, momentum_length=2).config == config
    with pytest.raises(ValueError, match="not both"):
        PrivacyEngine(config, seed=1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.0}, "sample_rate"),
        ({"noise_multiplier": 1.0, "momentum_beta": 0.0}, "momentum_beta"),
        ({"noise_multiplier": 1.0, "lowpass": "nope"}, "lowpass preset"),
        ({"noise_multiplier": 1.0, "clipping": "hutch", "accountant": "rdp"}, "randomized-clipping"),
    ],
)
def test_validated_once_on_every_surface(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        PrivacyConfig(**options)
    with pytest.raises(ValueError, match=message):
        DPStrategy(**options)
    hf = {HF_NAMES.get(name, name): value for name, value in options.items()}
    with pytest.raises(ValueError, match=message):
        PrivacyArguments(**hf)
