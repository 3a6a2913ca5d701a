"""CIFAR-10 recipe through Lightning: the classifiers and the callback writing ``results.json``; the data module is in
:mod:`~lightning_dp.recipes.cifar_data` (and importable from here, where the configs name it).

10-class classification of 32x32 RGB images (Krizhevsky 2009) with :class:`WideResNetClassifier` (WRN-16-4 with
GroupNorm, De et al. 2022) or :class:`ViTClassifier`, optional augmentation multiplicity (De et al. 2022, Section
3.2); metric: test accuracy in percent. Data, configurations, commands and results: docs/recipes/cifar.md.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import SaveConfigCallback
from torch import nn
from torch.utils.data import DataLoader

from lightning_dp.augmentation import augmentation_mean, repeat_for_multiplicity
from lightning_dp.clipping.multiplicity import validate_multiplicity
from lightning_dp.recipes.cifar_data import NUM_CLASSES
from lightning_dp.recipes.cifar_data import CifarDataModule as CifarDataModule  # the configs name it here
from lightning_dp.recipes.image_augmentation import augmentation_generator, random_crop_flip
from lightning_dp.recipes.metrics import classification_metrics
from lightning_dp.recipes.run import results_record, write_results
from lightning_dp.recipes.wide_resnet import WideResNet
from lightning_dp.tasks.pretrained import TINY_SIZES

log = logging.getLogger("lightning_dp")

#: The documented runs of ``bench/recipes.py``: name -> (target epsilon, noise); ``None``: no DP.
VARIANTS: dict[str, tuple[float, str] | None] = {
    "non-private": None,
    "gaussian-eps1": (1.0, "gaussian"),
    "gaussian-eps3": (3.0, "gaussian"),
    "gaussian-eps8": (8.0, "gaussian"),
    "lap2-eps3": (3.0, "lap2"),
    "lap2-eps8": (8.0, "lap2"),
}
#: SGD of the non-private variant: DP-SGD's large learning rate multiplies a clipped, noised mean gradient, which is
#: far smaller than the raw mean gradient, so the non-private run takes a usual learning rate instead.
NON_PRIVATE_LR = 0.1
NON_PRIVATE_MOMENTUM = 0.9


class CifarClassifier(pl.LightningModule):
    """Shared training logic: cross-entropy per example, augmentation multiplicity, and SGD.

    Subclasses set ``self.net`` (``[B, 3, H, W] -> [B, 10]`` logits) or override :meth:`forward`. The training step
    returns the per-example loss ``[B]`` under a DP strategy (its mean otherwise); with ``K > 1`` it crops and flips
    each of the ``B K`` rows in train mode only and returns each example's mean over its copies
    (:func:`lightning_dp.augmentation_mean`). The draws come from
    :func:`~lightning_dp.recipes.image_augmentation.augmentation_generator` (the run's seed and the micro-batch's rank,
    epoch and index), so re-runs of a step see the same copies.

    Args:
        lr: SGD learning rate.
        momentum: SGD momentum (De et al. 2022: none).
        weight_decay: SGD weight decay (De et al. 2022: none).
        augmentation_multiplicity: ``K >= 1`` copies per example (De et al. 2022: 16); under a DP strategy it must
            equal the strategy's ``augmentation_multiplicity``.
        augment: crop and flip the training rows. ``None`` (default): iff ``K > 1``; ``True``: also at ``K = 1``
            (one augmented copy per example); ``False``: never, refused with ``K > 1``.

    Raises:
        ValueError: ``lr <= 0``, a negative ``momentum`` or ``weight_decay``, ``augmentation_multiplicity`` not an
            integer >= 1, ``augment=False`` with ``augmentation_multiplicity > 1`` (at construction); a DP strategy
            whose ``augmentation_multiplicity`` differs (at the start of fit).
    """

    def __init__(
        self,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        augmentation_multiplicity: int = 1,
        augment: bool | None = None,
    ) -> None:
        super().__init__()
        if lr <= 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"need lr > 0, momentum >= 0, weight_decay >= 0, got {lr}, {momentum}, {weight_decay}")
        validate_multiplicity(augmentation_multiplicity)
        if augment is False and augmentation_multiplicity > 1:
            raise ValueError(
                f"augment=False with augmentation_multiplicity={augmentation_multiplicity}: the "
                f"{augmentation_multiplicity} copies of an example would be identical (the gradient of one copy at "
                f"{augmentation_multiplicity} times the cost); set augmentation_multiplicity to 1, or augment to "
                "true or null"
            )
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.augmentation_multiplicity = augmentation_multiplicity
        #: Whether the training rows are cropped and flipped (``augment`` resolved: ``None`` -> ``K > 1``).
        self.augments = augmentation_multiplicity > 1 if augment is None else augment
        self._augmentation_seed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_fit_start(self) -> None:
        """Fix the augmentation seed (the run's: ``torch.initial_seed()``) and check that a DP strategy makes as
        many copies per example as the model."""
        self._augmentation_seed = torch.initial_seed()
        engine = getattr(self.trainer.strategy, "privacy_engine", None)
        strategy_copies = 1 if engine is None else engine.config.augmentation_multiplicity
        if engine is not None and strategy_copies != self.augmentation_multiplicity:
            raise ValueError(
                f"the model makes {self.augmentation_multiplicity} augmented copies per example but the DP strategy "
                f"expects augmentation_multiplicity={strategy_copies}: set both to the same K "
                "(model.init_args.augmentation_multiplicity and trainer.strategy.init_args.augmentation_multiplicity)"
            )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        copies = self.augmentation_multiplicity
        if copies > 1:
            x, y = repeat_for_multiplicity((x, y), copies)  # [B K, ...], rows i K .. i K + K - 1: example i's
        if self.augments and self.training:
            position = (self.global_rank, self.current_epoch, batch_idx)
            x = random_crop_flip(x, augmentation_generator(self._augmentation_seed, *position))
        rows = F.cross_entropy(self(x), y, reduction="none")  # [B K]
        loss = augmentation_mean(rows, copies)  # [B]: what per-sample clipping needs (rows itself for K = 1)
        dp = getattr(self.trainer.strategy, "privacy_engine", None) is not None
        return loss if dp else loss.mean()

    @torch.no_grad()
    def accuracy(self, loader: DataLoader) -> dict[str, float]:
        """``{"accuracy": percent}`` of the model in eval mode over ``loader`` (restores the training mode)."""
        was_training = self.training
        self.eval()
        predictions, labels = [], []
        for x, y in loader:
            predictions.append(self(x.to(self.device)).argmax(dim=1).cpu())
            labels.append(y)
        self.train(was_training)
        return classification_metrics(torch.cat(predictions).tolist(), torch.cat(labels).tolist(), NUM_CLASSES)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)


class WideResNetClassifier(CifarClassifier):
    """WRN-``depth``-``width`` with GroupNorm trained from scratch (De et al. 2022; layout and ``Raises``:
    :class:`~lightning_dp.recipes.wide_resnet.WideResNet`).

    Args:
        depth: ``6 n + 4`` (16 for WRN-16-4).
        width: channel multiplier (4 for WRN-16-4).
        groups: GroupNorm groups (16).
        norm: ``"group"``, or ``"batch"`` for non-private comparisons (DP strategies reject BatchNorm).
        lr, momentum, weight_decay, augmentation_multiplicity, augment: as :class:`CifarClassifier`.
        weight_standardisation: every convolution with scaled weight standardisation
            (:class:`~lightning_dp.weight_standardisation.WSConv2d`); default False.
    """

    def __init__(
        self,
        depth: int = 16,
        width: int = 4,
        groups: int = 16,
        norm: str = "group",
        lr: float = 4.0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        augmentation_multiplicity: int = 1,
        weight_standardisation: bool = False,
        augment: bool | None = None,
    ) -> None:
        super().__init__(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            augmentation_multiplicity=augmentation_multiplicity,
            augment=augment,
        )
        self.save_hyperparameters()
        self.net = WideResNet(
            depth=depth,
            width=width,
            num_classes=NUM_CLASSES,
            groups=groups,
            norm=norm,
            weight_standardisation=weight_standardisation,
        )


class ViTClassifier(CifarClassifier):
    """HF ``ViTForImageClassification`` with a 10-class head, fine-tuned from ``model_name_or_path`` or, with ``tiny``,
    a random small ViT. Inputs ``[B, 3, 32, 32]`` are resized (bilinear) to the model's ``image_size``; dropout is off
    (the per-sample terms of ViT's embeddings are exact only then).

    Args:
        model_name_or_path: a Hub id or folder of a ViT checkpoint (ignored with ``tiny``).
        tiny: build the random tiny ViT instead.
        image_size: input size of the tiny ViT.
        patch_size: patch size of the tiny ViT.
        lr, momentum, weight_decay, augmentation_multiplicity, augment: as :class:`CifarClassifier`.

    Raises:
        ValueError: ``image_size`` not a positive multiple of ``patch_size``.
    """

    def __init__(
        self,
        model_name_or_path: str = "google/vit-base-patch16-224-in21k",
        tiny: bool = False,
        image_size: int = 32,
        patch_size: int = 4,
        lr: float = 0.5,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        augmentation_multiplicity: int = 1,
        augment: bool | None = None,
    ) -> None:
        super().__init__(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            augmentation_multiplicity=augmentation_multiplicity,
            augment=augment,
        )
        from transformers import ViTConfig, ViTForImageClassification

        self.save_hyperparameters()
        no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        if tiny:
            if patch_size <= 0 or image_size <= 0 or image_size % patch_size:
                raise ValueError(
                    f"image_size {image_size} is not a positive multiple of patch_size {patch_size}: the ViT cannot "
                    "split it into patches; choose e.g. image_size 32 with patch_size 4"
                )
            sizes = {k: v for k, v in TINY_SIZES.items() if k in ViTConfig().to_dict()}
            config = ViTConfig(
                image_size=image_size, patch_size=patch_size, num_labels=NUM_CLASSES, **sizes, **no_dropout
            )
            self.vit = ViTForImageClassification(config)
        else:
            self.vit = ViTForImageClassification.from_pretrained(
                model_name_or_path, num_labels=NUM_CLASSES, ignore_mismatched_sizes=True, **no_dropout
            )
        self.image_size = self.vit.config.image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return self.vit(pixel_values=x).logits


# ------------------------------------------------------------------------------------------------------- results
class RecipeResults(Callback):
    """At the end of fit: the test accuracy and the run's summary written to ``path`` as JSON.

    The keys are those of :func:`lightning_dp.recipes.run.run_recipe` (``arguments``: the resolved LightningCLI config);
    the accuracy is evaluated on the data module's ``test_dataloader()`` on the main process.

    Args:
        path: the JSON file to write (parent folders are created).
        task: the ``task`` entry.
    """

    def __init__(self, path: str = "results.json", task: str = "cifar10") -> None:
        self.path = Path(path)
        self.task = task
        self._start = 0.0
        self.train_seconds = 0.0
        self.result: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_seconds = time.perf_counter() - self._start

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        data = trainer.datamodule
        start = time.perf_counter()
        metrics = pl_module.accuracy(data.test_dataloader())
        eval_seconds = time.perf_counter() - start
        self.result = results_record(
            task=self.task,
            metrics=metrics,
            privacy_engine=getattr(trainer.strategy, "privacy_engine", None),
            model=pl_module,
            train_size=len(data.train_set),
            eval_size=len(data.test_set),
            steps=trainer.global_step,
            expected_batch=data.hparams.batch_size * trainer.accumulate_grad_batches * trainer.world_size,
            train_seconds=self.train_seconds,
            eval_seconds=eval_seconds,
            world_size=trainer.world_size,
            arguments=_arguments(trainer, pl_module),
        )
        write_results(self.result, self.path)


def _arguments(trainer: pl.Trainer, pl_module: nn.Module) -> dict[str, Any]:
    """The resolved LightningCLI config of the run (from its ``SaveConfigCallback``), else the hyper-parameters."""
    for callback in trainer.callbacks:
        if isinstance(callback, SaveConfigCallback):
            config = callback.config.as_dict()
            config.pop("config", None)  # the paths of the YAML files, already in "command"
            return config
    return {"model": dict(pl_module.hparams), "data": dict(trainer.datamodule.hparams)}


# ------------------------------------------------------------------------------------------------ entry points
def variant_flags(variant: str, results_file: str) -> list[str]:
    """Command-line flags turning the docs config into one of the documented runs (:data:`VARIANTS`) that writes
    its summary to ``results_file``: ``non-private`` trains with Lightning's own strategy (no clipping, no noise)
    and the usual SGD of :data:`NON_PRIVATE_LR` / :data:`NON_PRIVATE_MOMENTUM`; the others set the DP strategy's
    ``target_epsilon`` and ``noise``.

    Raises:
        ValueError: an unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    flags = [f"--trainer.callbacks.init_args.path={results_file}"]
    spec = VARIANTS[variant]
    if spec is None:
        return [
            "--trainer.strategy=auto",
            f"--model.init_args.lr={NON_PRIVATE_LR}",
            f"--model.init_args.momentum={NON_PRIVATE_MOMENTUM}",
            *flags,
        ]
    epsilon, noise = spec
    return [
        f"--trainer.strategy.init_args.target_epsilon={epsilon}",
        f"--trainer.strategy.init_args.noise={noise}",
        *flags,
    ]


def cli_arguments(argv: Sequence[str]) -> list[str]:
    """``argv`` with the HF recipes' ``--data_dir ROOT`` (or ``--data_dir=ROOT``) spelled as the LightningCLI option
    ``--data.init_args.data_dir=ROOT``, so that every recipe script takes the same flag; the rest is unchanged
    (``--data_dir`` with no value after it too: LightningCLI then reports it)."""
    converted: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--data_dir" and i + 1 < len(argv):
            converted.append(f"--data.init_args.data_dir={argv[i + 1]}")
            i += 2
            continue
        if arg.startswith("--data_dir="):
            arg = "--data.init_args.data_dir=" + arg.partition("=")[2]
        converted.append(arg)
        i += 1
    return converted


#: Printed before LightningCLI's help by ``recipes/cifar.py --help``: the recipe's own flag and variable, which
#: LightningCLI's help does not show.
RECIPE_HELP = (
    "recipes/cifar.py: lightning-dp fit (the same LightningCLI) with the recipes' data flag:\n"
    "  --data_dir ROOT   the data root holding cifar10/, or that folder itself (default: $LIGHTNING_DP_DATA);\n"
    "                    LightningCLI's --data.init_args.data_dir ROOT\n"
    "lightning-dp fit's options follow.\n"
)


def main(argv: list[str] | None = None) -> int:
    """``recipes/cifar.py``: ``lightning-dp fit`` (the same LightningCLI, the same one-line errors) on ``argv``
    (default ``sys.argv[1:]``) with ``--data_dir`` accepted (:func:`cli_arguments`; ``--help`` names it first,
    :data:`RECIPE_HELP`); returns the exit code."""
    from lightning_dp.cli.main import main as cli_main

    args = cli_arguments(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(RECIPE_HELP)
    return cli_main(["fit", *args])
