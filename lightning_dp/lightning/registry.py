"""The DP strategies in Lightning's ``StrategyRegistry``, so a strategy can be named by a string:
``Trainer(strategy="dp")``, ``lightning-dp fit --trainer.strategy dp``.

Importing ``lightning_dp`` registers (when Lightning is imported, before or after it:
:mod:`lightning_dp.utils.import_hooks`), for ``DPStrategy`` (base name ``"dp"``), ``DPDDPStrategy`` (``"dp_ddp"``) and
``DPModelParallelStrategy`` (``"dp_fsdp"``):

- the base name: the class defaults (``max_grad_norm=1.0``, Gaussian noise, ``clipping='auto'``, the mechanism's sound
  accountant, Poisson sampling, ``seed=None``) with ``target_epsilon=3`` (:data:`DEFAULT_EPSILON`, the library's
  demo budget), the noise calibrated for the run's planned steps and ``target_delta`` its default ``1/N^1.1``. Both
  are in the start-up block logged at fit (:mod:`lightning_dp.engine.startup`: "gaussian (noise_multiplier=...),
  calibrated for epsilon=3 over ... steps" and the default delta among the defaults applied);
- ``"<base>_epsilon_3"`` and ``"<base>_epsilon_8"``: the same with ``target_epsilon`` 3 or 8 (the budgets the
  recipes report, docs/recipes.md), so the budget is in the name the user writes; ``"<base>_epsilon_3"`` is the
  base name spelled out.

Any other setting needs an instance, ``Trainer(strategy=DPStrategy(...))`` or a ``class_path`` in a LightningCLI
config. A ``DPStrategy()`` constructed directly has no privacy level and fails (``PrivacyEngine``'s "Give exactly
one of target_epsilon ... or the noise itself").
"""

from __future__ import annotations

from lightning.fabric.strategies.registry import _StrategyRegistry

#: the ``target_epsilon`` of the base names ``"dp"``, ``"dp_ddp"`` and ``"dp_fsdp"``.
DEFAULT_EPSILON: float = 3.0

#: the target epsilons registered by name (``"dp_epsilon_3"``, ``"dp_ddp_epsilon_8"``, ...).
REGISTERED_EPSILONS: tuple[float, ...] = (3.0, 8.0)


def budget_name(base: str, epsilon: float) -> str:
    """The registered name of ``base`` with ``target_epsilon=epsilon``: ``budget_name("dp", 3.0) == "dp_epsilon_3"``."""
    return f"{base}_epsilon_{epsilon:g}"


def register_dp_strategy(registry: _StrategyRegistry, strategy: type, base: str) -> None:
    """Register ``strategy`` under ``base`` (``target_epsilon=DEFAULT_EPSILON``) and under each budget name.

    ``override=True``: importing ``lightning_dp`` again (a reload) re-registers the same names.
    """
    registry.register(
        base,
        strategy,
        description=f"{strategy.__name__}(target_epsilon={DEFAULT_EPSILON:g}), the other arguments at their defaults",
        override=True,
        target_epsilon=DEFAULT_EPSILON,
    )
    for epsilon in REGISTERED_EPSILONS:
        registry.register(
            budget_name(base, epsilon),
            strategy,
            description=f"{strategy.__name__}(target_epsilon={epsilon:g}), the other arguments at their defaults",
            override=True,
            target_epsilon=epsilon,
        )
