"""PyTorch Lightning integration: DPStrategy (one device), DPDDPStrategy (several processes), DPModelParallelStrategy
(several processes, FSDP2-sharded model), privacy callbacks, progress lines.

Importing it registers the three strategies in Lightning's ``StrategyRegistry`` (``Trainer(strategy="dp")``;
the names are in :mod:`lightning_dp.lightning.registry`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dp.lightning.callbacks import PrivacyAccountantCallback, PrivacyBudget
from lightning_dp.lightning.ddp_strategy import DPDDPStrategy
from lightning_dp.lightning.model_parallel_strategy import DPModelParallelStrategy
from lightning_dp.lightning.progress import TrainingProgress
from lightning_dp.lightning.strategy import DPStrategy

DPStrategy.register_strategies(StrategyRegistry)
DPDDPStrategy.register_strategies(StrategyRegistry)
DPModelParallelStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DPDDPStrategy",
    "DPModelParallelStrategy",
    "DPStrategy",
    "PrivacyAccountantCallback",
    "PrivacyBudget",
    "TrainingProgress",
]
