"""PyTorch Lightning integration: DPStrategy and the privacy callbacks."""

from lightning_dp.lightning.callbacks import PrivacyAccountantCallback, PrivacyBudget
from lightning_dp.lightning.strategy import DPStrategy

__all__ = ["DPStrategy", "PrivacyAccountantCallback", "PrivacyBudget"]
