"""The DP strategies in Lightning's ``StrategyRegistry``, so a strategy can be named by a string:
``Trainer(strategy="dp_epsilon_3")``, ``lightning-dp fit --trainer.strategy dp_epsilon_3``.

Importing ``lightning_dp`` registers, for ``DPStrategy`` (base name ``"dp"``) and ``DPDDPStrategy`` (``"dp_ddp"``):

- the base name, with the class defaults (``max_grad_norm=1.0``, Gaussian noise, flat clipping, the mechanism's
  sound accountant, Poisson sampling, ``seed=None``). The defaults fix no privacy level, and the library never
  picks a budget silently, so ``Trainer(strategy="dp")`` fails at Trainer construction with a message naming what
  to pass (see :func:`require_privacy_level`);
- ``"<base>_epsilon_3"`` and ``"<base>_epsilon_8"``: the same with ``target_epsilon`` 3 or 8 (the budgets the
  recipes report, docs/recipes.md), the noise calibrated for the run's planned steps, ``target_delta`` its default
  ``1/N^1.1`` (logged). The budget is then in the name the user writes.

Any other setting needs an instance, ``Trainer(strategy=DPStrategy(...))`` or a ``class_path`` in a LightningCLI
config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry

from lightning_dp.mechanisms import NoiseMechanism

#: the target epsilons registered by name (``"dp_epsilon_3"``, ``"dp_ddp_epsilon_8"``, ...).
REGISTERED_EPSILONS: tuple[float, ...] = (3.0, 8.0)


def budget_name(base: str, epsilon: float) -> str:
    """The registered name of ``base`` with ``target_epsilon=epsilon``: ``budget_name("dp", 3.0) == "dp_epsilon_3"``."""
    return f"{base}_epsilon_{epsilon:g}"


def register_dp_strategy(registry: _StrategyRegistry, strategy: type, base: str) -> None:
    """Register ``strategy`` under ``base`` (class defaults) and under each budget name (``target_epsilon``).

    ``override=True``: importing ``lightning_dp`` again (a reload) re-registers the same names.
    """
    registry.register(
        base,
        strategy,
        description=f"{strategy.__name__} with its defaults; needs target_epsilon or noise_multiplier, so pass an "
        f"instance or use {budget_name(base, REGISTERED_EPSILONS[0])!r}",
        override=True,
    )
    for epsilon in REGISTERED_EPSILONS:
        registry.register(
            budget_name(base, epsilon),
            strategy,
            description=f"{strategy.__name__}(target_epsilon={epsilon:g}), the other arguments at their defaults",
            override=True,
            target_epsilon=epsilon,
        )


def require_privacy_level(strategy: str, base: str, kwargs: Mapping[str, Any]) -> None:
    """Fail with what to pass when ``kwargs`` fix no privacy level (no ``target_epsilon``, ``noise_multiplier``,
    ``noise_params`` or ``NoiseMechanism``), as ``Trainer(strategy=base)`` does; other invalid combinations are
    left to :class:`~lightning_dp.privacy_engine.PrivacyEngine`.

    Raises:
        ValueError: no privacy level given.
    """
    if (
        kwargs.get("target_epsilon") is not None
        or kwargs.get("noise_multiplier") is not None
        or kwargs.get("noise_params")
        or isinstance(kwargs.get("noise"), NoiseMechanism)
    ):
        return
    budgets = " or ".join(repr(budget_name(base, epsilon)) for epsilon in REGISTERED_EPSILONS)
    raise ValueError(
        f"{strategy} has no default privacy level (the library does not choose a budget): give exactly one of "
        "target_epsilon (the noise is calibrated for it) or the noise itself (noise_multiplier for Gaussian, "
        f"noise_params for other mechanisms), e.g. {strategy}(target_epsilon=3.0). Trainer(strategy={base!r}) builds "
        f"{strategy}() with the defaults, so it needs the same: pass strategy={strategy}(target_epsilon=...), or a "
        f"registered name with a budget, {budgets}; in a LightningCLI config, strategy: {{class_path: "
        f"lightning_dp.{strategy}, init_args: {{target_epsilon: 3.0}}}}"
    )
