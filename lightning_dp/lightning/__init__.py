"""PyTorch Lightning integration: DPStrategy (one device), DPDDPStrategy (several processes), privacy callbacks."""

from lightning_dp.lightning.callbacks import PrivacyAccountantCallback, PrivacyBudget
from lightning_dp.lightning.ddp_strategy import DPDDPStrategy
from lightning_dp.lightning.strategy import DPStrategy

__all__ = ["DPDDPStrategy", "DPStrategy", "PrivacyAccountantCallback", "PrivacyBudget"]
