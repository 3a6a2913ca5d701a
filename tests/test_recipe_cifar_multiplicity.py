"""The CIFAR-10 recipe with augmentation multiplicity (De et al. 2022, Section 3.2): K = 2 on the committed test
subset runs under DP and reproduces with one seed; a model and a strategy that disagree on K are one error line; the
crop-and-flip augmentation and its seeded generator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_recipe_cifar import CONFIG, read_results, tiny_flags

from lightning_dp.recipes.cifar import main
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
        assert main(["--config", str(CONFIG), *tiny_flags(tmp_path / name), *TWO_COPIES]) == 0
        results.append(read_results(tmp_path / name))
    first, second = results
    assert first["privacy"]["augmentation_multiplicity"] == 2 and 0 < first["privacy"]["epsilon"] <= 3.0 + 1e-6
    assert first["arguments"]["model"]["init_args"]["augmentation_multiplicity"] == 2
    assert first["metrics"] == second["metrics"] and first["privacy"] == second["privacy"]


def test_model_and_strategy_disagreeing_on_k_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    flags = [*tiny_flags(tmp_path), "--model.init_args.augmentation_multiplicity=2"]
    assert main(["--config", str(CONFIG), *flags]) != 0
    assert "the model makes 2 augmented copies per example but the DP strategy expects" in capsys.readouterr().err


def test_k_one_is_the_recipe_of_before(tmp_path: Path) -> None:
    """K = 1 (the docs config's value) given again on the command line: the same run, and no copy in the summary
    (that K = 1 leaves the recipe's numbers bit for bit as before the option was added was checked on the parameters
    of a 3-step run against the commit before it)."""
    results = []
    for name, extra in (("default", []), ("explicit", ["--model.init_args.augmentation_multiplicity=1"])):
        assert main(["--config", str(CONFIG), *tiny_flags(tmp_path / name), *extra]) == 0
        results.append(read_results(tmp_path / name))
    assert results[0]["metrics"] == results[1]["metrics"] and results[0]["privacy"] == results[1]["privacy"]
    assert "augmentation_multiplicity" not in results[0]["privacy"]


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
