"""DPStrategy: DP-SGD for an unchanged Lightning training on one device, as one ``Trainer(strategy=...)`` argument.

The DP hooks live in :class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin` (shared with
:class:`~lightning_dp.lightning.ddp_strategy.DPDDPStrategy`, the multi-process variant) and the DP logic itself in
:class:`~lightning_dp.engine.privacy_engine.PrivacyEngine`; this file only binds them to Lightning's
``SingleDeviceStrategy`` and refuses a Trainer that asks for several devices or nodes, which this strategy would
otherwise silently ignore (training on one).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_dp.lightning.dp_mixin import DPStrategyMixin
from lightning_dp.lightning.registry import register_dp_strategy
from lightning_dp.runtime.randomness import indexed_device


def _default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class DPStrategy(DPStrategyMixin, SingleDeviceStrategy):
    """Differentially private training on one device: Poisson sampling, per-sample clipping, noise, accounting.

    The LightningModule's ``training_step`` must return the PER-SAMPLE loss, shape ``[B]`` (or a dict whose
    ``"loss"`` is), e.g. ``F.cross_entropy(logits, y, reduction="none")``; token losses are reduced per sample.

    By name: importing ``lightning_dp`` registers it in Lightning's ``StrategyRegistry``. ``Trainer(strategy="dp")``
    (``--trainer.strategy dp`` in LightningCLI) is ``DPStrategy(target_epsilon=3.0)`` with every other argument at
    its default (the calibrated noise and the default delta are logged at fit); ``"dp_epsilon_3"`` and
    ``"dp_epsilon_8"`` name the budget explicitly. Constructed directly, ``DPStrategy()`` has no privacy level and
    fails: give ``target_epsilon`` or ``noise_multiplier``. See :mod:`lightning_dp.lightning.registry`.

    Args:
        device: the device to train on (``"cuda"`` without an index: the current CUDA device); default: the one
            device the Trainer selects (``accelerator``, ``devices=1``), or ``cuda:0`` if available, else CPU, when
            the strategy is used outside a Trainer.
        kwargs: the privacy options, the fields of :class:`~lightning_dp.config.PrivacyConfig` (documented there
            and in :class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin`), and those of Lightning's
            ``SingleDeviceStrategy``.

    Raises:
        ValueError: invalid privacy arguments (at construction); ``Trainer(devices > 1)`` or ``num_nodes > 1`` (at
            Trainer construction: use ``DPDDPStrategy``); unsupported layers (at setup), a loss that is not per
            sample (first step), ``precision="16-true"`` or ``gradient_clip_val`` (at setup).
    """

    strategy_name = "dp"

    def __init__(self, *, device: str | torch.device | None = None, **kwargs: Any) -> None:
        self._device_given = device is not None
        super().__init__(device=indexed_device(device) if device is not None else _default_device(), **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"dp"`` (epsilon 3) and ``"dp_epsilon_3"``, ``"dp_epsilon_8"`` (see the class docstring)."""
        register_dp_strategy(strategy_registry, cls, cls.strategy_name)

    # Lightning hands a strategy the devices and nodes the Trainer was asked for through these two attributes
    # (when the strategy has them); a single-device strategy accepts only one of each, and without a device of its
    # own trains on the Trainer's (e.g. Trainer(strategy="dp", accelerator="cpu") on a CUDA machine).
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices is not None and len(devices) > 1:
            raise ValueError(
                f"DPStrategy trains on one device, but the Trainer asks for {len(devices)} devices: use "
                "strategy=DPDDPStrategy(...) with the same arguments to train on several processes, or devices=1"
            )
        if devices and not self._device_given:
            self._root_device = devices[0]

    @property
    def num_nodes(self) -> int:
        return 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes > 1:
            raise ValueError(
                f"DPStrategy trains on one device, but the Trainer asks for num_nodes={num_nodes}: use "
                "strategy=DPDDPStrategy(...) with the same arguments to train on several nodes"
            )
