"""The CIFAR-10 recipe with augmentation multiplicity (De et al. 2022, Section 3.2): K = 2 on the committed test
subset runs under DP and reproduces with one seed; a model and a strategy that disagree on K are one error line; the
models' ``augment`` option (one augmented copy at K = 1, the un-augmented K = 1 by default, no identical copies); the
crop-and-flip augmentation and its seeded generator."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from recipe_helpers import CIFAR_CONFIG, TEST_DATA, cifar_tiny_flags, read_cifar_results

from lightning_dp import DPStrategy
from lightning_dp.recipes.cifar import CifarDataModule, WideResNetClassifier, main
from lightning_dp.recipes.image_augmentation import augmentation_generator, random_crop_flip

TWO_COPIES = [
    "--trainer.strategy.init_args.augmentation_multiplicity=2",
    "--model.init_args.augmentation_multiplicity=2",
]


def test_two_copies_per_example_run_and_reproduce(tmp_path: Path) -> None:
    """The docs config with K = 2 (the model and the strategy): DP within budget, the summary names K, and a second
    run with the same seeds gives the same numbers (the copies' crops and flips come from seeded generators)."""
    results = []
    for name in ("first", "second"):
        assert main(["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(tmp_path / name), *TWO_COPIES]) == 0
        results.append(read_cifar_results(tmp_path / name))
    first, second = results
    assert first["privacy"]["augmentation_multiplicity"] == 2 and 0 < first["privacy"]["epsilon"] <= 3.0 + 1e-6
    assert first["arguments"]["model"]["init_args"]["augmentation_multiplicity"] == 2
    assert first["metrics"] == second["metrics"] and first["privacy"] == second["privacy"]


def test_model_and_strategy_disagreeing_on_k_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    flags = [*cifar_tiny_flags(tmp_path), "--model.init_args.augmentation_multiplicity=2"]
    assert main(["--config", str(CIFAR_CONFIG), *flags]) != 0
    assert "the model makes 2 augmented copies per example but the DP strategy expects" in capsys.readouterr().err


def test_k_one_is_the_recipe_of_before(tmp_path: Path) -> None:
    """K = 1 (the docs config's value) given again on the command line: the same run, and no copy in the summary
    (that K = 1 leaves the recipe's numbers bit for bit as before the option was added was checked on the parameters
    of a 3-step run against the commit before it)."""
    results = []
    for name, extra in (("default", []), ("explicit", ["--model.init_args.augmentation_multiplicity=1"])):
        assert main(["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(tmp_path / name), *extra]) == 0
        results.append(read_cifar_results(tmp_path / name))
    assert results[0]["metrics"] == results[1]["metrics"] and results[0]["privacy"] == results[1]["privacy"]
    assert "augmentation_multiplicity" not in results[0]["privacy"]


class _RowsSeen(WideResNetClassifier):
    """The docs model family at its smallest, recording each train-mode training step's input images, batch index
    and the rows its forward sees."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(depth=10, width=1, lr=2.0, **kwargs)
        self.steps: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self._step: tuple[torch.Tensor, int] | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._step = (batch[0].detach().clone(), batch_idx) if self.training else None
        return super().training_step(batch, batch_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._step is not None:
            self.steps.append((*self._step, x.detach().clone()))
        return super().forward(x)


def _fit_k_one(augment: bool | None) -> tuple[_RowsSeen, dict]:
    """Two DP steps at K = 1 on the test subset; the model (with the rows it saw) and the privacy summary."""
    pl.seed_everything(0, verbose=False)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, seed=0, device="cpu")
    model = _RowsSeen(augment=augment)
    data = CifarDataModule(data_dir=str(TEST_DATA), train_size=64, eval_size=40, batch_size=16)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, datamodule=data)
    return model, strategy.privacy_engine.summary()


def test_augment_at_k_one_crops_and_flips_one_row_per_example_at_the_same_sensitivity() -> None:
    """``augment=True`` at K = 1: the training step's forward sees each example's image cropped and flipped (the
    seeded draws of the K > 1 copies), still one row per example, so each example's gradient is clipped once at C and
    the calibration and accounting are those of the un-augmented run; ``augment=None`` (the default) at K = 1 leaves
    the rows untouched (the recipe as before the option)."""
    plain, plain_summary = _fit_k_one(None)
    augmented, augmented_summary = _fit_k_one(True)
    assert len(plain.steps) == len(augmented.steps) == 2
    assert all(torch.equal(images, rows) for images, _, rows in plain.steps)
    for images, batch_idx, rows in augmented.steps:
        assert rows.shape == images.shape  # one row per example: no copies
        assert not torch.equal(rows, images)
        generator = augmentation_generator(augmented._augmentation_seed, 0, 0, batch_idx)
        assert torch.equal(rows, random_crop_flip(images, generator))
    assert augmented_summary == plain_summary  # the same noise multiplier, sensitivity C, sample rate and epsilon
    assert "augmentation_multiplicity" not in augmented_summary


def test_augment_false_with_copies_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """K identical copies average to the gradient of one at K times the cost: refused at construction (one error
    line through the recipe's command line); ``augment=False`` at K = 1 is the un-augmented recipe."""
    with pytest.raises(ValueError, match="augment=False with augmentation_multiplicity=4: the 4 copies"):
        WideResNetClassifier(depth=10, width=1, augmentation_multiplicity=4, augment=False)
    assert not WideResNetClassifier(depth=10, width=1, augment=False).augments
    assert WideResNetClassifier(depth=10, width=1, augmentation_multiplicity=2).augments  # None: iff K > 1
    assert (
        main(
            ["--config", str(CIFAR_CONFIG), *cifar_tiny_flags(tmp_path), *TWO_COPIES, "--model.init_args.augment=false"]
        )
        != 0
    )
    assert "augment=False with augmentation_multiplicity=2" in capsys.readouterr().err


def _images(rows: int = 6) -> torch.Tensor:
    return torch.arange(rows * 2 * 5 * 5, dtype=torch.float64).reshape(rows, 2, 5, 5)


def test_random_crop_flip_is_a_crop_of_the_reflect_padded_image_maybe_flipped() -> None:
    images = _images()
    out = random_crop_flip(images, torch.Generator().manual_seed(0), padding=2)
    padded = F.pad(images, (2, 2, 2, 2), mode="reflect")
    for row in range(len(images)):
        crops = [padded[row, :, i : i + 5, j : j + 5] for i in range(5) for j in range(5)]
        assert any(torch.equal(out[row], c) or torch.equal(out[row], c.flip(-1)) for c in crops), row
    assert out.shape == images.shape and out.is_contiguous()
    identity = random_crop_flip(images, torch.Generator().manual_seed(0), padding=0)
    assert all(torch.equal(a, b) or torch.equal(a, b.flip(-1)) for a, b in zip(identity, images, strict=True))


def test_random_crop_flip_draws_per_row_reproducibly_and_keeps_the_gradient() -> None:
    images = _images(64).requires_grad_(True)
    first = random_crop_flip(images, augmentation_generator(5, 0, 1, 2))
    second = random_crop_flip(images, augmentation_generator(5, 0, 1, 2))
    other = random_crop_flip(images, augmentation_generator(5, 0, 1, 3))
    assert torch.equal(first, second) and not torch.equal(first, other)
    same = random_crop_flip(images[:1].repeat(64, 1, 1, 1), augmentation_generator(5, 0, 1, 2))
    assert len({tuple(row.flatten().tolist()) for row in same}) > 8  # copies of one image differ row by row
    first.sum().backward()
    assert images.grad is not None and float(images.grad.sum()) == pytest.approx(first.numel())


@pytest.mark.parametrize(
    ("images", "padding", "message"),
    [(torch.zeros(2, 3, 4), 1, r"\[N, C, H, W\]"), (torch.zeros(1, 1, 4, 4), 4, "padding must lie in")],
)
def test_random_crop_flip_arguments(images: torch.Tensor, padding: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        random_crop_flip(images, torch.Generator(), padding=padding)
