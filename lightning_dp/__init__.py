"""lightning_dp: differentially private training for PyTorch Lightning and HuggingFace.

``Trainer(strategy=DPStrategy(...), callbacks=[PrivacyAccountantCallback()])`` turns a Lightning training into
DP-SGD: Poisson sampling, per-sample clipping, calibrated noise, and a privacy accountant; ``DPDDPStrategy`` does
the same on several processes, ``DPModelParallelStrategy`` on a model sharded with FSDP2 (``fully_shard``).

Importing the package is cheap: each public name is imported on first use (``from lightning_dp import DPStrategy``
imports Lightning, ``PrivacyEngine`` does not), and the DP strategies join Lightning's ``StrategyRegistry``
(``Trainer(strategy="dp")``) as soon as Lightning is imported, before or after this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_dp.utils.import_hooks import when_imported

if TYPE_CHECKING:
    from lightning_dp.augmentation import augment_each_example, augmentation_mean, repeat_for_multiplicity
    from lightning_dp.engine.privacy_engine import PrivacyEngine
    from lightning_dp.lightning import (
        DPDDPStrategy,
        DPModelParallelStrategy,
        DPStrategy,
        PrivacyAccountantCallback,
        PrivacyBudget,
        TrainingProgress,
    )
    from lightning_dp.tuning import Candidate, RepetitionDistribution, SearchPlan, SearchResult, private_search
    from lightning_dp.weight_standardisation import WSConv2d

__all__ = [
    "Candidate",
    "DPDDPStrategy",
    "DPModelParallelStrategy",
    "DPStrategy",
    "PrivacyAccountantCallback",
    "PrivacyBudget",
    "PrivacyEngine",
    "RepetitionDistribution",
    "SearchPlan",
    "SearchResult",
    "TrainingProgress",
    "WSConv2d",
    "augment_each_example",
    "augmentation_mean",
    "private_search",
    "repeat_for_multiplicity",
]
#: The one place the version is written (pyproject.toml reads it; CHANGELOG.md lists what each version holds).
__version__ = "0.1.0"

#: Public name -> the module it is imported from on first use.
_EXPORTS: dict[str, str] = {
    "Candidate": "lightning_dp.tuning",
    "DPDDPStrategy": "lightning_dp.lightning",
    "DPModelParallelStrategy": "lightning_dp.lightning",
    "DPStrategy": "lightning_dp.lightning",
    "PrivacyAccountantCallback": "lightning_dp.lightning",
    "PrivacyBudget": "lightning_dp.lightning",
    "PrivacyEngine": "lightning_dp.engine.privacy_engine",
    "RepetitionDistribution": "lightning_dp.tuning",
    "SearchPlan": "lightning_dp.tuning",
    "SearchResult": "lightning_dp.tuning",
    "TrainingProgress": "lightning_dp.lightning",
    "WSConv2d": "lightning_dp.weight_standardisation",
    "augment_each_example": "lightning_dp.augmentation",
    "augmentation_mean": "lightning_dp.augmentation",
    "private_search": "lightning_dp.tuning",
    "repeat_for_multiplicity": "lightning_dp.augmentation",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562) and keep it."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _register_strategies() -> None:
    import lightning_dp.lightning  # noqa: F401  (its import registers the DP strategies by name)


when_imported("lightning", _register_strategies)
