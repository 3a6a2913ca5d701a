"""lightning_dp: differentially private training for PyTorch Lightning and HuggingFace.

``Trainer(strategy=DPStrategy(...), callbacks=[PrivacyAccountantCallback()])`` turns a Lightning training into
DP-SGD: Poisson sampling, per-sample clipping, calibrated noise, and a privacy accountant; ``DPDDPStrategy`` does
the same on several processes, ``DPModelParallelStrategy`` on a model sharded with FSDP2 (``fully_shard``).
"""

from lightning_dp.lightning import (
    DPDDPStrategy,
    DPModelParallelStrategy,
    DPStrategy,
    PrivacyAccountantCallback,
    PrivacyBudget,
)
from lightning_dp.privacy_engine import PrivacyEngine

__all__ = [
    "DPDDPStrategy",
    "DPModelParallelStrategy",
    "DPStrategy",
    "PrivacyAccountantCallback",
    "PrivacyBudget",
    "PrivacyEngine",
]
__version__ = "0.1.0"
