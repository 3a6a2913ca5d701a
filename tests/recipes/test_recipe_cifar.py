"""The CIFAR-10 recipe (Lightning): the real entry points on a few images of the test subset, the accuracy on
hand-made predictions, bad input (missing data: one line), the ViT option, the hub config, and (slow) the docs
configuration unchanged on the full local copy."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from recipe_helpers import (
    CIFAR_CONFIG,
    CIFAR_RESULT_KEYS,
    FULL_DATA,
    ROOT,
    TEST_DATA,
    cifar_tiny_flags,
    needs_full_data,
    read_cifar_results,
    script_env,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.recipes.cifar import (
    VARIANTS,
    CifarClassifier,
    CifarDataModule,
    ViTClassifier,
    WideResNetClassifier,
    cli_arguments,
    main,
    variant_flags,
)
from lightning_dp.recipes.cifar_data import TEST_FILE, TRAIN_FILE, standardise
from lightning_dp.recipes.wide_resnet import WideResNet

HUB_CONFIG = ROOT / "configs" / "cifar10_hub.yaml"
FULL_FILES = (f"cifar10/{TRAIN_FILE}", f"cifar10/{TEST_FILE}")


# ------------------------------------------------------------------------------------------------- entry points
def test_script_smoke(tmp_path: Path) -> None:
    """``python recipes/cifar.py --config configs/cifar10_offline.yaml --data_dir=ROOT``: DP by default, a finite
    epsilon within budget; the start-up block once, and a progress line at the last step."""
    flags = cifar_tiny_flags(tmp_path, data_flag="--data_dir")
    command = [sys.executable, str(ROOT / "recipes" / "cifar.py"), "--config", str(CIFAR_CONFIG), *flags]
    done = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("DP training start-up:") == 1 and "step 2/2: loss " in done.stderr, done.stderr
    result = read_cifar_results(tmp_path)
    assert result["dp"] is True and result["expected_batch"] == 16 and result["world_size"] == 1
    privacy = result["privacy"]
    assert privacy["noise"] == "gaussian" and "num_params" not in privacy
    assert math.isfinite(privacy["epsilon"]) and 0 < privacy["epsilon"] <= 3.0 + 1e-6
    assert result["command"].startswith("python ") and "cifar.py --config" in result["command"]
    assert result["arguments"]["model"]["class_path"].endswith("WideResNetClassifier")


def test_lightning_dp_fit_runs_the_same(tmp_path: Path) -> None:
    """``lightning-dp fit`` with the same config and flags gives the same run as the recipe's ``main``."""
    from lightning_dp.cli.main import main as cli_main

    runs = []
    for name, entry in (("fit", lambda a: cli_main(["fit", *a])), ("recipe", main)):
        out = tmp_path / name
        assert entry(["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(out)]) == 0
        runs.append(read_cifar_results(out))
    fit, recipe = runs
    assert fit["metrics"] == recipe["metrics"]
    assert fit["privacy"] == recipe["privacy"]


def test_same_seed_same_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs config twice in one process, the global generator moved on between the runs: the recipe seeds
    everything it draws from (``seed_everything`` and the DP strategy's seed) before building the model, so the two
    runs train the same parameters bit for bit and report the same numbers."""
    import lightning.pytorch as pl

    models = []
    fit = pl.Trainer.fit

    def recorded_fit(trainer, model, *args, **kwargs):
        models.append(model)
        return fit(trainer, model, *args, **kwargs)

    monkeypatch.setattr(pl.Trainer, "fit", recorded_fit)
    results = []
    for name in ("first", "second"):
        torch.rand(7)  # whatever ran before: the recipe must not depend on it
        assert main(["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(tmp_path / name)]) == 0
        results.append(read_cifar_results(tmp_path / name))
    assert results[0]["metrics"] == results[1]["metrics"] and results[0]["privacy"] == results[1]["privacy"]
    first, second = (dict(model.named_parameters()) for model in models)
    assert first.keys() == second.keys()
    for name, parameter in first.items():
        assert torch.equal(parameter, second[name]), name


@pytest.mark.parametrize("variant", ["non-private", "lap2-eps8"])
def test_variant_flags(tmp_path: Path, variant: str) -> None:
    """The flags of bench/recipes.py's documented runs: no DP at all, or the named mechanism and budget."""
    flags = variant_flags(variant, str(tmp_path / "variant.json"))
    assert main(["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(tmp_path), *flags]) == 0
    result = json.loads((tmp_path / "variant.json").read_text())
    assert set(result) == CIFAR_RESULT_KEYS
    if variant == "non-private":
        assert result["dp"] is False and result["privacy"] is None
    else:
        assert result["privacy"]["noise"] == "lap2" and 0 < result["privacy"]["epsilon"] <= 8.0 + 1e-6


def test_variant_flags_names() -> None:
    assert set(VARIANTS) == {"non-private", "gaussian-eps1", "gaussian-eps3", "gaussian-eps8", "lap2-eps3", "lap2-eps8"}
    with pytest.raises(ValueError, match="unknown variant 'laplace-eps3'"):
        variant_flags("laplace-eps3", "x.json")


# ------------------------------------------------------------------------------------------------------ metric
class _Lookup(nn.Module):
    """Logits that predict the class written in each image's first pixel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(x[:, 0, 0, 0].long(), 10).float()


def test_accuracy_on_hand_made_predictions() -> None:
    model = CifarClassifier(lr=1.0)
    model.net = _Lookup()
    x = torch.zeros(4, 3, 32, 32)
    x[:, 0, 0, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0])  # predictions 0, 1, 2, 3
    loader = DataLoader(TensorDataset(x, torch.tensor([0, 1, 2, 0])), batch_size=3)
    assert model.accuracy(loader) == {"accuracy": pytest.approx(75.0)}
    assert model.training  # the training mode is restored


# --------------------------------------------------------------------------------------------------- bad input
def test_unknown_data_source_is_one_error_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["--config", str(CIFAR_CONFIG), "--data.init_args.data_source=ftp"]) == 2
    assert "data_source must be 'local' or 'hub', got 'ftp'" in capsys.readouterr().err


def test_missing_local_data(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist.*--data.data_dir.*configs/cifar10_hub.yaml"):
        CifarDataModule(data_dir=str(tmp_path / "nowhere")).setup("fit")
    module = CifarDataModule(data_dir=str(tmp_path))  # the folder exists, its files do not
    with pytest.raises(FileNotFoundError, match="no local copy of cifar10 .*cifar10_train_5k_subset_from_jpg.npz"):
        module.setup("fit")


def test_missing_local_data_is_one_error_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("LIGHTNING_DP_DATA", raising=False)
    flags = [f"--trainer.default_root_dir={tmp_path}", f"--trainer.callbacks.init_args.path={tmp_path / 'r.json'}"]
    assert main(["--config", str(CIFAR_CONFIG), *flags]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("lightning-dp fit: error: no local data for cifar10: ")
    assert "--data_dir ROOT" in line and "LIGHTNING_DP_DATA=ROOT" in line and "configs/cifar10_hub.yaml" in line


def test_data_dir_flag_of_every_recipe() -> None:
    """``recipes/cifar.py --data_dir ROOT`` (as every recipe) is the LightningCLI's ``--data.init_args.data_dir``."""
    assert cli_arguments(["--config", "c.yaml", "--data_dir", "/d", "--data_dir=/e", "--trainer.max_steps=2"]) == [
        "--config",
        "c.yaml",
        "--data.init_args.data_dir=/d",
        "--data.init_args.data_dir=/e",
        "--trainer.max_steps=2",
    ]
    assert cli_arguments(["--data_dir"]) == ["--data_dir"]  # no value: left for LightningCLI to report


def test_more_examples_than_the_data_has() -> None:
    with pytest.raises(ValueError, match="the train split has 200 examples, fewer than the 300 asked for"):
        CifarDataModule(data_dir=str(TEST_DATA), train_size=300).setup("fit")


def test_images_of_another_size_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"shape \[N, 32, 32, 3\].*got \[2, 28, 28, 3\]"):
        standardise(np.zeros((2, 28, 28, 3), dtype=np.uint8))


def test_vit_image_size_must_split_into_patches() -> None:
    with pytest.raises(ValueError, match="image_size 30 is not a positive multiple of patch_size 4"):
        ViTClassifier(tiny=True, image_size=30, patch_size=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"depth": 12}, "depth must be 6n \\+ 4"),
        ({"groups": 3}, "groups must divide 16"),
        ({"norm": "layer"}, "norm must be one of group, batch"),
    ],
)
def test_wide_resnet_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WideResNet(**kwargs)


def test_batchnorm_is_rejected_under_dp(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(tmp_path), "--model.init_args.norm=batch"]) == 2
    assert "mixes samples through batch statistics" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- models
def test_wide_resnet_16_4_shape_and_size() -> None:
    """WRN-16-4: 2.75M parameters (De et al.'s layout, plain convolutions), logits [B, 10]."""
    model = WideResNet(depth=16, width=4)
    assert sum(p.numel() for p in model.parameters()) == 2_751_562
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert all(m.num_groups == 16 for m in model.modules() if isinstance(m, nn.GroupNorm))
    assert WideResNet(depth=10, width=1)(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_vit_option_runs_on_a_tiny_config(tmp_path: Path) -> None:
    vit = ["--model=lightning_dp.recipes.cifar.ViTClassifier", "--model.init_args.tiny=true"]
    assert main(["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(tmp_path), *vit]) == 0
    result = read_cifar_results(tmp_path)
    assert result["arguments"]["model"]["class_path"].endswith("ViTClassifier")
    assert math.isfinite(result["privacy"]["epsilon"])


def test_weight_standardised_wide_resnet_trains_under_dp(tmp_path: Path) -> None:
    """``--model.init_args.weight_standardisation=true`` (the hub config's, De et al.'s WSConv2D): every convolution
    standardised, trained under DPStrategy with its ``gain`` parameters clipped and noised like the rest."""
    flags = [*cifar_tiny_flags(tmp_path), "--model.init_args.weight_standardisation=true"]
    assert main(["--config", str(CIFAR_CONFIG), *flags]) == 0
    result = read_cifar_results(tmp_path)
    assert result["arguments"]["model"]["init_args"]["weight_standardisation"] is True
    plain = WideResNet(depth=10, width=1)
    gains = sum(m.out_channels for m in plain.modules() if isinstance(m, nn.Conv2d))
    assert result["trainable_params"] == sum(p.numel() for p in plain.parameters()) + gains
    assert math.isfinite(result["privacy"]["epsilon"])


def test_ema_of_the_hub_config_runs_under_dp(tmp_path: Path) -> None:
    """The hub config's EMAWeightAveraging (De et al.'s parameter averaging) trains under DPStrategy; the results
    are those of the averaged weights, evaluated after the callback copies them into the model."""
    ema = ["--trainer.callbacks+=lightning.pytorch.callbacks.EMAWeightAveraging", "--trainer.callbacks.decay=0.5"]
    assert main(["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(tmp_path), *ema]) == 0
    assert math.isfinite(read_cifar_results(tmp_path)["privacy"]["epsilon"])


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_hub_config_parses() -> None:
    """The full-scale config builds its WRN-16-4, Hub data module and DP strategy (nothing is loaded or run)."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    from lightning_dp import DPStrategy

    cli = LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(HUB_CONFIG), "--trainer.accelerator=cpu"],
    )
    assert isinstance(cli.model, WideResNetClassifier)
    assert (cli.model.hparams.depth, cli.model.hparams.width, cli.model.hparams.groups) == (16, 4, 16)
    assert cli.datamodule.hparams.data_source == "hub" and cli.datamodule.hparams.hub_dataset == "uoft-cs/cifar10"
    assert cli.datamodule.hparams.batch_size * cli.trainer.accumulate_grad_batches == 4096
    assert isinstance(cli.trainer.strategy, DPStrategy)
    # De et al.'s augmentation multiplicity, the same K for the model's copies and the strategy's clipper
    assert cli.model.augmentation_multiplicity == 16
    assert cli.trainer.strategy.privacy_engine.config.augmentation_multiplicity == 16
    # and their scaled weight standardisation on every convolution
    from lightning_dp import WSConv2d

    convolutions = [m for m in cli.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert cli.model.hparams.weight_standardisation and all(isinstance(m, WSConv2d) for m in convolutions)


# ------------------------------------------------------------------------------------------------------- slow
@pytest.mark.slow
@needs_full_data(*FULL_FILES)
def test_docs_config(tmp_path: Path) -> None:
    """configs/cifar10_offline.yaml unchanged (only the data root and the output paths): DP at epsilon <= 3, above
    chance accuracy."""
    flags = [f"--data_dir={FULL_DATA}", f"--trainer.default_root_dir={tmp_path}"]
    flags.append(f"--trainer.callbacks.init_args.path={tmp_path / 'r.json'}")
    assert main(["--config", str(CIFAR_CONFIG), *flags]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["privacy"]["epsilon"] <= 3.0 + 1e-6
    assert result["metrics"]["accuracy"] > 15.0  # chance is 10%


def test_help_names_the_data_flag_and_variable(capsys: pytest.CaptureFixture) -> None:
    """LightningCLI's help lists ``--data.init_args.data_dir``; the recipe's own ``--help`` names ``--data_dir`` and
    ``LIGHTNING_DP_DATA`` first."""
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("recipes/cifar.py:") and "--data_dir ROOT" in out and "LIGHTNING_DP_DATA" in out
