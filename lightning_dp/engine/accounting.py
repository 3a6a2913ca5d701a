"""The accounting side of :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine`: the event of one step, the ledger,
epsilon, the budget and the run's summary (docs/design.md section 3.5)."""

from __future__ import annotations

import logging
import math
from typing import Any

from lightning_dp.accounting import randomized_clipping_step_event

log = logging.getLogger("lightning_dp")


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers of a :meth:`EngineAccounting.summary` as metrics: each number under its key, and with clipping
    groups each group's bound under ``clipping_groups/<index>``, the group's position (labels hold patterns such as
    ``bert.*``, which trackers rewrite in metric names; the summary maps each label to its bound), the summary's
    ``max_grad_norm`` then being the sensitivity ``sqrt(sum_g C_g^2)``."""
    metrics = {key: float(value) for key, value in summary.items() if isinstance(value, int | float)}
    for index, bound in enumerate(summary.get("clipping_groups", {}).values()):
        metrics[f"clipping_groups/{index}"] = float(bound)
    return metrics


class EngineAccounting:
    """Accounting methods of :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine` (a base class of it). The
    attributes it reads (``accountant``, ``mechanism``, ``sample_rate``, ``num_params``, ``target_delta``, ...) are
    the engine's."""

    def step_event(self) -> Any:
        """The privacy event of one logical step."""
        assert self.mechanism is not None and self.sample_rate is not None and self.num_params is not None
        if self.randomized_clipping:
            assert self.clipper is not None and self.norm_dim is not None
            return randomized_clipping_step_event(
                self.mechanism.noise_multiplier,
                self.sample_rate,
                self.clipper.engine.projection_dim,
                self.norm_dim,
                self.clipper.engine.estimator,
            )
        return self.mechanism.step_event(self.sample_rate, self.num_params)

    def record_step(self) -> None:
        """Record one completed logical step with the accountant; under adaptive clipping, then move the bound."""
        assert self.accountant is not None
        self.accountant.compose(self.step_event())
        if self.adaptive is not None:
            self.move_clip_bound()

    @property
    def steps(self) -> int:
        """Logical steps taken (and accounted) so far."""
        return self.accountant.steps if self.accountant is not None else 0

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default ``target_delta``); ``inf`` when no noise is added."""
        if self.accountant is None or self.steps == 0:
            return 0.0
        assert self.mechanism is not None
        if self.mechanism.is_noiseless:
            return math.inf
        delta = delta if delta is not None else self.target_delta
        key = (self.steps, delta, len(self.accountant.ledger))
        if self._epsilon_cache is None or self._epsilon_cache[0] != key:
            self._epsilon_cache = (key, self.accountant.get_epsilon(delta))
        return self._epsilon_cache[1]

    def max_steps_within(self, epsilon_budget: float) -> int:
        """The largest total number of steps whose epsilon stays <= ``epsilon_budget`` (cached per budget).

        Counts the steps already taken plus further steps of the current event; found by doubling and bisection.
        """
        if self._max_steps_cache and self._max_steps_cache[0] == epsilon_budget:
            return self._max_steps_cache[1]
        assert self.accountant is not None and self.mechanism is not None
        if self.mechanism.is_noiseless:
            return self.steps if self.steps == 0 else 0

        def eps_after(extra: int) -> float:
            return self.accountant.copy().compose(self.step_event(), extra).get_epsilon(self.target_delta)

        if eps_after(0) > epsilon_budget:
            result = self.steps
        else:
            lo, hi = 0, 1
            while eps_after(hi) <= epsilon_budget and hi < 10**9:
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if eps_after(mid) <= epsilon_budget else (lo, mid)
            result = self.steps + lo
        self._max_steps_cache = (epsilon_budget, result)
        return result

    def budget_exhausted(self) -> bool:
        """True when an ``epsilon_budget`` is set and one more step would exceed it."""
        if self.epsilon_budget is None or self.accountant is None:
            return False
        return self.steps >= self.max_steps_within(self.epsilon_budget)

    def set_epsilon_budget(self, target_epsilon: float | None, *, configured_in: str) -> None:
        """Enforce ``target_epsilon`` (default: this engine's ``target_epsilon``) as the budget of
        :meth:`budget_exhausted` (the ``PrivacyBudget`` callbacks of Lightning and HF).

        Raises:
            ValueError: neither is set (``configured_in`` names where the user could set it).
        """
        budget = target_epsilon if target_epsilon is not None else self.target_epsilon
        if budget is None:
            raise ValueError(f"PrivacyBudget needs target_epsilon (here or in {configured_in})")
        self.epsilon_budget = budget

    def log_budget_stop(self) -> None:
        """Warn that training stops because one more step would exceed the budget."""
        log.warning(
            "Privacy budget reached: epsilon=%.4g after %d steps; one more step would exceed the budget "
            "epsilon=%.4g (delta=%.3g). Stopping training.",
            self.epsilon(),
            self.steps,
            self.epsilon_budget,
            self.target_delta,
        )

    def summary(self) -> dict[str, Any]:
        """Final report: epsilon, delta, mechanism parameters, steps, sample rate, accountant. Under adaptive
        clipping ``max_grad_norm`` is the current bound, beside ``initial_max_grad_norm``, the clipped sum's
        ``sum_noise_multiplier`` and the options (``noise_multiplier`` stays the accounted sigma). With clipping
        groups, ``max_grad_norm`` is the sensitivity ``sqrt(sum_g C_g^2)`` the noise is scaled to, and
        ``clipping_groups`` maps each group (a module's name, or its patterns) to its bound ``C_g``. With
        ``augmentation_multiplicity = K > 1``, ``augmentation_multiplicity`` is ``K`` (the accounting does not
        change). With ``privacy_unit="user"``, ``privacy_unit``, ``num_users`` (the ``N`` of the accounting) and
        ``examples_per_user`` (the option: the cap, or ``"all"``; never a statistic of the data, which the guarantee
        does not cover); ``sample_rate`` is then the users'."""
        assert self.mechanism is not None and self.accountant is not None
        return {
            "epsilon": self.epsilon(),
            "delta": self.target_delta,
            "noise": self.mechanism.name,
            **self.mechanism.describe(),
            "steps": self.steps,
            "sample_rate": self.sample_rate,
            "num_params": self.num_params,
            "accountant": self.accountant.name,
            "clipping": self.clipping,
            **({"clipping_groups": self.clipping_groups.bounds_by_label()} if self.clipping_groups is not None else {}),
            **(
                {"projection_dim": self.clipper.engine.projection_dim, "norm_dim": self.norm_dim}
                if self.randomized_clipping and self.clipper is not None
                else {}
            ),
            **(
                {"momentum_length": self.momentum.momentum_length, "momentum_beta": self.momentum.momentum_beta}
                if self.momentum.enabled
                else {}
            ),
            **({"lowpass": self.lowpass.describe()} if self.lowpass is not None else {}),
            **(
                {"augmentation_multiplicity": self.config.augmentation_multiplicity}
                if self.config.augmentation_multiplicity > 1
                else {}
            ),
            **(
                {
                    "privacy_unit": "user",
                    "num_users": self.num_samples,
                    "examples_per_user": self.config.examples_per_user or "all",  # the option, no data statistic
                }
                if self.config.privacy_unit == "user"
                else {}
            ),
            **(
                {
                    "max_grad_norm": self.current_max_grad_norm,
                    "initial_max_grad_norm": self.max_grad_norm,
                    "sum_noise_multiplier": self.sum_mechanism.noise_multiplier,
                    "adaptive_clipping": self.adaptive.describe(),
                }
                if self.adaptive is not None
                else {}
            ),
            **({"BROKEN_FOR_TESTING": self.broken_for_testing} if self.broken_for_testing else {}),
        }
