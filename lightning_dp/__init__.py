"""lightning_dp: differentially private training for PyTorch Lightning and HuggingFace.

``Trainer(strategy=DPStrategy(...), callbacks=[PrivacyAccountantCallback()])`` turns a Lightning training into
DP-SGD: Poisson sampling, per-sample clipping, calibrated noise, and a privacy accountant; ``DPDDPStrategy`` does
the same on several processes.
"""

from lightning_dp.lightning import DPDDPStrategy, DPStrategy, PrivacyAccountantCallback, PrivacyBudget
from lightning_dp.privacy_engine import PrivacyEngine

__all__ = ["DPDDPStrategy", "DPStrategy", "PrivacyAccountantCallback", "PrivacyBudget", "PrivacyEngine"]
__version__ = "0.1.0"
