"""The DP strategies by name in Lightning's StrategyRegistry: ``Trainer(strategy="dp")`` / ``"dp_ddp"`` /
``"dp_fsdp"`` (the class defaults with target_epsilon 3, logged), the budget names ``"dp_epsilon_3"`` /
``"dp_epsilon_8"``, and LightningCLI's ``--trainer.strategy``."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import make_trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

from lightning_dp import DPDDPStrategy, DPModelParallelStrategy, DPStrategy, PrivacyAccountantCallback
from lightning_dp.cli.main import main
from lightning_dp.lightning.registry import DEFAULT_EPSILON, REGISTERED_EPSILONS
from lightning_dp.tasks.digits import DigitsCNN, DigitsDataModule

ROOT = Path(__file__).resolve().parents[2]
NAMES = {
    "dp": (DPStrategy, {"target_epsilon": 3.0}),
    "dp_epsilon_3": (DPStrategy, {"target_epsilon": 3.0}),
    "dp_epsilon_8": (DPStrategy, {"target_epsilon": 8.0}),
    "dp_ddp": (DPDDPStrategy, {"target_epsilon": 3.0}),
    "dp_ddp_epsilon_3": (DPDDPStrategy, {"target_epsilon": 3.0}),
    "dp_ddp_epsilon_8": (DPDDPStrategy, {"target_epsilon": 8.0}),
    "dp_fsdp": (DPModelParallelStrategy, {"target_epsilon": 3.0}),
    "dp_fsdp_epsilon_3": (DPModelParallelStrategy, {"target_epsilon": 3.0}),
    "dp_fsdp_epsilon_8": (DPModelParallelStrategy, {"target_epsilon": 8.0}),
}


#: Lightning imported before ``lightning_dp``, and after it (``import lightning_dp`` does not import Lightning: the
#: names are registered when Lightning comes), also after an availability check that finds Lightning without loading
#: it.
IMPORT_ORDERS = {
    "lightning first": "from lightning.pytorch.strategies import StrategyRegistry as R\nassert 'dp' not in R\n"
    "import lightning_dp",
    "lightning_dp first": "import lightning_dp, sys\nassert 'lightning' not in sys.modules\n"
    "from lightning.pytorch.strategies import StrategyRegistry as R",
    "lightning_dp first, lightning looked up before": "import importlib.util, lightning_dp, sys\n"
    "assert importlib.util.find_spec('lightning') and 'lightning' not in sys.modules\n"
    "from lightning.pytorch.strategies import StrategyRegistry as R",
}


@pytest.mark.parametrize("order", IMPORT_ORDERS)
def test_importing_lightning_dp_registers_the_names(order):
    code = (
        f"{IMPORT_ORDERS[order]}\nimport lightning as L\n"
        "print(sorted(n for n, e in R.items() if e['strategy'].__module__.startswith('lightning_dp')))\n"
        "print(type(L.Trainer(strategy='dp', accelerator='cpu', logger=False).strategy).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == str(sorted(NAMES)) and lines[-1] == "DPStrategy"
    assert REGISTERED_EPSILONS == (3.0, 8.0) and DEFAULT_EPSILON == 3.0
    for name, (strategy, init_params) in NAMES.items():
        assert StrategyRegistry[name]["strategy"] is strategy and StrategyRegistry[name]["init_params"] == init_params
    # Lightning's own names keep their classes (DDPStrategy.register_strategies is not inherited as is)
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy
    assert StrategyRegistry["single_device"]["strategy"] is SingleDeviceStrategy


@pytest.mark.parametrize("strategy", [DPStrategy, DPDDPStrategy, DPModelParallelStrategy])
def test_direct_construction_without_privacy_level_fails(strategy):
    with pytest.raises(ValueError, match="Give exactly one of target_epsilon"):
        strategy()


def test_trainer_strategy_dp_trains_digits_privately_at_epsilon_3(caplog):
    caplog.set_level(logging.INFO, logger="lightning_dp")
    torch.manual_seed(0)
    model = DigitsCNN()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    callback = PrivacyAccountantCallback(plot=False)
    trainer = make_trainer("dp", max_epochs=1, limit_val_batches=0, callbacks=[callback])
    strategy = trainer.strategy
    assert type(strategy) is DPStrategy and strategy.root_device == torch.device("cpu")
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=128))
    engine = strategy.privacy_engine
    assert engine.target_epsilon == 3.0 and engine.max_grad_norm == 1.0 and engine.clipping == "mixed"
    assert engine.steps == trainer.global_step > 0
    assert 0.0 < engine.epsilon() <= 3.0 + 1e-9 and callback.summary["epsilon"] == engine.epsilon()
    assert engine.mechanism.name == "gaussian" and engine.mechanism.noise_multiplier > 0.5  # calibrated noise
    assert callback.summary["accountant"] == "pld" and callback.summary["noise_multiplier"] > 0.5
    assert all(not torch.equal(v, initial[k]) for k, v in model.state_dict().items())
    assert "gaussian (noise_multiplier=" in caplog.text and "calibrated for epsilon=3 over" in caplog.text
    assert "target_delta = 1/N^1.1" in caplog.text  # the defaults, in the start-up block


@pytest.mark.parametrize("epsilon", REGISTERED_EPSILONS)
def test_budget_names_are_the_class_defaults_with_target_epsilon(epsilon):
    engine = make_trainer(f"dp_epsilon_{epsilon:g}").strategy.privacy_engine
    default = DPStrategy(target_epsilon=epsilon).privacy_engine
    for attribute in ("target_epsilon", "target_delta", "max_grad_norm", "noise", "clipping", "accountant_name"):
        assert getattr(engine, attribute) == getattr(default, attribute)
    assert engine.target_epsilon == epsilon and engine.target_delta is None  # 1/N^1.1, logged at fit
    assert (engine.max_grad_norm, engine.noise, engine.clipping) == (1.0, "gaussian", "mixed")  # auto, for l2
    again = make_trainer(f"dp_epsilon_{epsilon:g}").strategy.privacy_engine
    assert engine.randomness.base_seed != again.randomness.base_seed  # seed=None: OS entropy, as real runs should


def test_dp_ddp_names_resolve_to_dp_ddp_strategy():
    trainer = make_trainer("dp_ddp", devices=2)
    strategy = trainer.strategy
    assert type(strategy) is DPDDPStrategy and strategy.privacy_engine.target_epsilon == 3.0
    assert strategy.parallel_devices == [torch.device("cpu")] * 2 and strategy._start_method == "popen"
    for name, epsilon in (("dp_ddp_epsilon_3", 3.0), ("dp_ddp_epsilon_8", 8.0)):
        strategy = make_trainer(name, devices=2).strategy
        assert type(strategy) is DPDDPStrategy and strategy.privacy_engine.target_epsilon == epsilon


def test_dp_fsdp_names_resolve_to_dp_model_parallel_strategy():
    """Trained by name in tests/adapters/test_fsdp_lightning.py; here: the class, the budget, data parallelism only."""
    for name, epsilon in (("dp_fsdp", 3.0), ("dp_fsdp_epsilon_3", 3.0), ("dp_fsdp_epsilon_8", 8.0)):
        strategy = make_trainer(name, devices=2).strategy
        assert type(strategy) is DPModelParallelStrategy and strategy.privacy_engine.target_epsilon == epsilon
        assert strategy.parallel_devices == [torch.device("cpu")] * 2 and strategy._tensor_parallel_size == 1


def test_dp_strategy_without_device_takes_the_trainers():
    strategy = DPStrategy(noise_multiplier=1.0)
    strategy.parallel_devices = [torch.device("cuda", 1)]  # what the Trainer hands it for devices=[1] on GPUs
    assert strategy.root_device == torch.device("cuda", 1)
    fixed = DPStrategy(noise_multiplier=1.0, device="cpu")
    fixed.parallel_devices = [torch.device("cuda", 1)]
    assert fixed.root_device == torch.device("cpu")


def test_dp_strategy_on_cuda_without_an_index_takes_the_current_device(monkeypatch):
    """Lightning's CUDA accelerator selects the device by its index and refuses ``cuda`` alone."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert DPStrategy(noise_multiplier=1.0, device="cuda").root_device == torch.device("cuda", 1)
    assert DPStrategy(noise_multiplier=1.0, device=torch.device("cuda", 0)).root_device == torch.device("cuda", 0)


# ------------------------------------------------------------------------------------------- LightningCLI
def _digits_config(tmp_path: Path, strategy: object) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
    config["trainer"].update(
        max_epochs=1,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        strategy=strategy,
    )
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_cli_trainer_strategy_by_name(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning_dp")
    path = _digits_config(tmp_path, "dp_epsilon_3")  # the YAML form: trainer.strategy: dp_epsilon_3
    assert main(["fit", "--config", str(path)]) == 0
    assert "gaussian (noise_multiplier=" in caplog.text and "calibrated for epsilon=3 over" in caplog.text
    assert "Privacy summary: epsilon=2.9" in caplog.text and "clipping=mixed" in caplog.text


def test_cli_trainer_strategy_flag_dp_is_accepted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning_dp")
    path = _digits_config(tmp_path, {"class_path": "lightning_dp.DPStrategy", "init_args": {"target_epsilon": 8.0}})
    assert main(["fit", "--config", str(path), "--trainer.strategy", "dp"]) == 0  # the flag replaces the instance
    assert "gaussian (noise_multiplier=" in caplog.text and "calibrated for epsilon=3 over" in caplog.text
