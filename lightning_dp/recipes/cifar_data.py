"""CIFAR-10 data for the CIFAR recipe (:mod:`lightning_dp.recipes.cifar`): the Hub dataset or the offline copies,
standardised with the public channel statistics, as a Lightning data module (:class:`CifarDataModule`)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.tasks.local_data import local_data_dir, require_file

NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
HUB_DATASET = "uoft-cs/cifar10"
#: The configuration reading the data from the Hub (named when local data is missing).
HUB_CONFIG = "configs/cifar10_hub.yaml"
#: How ``data_dir`` is set on the command line (named when local data is missing).
DATA_DIR_FLAG = "--data_dir ROOT (lightning-dp fit: --data.data_dir ROOT)"
TRAIN_FILE = "cifar10_train_5k_subset_from_jpg.npz"
TEST_FILE = "cifar10_test_10k_from_jpg.npz"
#: Public CIFAR-10 channel statistics (of the full official training set; not computed from the private data).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def standardise(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[N, 32, 32, 3]`` HWC RGB images as float ``[N, 3, 32, 32]`` standardised by :data:`CIFAR_MEAN` /
    :data:`CIFAR_STD`.

    Raises:
        ValueError: images not of shape ``[N, 32, 32, 3]``.
    """
    if images.ndim != 4 or tuple(images.shape[1:]) != IMAGE_SHAPE:
        raise ValueError(f"expected CIFAR-10 images of shape [N, 32, 32, 3] (HWC RGB), got {list(images.shape)}")
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def load_local(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (x, y), "test": (x, y)}`` from the npz files of the local copy (uint8 ``[N, 32, 32, 3]``, int64
    ``[N]``). Raises ``FileNotFoundError`` naming a missing file."""
    splits = {}
    for split, name in (("train", TRAIN_FILE), ("test", TEST_FILE)):
        with np.load(require_file(folder / name)) as data:
            splits[split] = (data["x"], data["y"].astype(np.int64))
    return splits


def load_hub(name: str = HUB_DATASET) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (x, y), "test": (x, y)}`` of the Hub dataset ``name`` (columns ``img``: PIL image, ``label``)."""
    from datasets import load_dataset

    dataset = load_dataset(name)
    return {
        split: (
            np.stack([np.asarray(image.convert("RGB")) for image in dataset[split]["img"]]),
            np.asarray(dataset[split]["label"], dtype=np.int64),
        )
        for split in ("train", "test")
    }


class CifarDataModule(pl.LightningDataModule):
    """CIFAR-10 as standardised ``[B, 3, 32, 32]`` float images and int64 labels ``[B]``.

    Under ``DPStrategy`` the training loader's sampling is replaced by Poisson sampling with expected batch size
    ``batch_size``; without DP it is shuffled with a generator seeded by ``split_seed``. There is no validation
    loader: the test accuracy is computed once, at the end of fit (:class:`RecipeResults`).

    Args:
        data_source: ``"local"`` (npz copies under ``data_dir``) or ``"hub"`` (``datasets.load_dataset(hub_dataset)``).
        data_dir: the data root holding ``cifar10/``, or that folder itself (default ``$LIGHTNING_DP_DATA``; see
            :func:`~lightning_dp.tasks.local_data.local_data_dir`).
        hub_dataset: the Hub dataset of ``data_source: hub``.
        train_size: training examples kept after the seeded shuffle (``None``: all).
        eval_size: test examples kept after the seeded shuffle (``None``: all).
        batch_size: training batch size (the expected batch size under DP).
        eval_batch_size: batch size of the evaluation loader.
        split_seed: seed of the shuffles (a dedicated ``numpy`` generator; the rows of the local copy are grouped by
            class, so the cut must come after a shuffle).

    Raises:
        ValueError: unknown ``data_source``, non-positive sizes (at construction); more examples asked for than the
            data has, images that are not 32x32 RGB (at setup).
        LocalDataError: no data root is set, or it holds no local copy (at setup, the start of fit; a
            ``FileNotFoundError`` and a ``ValueError``, :class:`~lightning_dp.tasks.local_data.LocalDataError`).
    """

    def __init__(
        self,
        data_source: str = "local",
        data_dir: str | None = None,
        hub_dataset: str = HUB_DATASET,
        train_size: int | None = None,
        eval_size: int | None = None,
        batch_size: int = 256,
        eval_batch_size: int = 500,
        split_seed: int = 0,
    ) -> None:
        super().__init__()
        if data_source not in ("local", "hub"):
            raise ValueError(f"data_source must be 'local' or 'hub', got {data_source!r}")
        for name, value in (("train_size", train_size), ("eval_size", eval_size)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or null for all examples), got {value}")
        if batch_size <= 0 or eval_batch_size <= 0:
            raise ValueError(f"batch sizes must be positive, got {batch_size} and {eval_batch_size}")
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        if hp.data_source == "local":
            files = (TRAIN_FILE, TEST_FILE)
            splits = load_local(local_data_dir(hp.data_dir, "cifar10", files, HUB_CONFIG, DATA_DIR_FLAG))
        else:
            splits = load_hub(hp.hub_dataset)
        rng = np.random.default_rng(hp.split_seed)
        self.train_set = self._subset("train", *splits["train"], hp.train_size, rng)
        self.test_set = self._subset("test", *splits["test"], hp.eval_size, rng)

    @staticmethod
    def _subset(split: str, x: np.ndarray, y: np.ndarray, size: int | None, rng: np.random.Generator) -> TensorDataset:
        if size is not None and size > len(y):
            raise ValueError(f"the {split} split has {len(y)} examples, fewer than the {size} asked for; lower it")
        keep = rng.permutation(len(y))[:size]
        return TensorDataset(standardise(x[keep]), torch.from_numpy(y[keep]))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.split_seed)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, generator=generator)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.eval_batch_size)


# ---------------------------------------------------------------------------------------------------------- models
