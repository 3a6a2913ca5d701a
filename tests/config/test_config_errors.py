"""A bad option in a config file or on the command line is one readable line: ``PROG: error: FILE: KEY: REASON`` (or
``PROG: error: --FLAG: REASON``), under ~200 characters, exit status 2, no traceback, with a suggestion for a
misspelt name. Each kind of mistake (unknown key, wrong type, out-of-range value, misspelt choice) at each level:
``lightning-dp fit`` YAML (the strategy's ``init_args``) and flags, a recipe's YAML and flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_dp.cli.fit import check_privacy_options, close_class_path
from lightning_dp.cli.jsonargparse_errors import read_error
from lightning_dp.cli.main import main
from lightning_dp.config import PrivacyConfig
from lightning_dp.config.errors import ConfigError, checking, invalid_option, locate, option_reason, unknown_option
from lightning_dp.lightning import DPStrategy
from lightning_dp.utils.naming import Naming

ROOT = Path(__file__).resolve().parents[2]

#: (mistake, option, bad value, reason in lightning-dp fit, reason in a recipe). The option is PrivacyConfig's name;
#: the recipes call ``max_grad_norm`` ``per_sample_max_grad_norm``.
MISTAKES = [
    ("unknown key", "max_grad_nrom", 2.0, "unknown option; did you mean 'max_grad_norm'?", None),
    ("wrong type", "max_grad_norm", "abc", "expected float or list, got abc", "must be a number, or one number per"),
    ("out of range", "max_grad_norm", -1.0, "must be a positive finite number, got -1.0", None),
    ("out of range", "target_delta", 2.0, "must lie in (0, 1), got 2.0; a typical choice is below 1/N", None),
    ("misspelt choice", "noise", "gausian", "Unknown noise 'gausian' (did you mean 'gaussian'?); choose one of", None),
    ("misspelt choice", "clipping", "gohst", "must be one of", None),
]
IDS = [f"{mistake}: {option}={value}" for mistake, option, value, *_ in MISTAKES]


def one_error_line(code: int, captured: pytest.CaptureResult) -> str:
    """The error line, after checking exit status 2, one line on stderr, no traceback and its length."""
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert len(lines[0]) <= 200, lines[0]
    return lines[0]


def run_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code)


# ------------------------------------------------------------------------------------------------ lightning-dp fit
def fit_config(tmp_path: Path, **init_args: object) -> str:
    """configs/digits_cnn.yaml with ``init_args`` changed, written as ``bad.yaml`` in the current folder."""
    config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
    config["trainer"].update(default_root_dir=str(tmp_path), callbacks=[])
    config["trainer"]["strategy"]["init_args"].update(init_args)
    Path("bad.yaml").write_text(yaml.safe_dump(config))
    return "bad.yaml"


@pytest.mark.parametrize(("mistake", "option", "value", "reason", "hf_reason"), MISTAKES, ids=IDS)
def test_fit_yaml_names_the_file_the_key_and_the_reason(
    mistake, option, value, reason, hf_reason, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    code = run_main(["fit", "--config", fit_config(tmp_path, **{option: value})])
    line = one_error_line(code, capsys.readouterr())
    assert line.startswith(f"lightning-dp fit: error: bad.yaml: trainer.strategy.init_args.{option}: {reason}")


def test_fit_yaml_with_a_removed_option_says_to_delete_it(tmp_path, capsys, monkeypatch):
    """A config saved before an option was removed (LightningCLI writes every default) fails on that key alone."""
    monkeypatch.chdir(tmp_path)
    code = run_main(["fit", "--config", fit_config(tmp_path, bookkeeping=True)])
    line = one_error_line(code, capsys.readouterr())
    assert line.startswith(
        "lightning-dp fit: error: bad.yaml: trainer.strategy.init_args.bookkeeping: option removed (the clipped sum is "
        "always formed by book-keeping"
    )
    with pytest.raises(ValueError, match=r"^option 'bookkeeping' was removed \(the clipped sum .*: delete it$"):
        DPStrategy(noise_multiplier=1.0, bookkeeping=True)


@pytest.mark.parametrize(("mistake", "option", "value", "reason", "hf_reason"), MISTAKES, ids=IDS)
def test_fit_flag_names_the_flag_and_the_reason(
    mistake, option, value, reason, hf_reason, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    flag = f"--trainer.strategy.init_args.{option}"
    code = run_main(["fit", "--config", fit_config(tmp_path), f"{flag}={value}"])
    line = one_error_line(code, capsys.readouterr())
    assert line.startswith(f"lightning-dp fit: error: {flag}: {reason}")


def test_fit_reports_the_flag_as_typed_and_a_combination_without_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = run_main(["fit", "--config", fit_config(tmp_path), "--trainer.strategy.max_grad_norm=-1"])  # no init_args
    assert one_error_line(code, capsys.readouterr()).startswith(
        "lightning-dp fit: error: --trainer.strategy.max_grad_norm: must be a positive"
    )
    code = run_main(["fit", "--config", fit_config(tmp_path), "--trainer.strategy.init_args.noise_multiplier=1"])
    line = capsys.readouterr().err.strip()
    assert code == 2 and line.startswith("lightning-dp fit: error: trainer.strategy.init_args: Give exactly one of")


def test_fit_options_outside_the_strategy_are_one_line_too(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
    config["trainer"]["max_epoch"] = 3
    Path("bad.yaml").write_text(yaml.safe_dump(config))
    line = one_error_line(run_main(["fit", "--config", "bad.yaml"]), capsys.readouterr())
    assert line == "lightning-dp fit: error: bad.yaml: trainer.max_epoch: unknown option; did you mean 'max_epochs'?"
    code = run_main(["fit", "--config", fit_config(tmp_path), "--trainer.max_epochs=foo"])
    line = one_error_line(code, capsys.readouterr())
    assert line == "lightning-dp fit: error: --trainer.max_epochs: expected int or None, got foo"
    callback = ["--trainer.callbacks+=lightning_dp.PrivacyBudget", "--trainer.callbacks.init_args.target_epsilonn=1"]
    code = run_main(["fit", "--config", fit_config(tmp_path), *callback])
    line = one_error_line(code, capsys.readouterr())
    assert line == (
        "lightning-dp fit: error: --trainer.callbacks.init_args.target_epsilonn: unknown option; did you mean "
        "'target_epsilon'?"
    )


def test_fit_in_a_fresh_process_prints_only_the_line(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
    config["trainer"]["strategy"]["init_args"]["max_grad_nrom"] = 2.0
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dp.cli", "fit", "--config", "fit.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "lightning-dp fit: error: fit.yaml: trainer.strategy.init_args.max_grad_nrom: unknown option; did you mean "
        "'max_grad_norm'?\n"
    )


# ------------------------------------------------------------------------------------------------ recipes
def run_recipe(argv: list[str], monkeypatch) -> int:
    from lightning_dp.recipes import glue
    from lightning_dp.recipes.run import script_main

    monkeypatch.setattr(sys, "argv", ["recipes/glue.py", *argv])
    return script_main(lambda: glue.main(argv))


def recipe_config(**changes: object) -> str:
    config = {**yaml.safe_load((ROOT / "configs" / "glue_offline.yaml").read_text()), **changes}
    Path("bad.yaml").write_text(yaml.safe_dump(config))
    return "bad.yaml"


def hf_name(option: str) -> str:
    """The recipes' name of an option (``per_sample_max_grad_norm`` for ``max_grad_norm``, and its misspelling)."""
    return f"per_sample_{option}" if option.startswith("max_grad_") else option


@pytest.mark.parametrize(("mistake", "option", "value", "reason", "hf_reason"), MISTAKES, ids=IDS)
def test_recipe_yaml_names_the_file_the_key_and_the_reason(
    mistake, option, value, reason, hf_reason, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    key = hf_name(option)
    code = run_recipe(["--config", recipe_config(**{key: value})], monkeypatch)
    line = one_error_line(code, capsys.readouterr())
    reason = (hf_reason or reason).replace("'max_grad_norm'", "'per_sample_max_grad_norm'")
    assert line.startswith(f"recipes/glue.py: error: bad.yaml: {key}: {reason}")


@pytest.mark.parametrize(("mistake", "option", "value", "reason", "hf_reason"), MISTAKES, ids=IDS)
def test_recipe_flag_names_the_flag_and_the_reason(
    mistake, option, value, reason, hf_reason, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    flag = f"--{hf_name(option)}"
    code = run_recipe(["--config", recipe_config(), flag, str(value)], monkeypatch)
    line = one_error_line(code, capsys.readouterr())
    reason = (hf_reason or reason).replace("'max_grad_norm'", "'--per_sample_max_grad_norm'")
    assert line.startswith(f"recipes/glue.py: error: {flag}: {reason}")


# ------------------------------------------------------------------------------------------------ the parts
def test_privacy_config_errors_name_their_option_and_keep_their_message():
    with pytest.raises(ValueError, match="max_grad_norm must be a positive") as caught:
        PrivacyConfig(max_grad_norm=-1.0, noise_multiplier=1.0)
    assert type(caught.value) is ValueError and invalid_option(caught.value) == "max_grad_norm"
    assert option_reason("max_grad_norm", caught.value).startswith("must be a positive")
    with pytest.raises(ValueError, match="Unknown noise") as caught:
        PrivacyConfig(noise="gausian", target_epsilon=3.0)
    assert invalid_option(caught.value) == "noise"
    with pytest.raises(ValueError, match="exactly one") as caught:  # a combination: no one option
        PrivacyConfig(noise_multiplier=1.0, target_epsilon=3.0)
    assert invalid_option(caught.value) is None
    with pytest.raises(ValueError) as caught, checking("outer"), checking("inner"):
        raise ValueError("bad")
    assert invalid_option(caught.value) == "inner"


def test_locate_prefers_the_flag_then_the_last_file_holding_the_key(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("trainer:\n  strategy:\n    init_args:\n      noise: x\n")
    second.write_text("trainer:\n  strategy:\n    noise: y\n")  # init_args left out, as jsonargparse allows
    key = "trainer.strategy.init_args.noise"
    assert locate(key, ["--config", str(first), f"--config={second}"]) == f"{second}: {key}"
    assert locate(key, ["--config", str(first), "--config", str(tmp_path / "absent.yaml")]) == f"{first}: {key}"
    assert locate(key, ["--config", str(first), "--trainer.strategy.noise", "z"]) == "--trainer.strategy.noise"
    assert locate("per_sample_max_grad_norm", ["--per-sample-max-grad-norm=1"]) == "--per-sample-max-grad-norm"
    assert locate(key, []) == key
    assert str(ConfigError(key, "bad", [f"--config={first}"])) == f"{first}: {key}: bad"


def test_unknown_option_suggests_only_a_close_name():
    assert unknown_option("max_grad_nrom", ["max_grad_norm", "noise"]) == (
        "unknown option; did you mean 'max_grad_norm'?"
    )
    assert unknown_option("frobnicate", ["max_grad_norm", "noise"]) == "unknown option"


def test_read_error_of_other_messages_keeps_them_whole():
    read = read_error("the following arguments are required: fit.data,\n  fit.model")
    assert read.key == "" and read.reason == "the following arguments are required: fit.data, fit.model"
    group = read_error("Group 'trainer' does not accept option 'max_epoch'")
    assert group.key == "trainer.max_epoch" and group.unknown


def test_privacy_options_given_as_a_class_are_left_to_its_construction():
    from jsonargparse import Namespace

    mechanism = Namespace(class_path="lightning_dp.mechanisms.GaussianMechanism", init_args=Namespace())
    strategy = Namespace(class_path="lightning_dp.DPStrategy", init_args=Namespace(noise=mechanism))
    check_privacy_options(Namespace(trainer=Namespace(strategy=strategy)))  # no error: built later
    strategy.init_args = Namespace(noise="gausian", target_epsilon=3.0)
    with pytest.raises(ConfigError, match="^trainer.strategy.init_args.noise: Unknown noise"):
        check_privacy_options(Namespace(trainer=Namespace(strategy=strategy)))


# ---------------------------------------------------------------------------------- the user's names, per entry point
def test_naming_renames_names_and_writes_settings_in_the_entry_points_syntax():
    flags = Naming.of_flags(["--max-grad-norm", "--accountant", "--noise", "--delta"], {"target_delta": "delta"})
    assert flags.message("max_grad_norm must be positive") == "--max-grad-norm must be positive"
    assert flags.message("calibrate with accountant='rdp' (cheap)") == "calibrate with --accountant rdp (cheap)"
    assert flags.message("target_delta must lie in (0, 1)") == "--delta must lie in (0, 1)"
    # a one-word name alone is an English word; a call's keyword and a dotted path keep the callee's name
    assert flags.message("such little noise, and noise='laplace'") == "such little noise, and --noise laplace"
    assert flags.message("use DPStrategy(max_grad_norm=1) or args.max_grad_norm") == (
        "use DPStrategy(max_grad_norm=1) or args.max_grad_norm"
    )
    python = Naming({"max_grad_norm": "per_sample_max_grad_norm", "seed": "dp_seed"})
    assert python.message("max_grad_norm=[0.5, 0.5] is a list, seed=3") == (
        "per_sample_max_grad_norm=[0.5, 0.5] is a list, dp_seed=3"
    )
    assert python.message("a seed, max_grad_norms, TrainingArguments.max_grad_norm") == (
        "a seed, max_grad_norms, TrainingArguments.max_grad_norm"
    )


def test_naming_keeps_the_errors_type_and_mark():
    with pytest.raises(ValueError) as raised, Naming({"max_grad_norm": "bound"}).applied(), checking("max_grad_norm"):
        raise ValueError("max_grad_norm must be positive")
    assert str(raised.value) == "bound must be positive" and invalid_option(raised.value) == "max_grad_norm"


#: (PrivacyConfig arguments, what PrivacyConfig's error starts with, PrivacyArguments' HF names of the arguments,
#: what its error starts with): each names the argument the user gave, with a typical value where one helps.
USER_NAMES = [
    (
        {"max_grad_norm": -1.0, "noise_multiplier": 1.0},
        "max_grad_norm must be a positive finite number, got -1.0; e.g. 1.0",
        {"per_sample_max_grad_norm": -1.0, "noise_multiplier": 1.0},
        "per_sample_max_grad_norm must be a positive finite number, got -1.0; e.g. 1.0",
    ),
    (
        {"target_epsilon": 0.0},
        "target_epsilon must be positive, got 0.0; a typical budget is 1 to 10",
        {"target_epsilon": 0.0},
        "target_epsilon must be positive, got 0.0; a typical budget is 1 to 10",
    ),
    (
        {"target_epsilon": 3.0, "target_delta": 2.0},
        "target_delta must lie in (0, 1), got 2.0; a typical choice is below 1/N",
        {"target_epsilon": 3.0, "target_delta": 2.0},
        "target_delta must lie in (0, 1), got 2.0; a typical choice is below 1/N",
    ),
    (
        {"noise_multiplier": 1.0, "seed": 3, "secure_mode": True},
        "secure_mode=True draws every noise sample from the OS CSPRNG, so seed=3 cannot apply",
        {"noise_multiplier": 1.0, "dp_seed": 3, "secure_mode": True},
        "secure_mode=True draws every noise sample from the OS CSPRNG, so dp_seed=3 cannot apply",
    ),
    (
        {"max_grad_norm": [0.5, 0.5], "noise_multiplier": 1.0},
        "max_grad_norm=[0.5, 0.5] is a list (one bound per group), but clipping_groups is not set",
        {"per_sample_max_grad_norm": [0.5, 0.5], "noise_multiplier": 1.0},
        "per_sample_max_grad_norm=[0.5, 0.5] is a list (one bound per group), but clipping_groups is not set",
    ),
]


@pytest.mark.parametrize(("config", "config_error", "hf", "hf_error"), USER_NAMES)
def test_privacy_config_and_privacy_arguments_name_the_argument_the_user_gave(config, config_error, hf, hf_error):
    from lightning_dp.hf import PrivacyArguments

    with pytest.raises(ValueError) as raised:
        PrivacyConfig(**config)
    assert str(raised.value).startswith(config_error), raised.value
    with pytest.raises(ValueError) as raised:
        PrivacyArguments(**hf)
    assert str(raised.value).startswith(hf_error), raised.value


# ------------------------------------------------------------------------------------------------- class paths
@pytest.mark.parametrize(
    ("path", "typo", "key", "suggestion"),
    [
        (("trainer", "strategy"), "lightning_dp.DPStrateg", "trainer.strategy.class_path", "lightning_dp.DPStrategy"),
        (("model",), "lightning_dp.tasks.digits.DigitCNN", "model.class_path", "lightning_dp.tasks.digits.DigitsCNN"),
        (
            ("data",),
            "lightning_dp.tasks.digit.DigitsDataModule",
            "data.class_path",
            "lightning_dp.tasks.digits.DigitsDataModule",
        ),
        (("trainer", "callbacks", 0), "lightning_dp.PrivacyAcountantCallback", "trainer.callbacks", None),
    ],
    ids=["strategy", "model", "module of data", "item of callbacks"],
)
def test_fit_yaml_misspelt_class_path_is_reported_under_its_key_with_the_closest_class(
    path, typo, key, suggestion, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
    holder = config
    for part in path:
        holder = holder[part]
    suggestion = suggestion or holder["class_path"]
    holder["class_path"] = typo
    Path("bad.yaml").write_text(yaml.safe_dump(config))
    line = one_error_line(run_main(["fit", "--config", "bad.yaml"]), capsys.readouterr())
    assert line == f"lightning-dp fit: error: bad.yaml: {key}: cannot import {typo!r}; did you mean {suggestion!r}?"


def test_fit_flag_misspelt_class_path_is_reported_under_the_flag(capsys):
    config = str(ROOT / "configs" / "digits_cnn.yaml")
    line = one_error_line(
        run_main(["fit", "--config", config, "--model", "lightning_dp.tasks.digits.DigitCNN"]), capsys.readouterr()
    )
    assert line == (
        "lightning-dp fit: error: --model: cannot import 'lightning_dp.tasks.digits.DigitCNN'; did you mean "
        "'lightning_dp.tasks.digits.DigitsCNN'?"
    )


def test_close_class_path_keeps_to_the_option_s_type():
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import Strategy

    assert close_class_path("lightning_dp.DPStrateg", [Strategy]) == "lightning_dp.DPStrategy"
    assert close_class_path("lightning_dp.DPStrateg", [Callback]) is None  # no callback is named close to it
    assert close_class_path("lightning_dp.Frobnicate", [Strategy]) is None
    # no module of the path imports: the closest of the type's subclasses imported so far, by full path
    assert close_class_path("lightning_dpp.lightning.strategy.DPStrategy", [Strategy]) == (
        "lightning_dp.lightning.strategy.DPStrategy"
    )
