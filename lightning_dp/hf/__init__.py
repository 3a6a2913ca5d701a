"""Differentially private training with the HuggingFace ``Trainer`` (and PEFT/LoRA models), over ``PrivacyEngine``.

``from lightning_dp.hf import DPTrainer, PrivacyArguments`` (the dp-transformers convention); ``ParameterAveraging``
averages the weights (EMA), ``PrivacyBudget`` stops at a budget. See docs/hf.md. Needs the ``hf`` extra (``pip install
-e ".[hf]"``); without it, the import error names it.
"""

from lightning_dp.utils.extras import needs_extra

with needs_extra("hf", "lightning_dp.hf"):
    from lightning_dp.hf.arguments import PrivacyArguments
    from lightning_dp.hf.averaging import ParameterAveraging
    from lightning_dp.hf.callbacks import PrivacyBudget
    from lightning_dp.hf.trainer import DPTrainer

__all__ = ["DPTrainer", "ParameterAveraging", "PrivacyArguments", "PrivacyBudget"]
