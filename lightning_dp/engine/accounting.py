"""The accounting side of :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine`: the event of one step, the ledger,
epsilon, the budget and the run's summary (docs/design.md section 3.5)."""

from __future__ import annotations

import logging
import math
from typing import Any

from lightning_dp.accounting import randomized_clipping_step_event
from lightning_dp.accounting.blt_minsep import BLTMinSepAccountant
from lightning_dp.engine.run_state import RunState

log = logging.getLogger("lightning_dp")


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers of a :meth:`PrivacyLedger.summary` as metrics; with clipping groups each bound under
    ``clipping_groups/<index>``.
    """
    metrics = {key: float(value) for key, value in summary.items() if isinstance(value, int | float)}
    for index, bound in enumerate(summary.get("clipping_groups", {}).values()):
        metrics[f"clipping_groups/{index}"] = float(bound)
    return metrics


class PrivacyLedger:
    """The accounting of one run: the event of a step, the steps recorded with the accountant, epsilon, the budget
    and the summary, all read from the run's :class:`~lightning_dp.engine.run_state.RunState`."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self._epsilon_cache: tuple[tuple[int, float, int], float] | None = None
        self._max_steps_cache: tuple[float, int] | None = None

    def step_event(self) -> Any:
        """The privacy event of one logical step."""
        state = self.state
        assert state.mechanism is not None and state.sample_rate is not None and state.num_params is not None
        if state.correlation is not None:
            return state.correlation.event(state.noise_multiplier)
        if state.randomized_clipping:
            assert state.clipper is not None and state.norm_dim is not None
            engine = state.clipper.engine
            assert engine.estimator is not None  # register_engine refuses a randomized engine without one
            return randomized_clipping_step_event(
                state.noise_multiplier,
                state.sample_rate,
                engine.projection_dim,
                state.norm_dim,
                engine.estimator,
            )
        return state.mechanism.step_event(state.sample_rate, state.num_params)

    def clear_caches(self) -> None:
        """Forget the cached epsilon and step budget (after the ledger was replaced, e.g. by a restore)."""
        self._epsilon_cache = None
        self._max_steps_cache = None

    def record_step(self) -> None:
        """Record one completed logical step with the accountant."""
        state = self.state
        assert state.accountant is not None
        state.accountant.compose(self.step_event())

    @property
    def steps(self) -> int:
        """Logical steps taken (and accounted) so far."""
        return self.state.steps

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default ``target_delta``); ``inf`` when no noise is added."""
        state = self.state
        if state.accountant is None or self.steps == 0:
            return 0.0
        assert state.mechanism is not None
        if state.mechanism.is_noiseless:
            return math.inf
        delta = delta if delta is not None else state.target_delta
        assert delta is not None  # set by prepare, which ran before the first step
        key = (self.steps, delta, len(state.accountant.ledger))
        if self._epsilon_cache is None or self._epsilon_cache[0] != key:
            self._epsilon_cache = (key, state.accountant.get_epsilon(delta))
        return self._epsilon_cache[1]

    def max_steps_within(self, epsilon_budget: float) -> int:
        """The largest total number of steps (taken plus further steps of the current event) whose epsilon stays <=
        ``epsilon_budget``; cached per budget.
        """
        state = self.state
        if self._max_steps_cache and self._max_steps_cache[0] == epsilon_budget:
            return self._max_steps_cache[1]
        accountant, delta = state.accountant, state.target_delta
        assert accountant is not None and state.mechanism is not None and delta is not None
        if state.mechanism.is_noiseless:
            return self.steps if self.steps == 0 else 0

        def eps_after(extra: int) -> float:
            return accountant.copy().compose(self.step_event(), extra).get_epsilon(delta)

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
        state = self.state
        if state.epsilon_budget is None or state.accountant is None:
            return False
        return self.steps >= self.max_steps_within(state.epsilon_budget)

    def set_epsilon_budget(self, target_epsilon: float | None, *, configured_in: str) -> None:
        """Enforce ``target_epsilon`` (default: the engine's) as the budget of :meth:`budget_exhausted`.

        Raises:
            ValueError: neither is set (``configured_in`` names where the user could set it).
        """
        state = self.state
        budget = target_epsilon if target_epsilon is not None else state.config.target_epsilon
        if budget is None:
            raise ValueError(f"PrivacyBudget needs target_epsilon (here or in {configured_in})")
        state.epsilon_budget = budget

    def log_budget_stop(self) -> None:
        """Warn that training stops because one more step would exceed the budget."""
        state = self.state
        log.warning(
            "Privacy budget reached: epsilon=%.4g after %d steps; one more step would exceed the budget "
            "epsilon=%.4g (delta=%.3g). Stopping training.",
            self.epsilon(),
            self.steps,
            state.epsilon_budget,
            state.target_delta,
        )

    def summary(self) -> dict[str, Any]:
        """Final report: epsilon, delta, mechanism parameters, steps, sample rate, accountant. Adaptive clipping adds
        ``initial_max_grad_norm`` and ``sum_noise_multiplier`` (``max_grad_norm`` is the current bound); with groups
        ``max_grad_norm`` is the sensitivity and ``clipping_groups`` maps labels to ``C_g``;
        ``augmentation_multiplicity`` when ``K > 1``; with ``privacy_unit="user"``, ``privacy_unit``, ``num_users`` (the
        accounted N) and ``examples_per_user`` (the option, never a data statistic).
        """
        state = self.state
        assert state.mechanism is not None and state.accountant is not None
        engine = state.clipper.engine if state.clipper is not None else None
        return {
            "epsilon": self.epsilon(),
            "delta": state.target_delta,
            "noise": state.mechanism.name,
            **state.mechanism.describe(),
            "steps": self.steps,
            "sample_rate": state.sample_rate,
            "num_params": state.num_params,
            "accountant": state.accountant.name,
            "clipping": state.clipping,
            **(
                {"clipping_groups": state.clipping_groups.bounds_by_label()}
                if state.clipping_groups is not None
                else {}
            ),
            **(
                {"projection_dim": engine.projection_dim, "norm_dim": state.norm_dim}
                if state.randomized_clipping and engine is not None
                else {}
            ),
            **(
                {"momentum_length": state.momentum.momentum_length, "momentum_beta": state.momentum.momentum_beta}
                if state.momentum.enabled
                else {}
            ),
            **({"lowpass": state.lowpass.describe()} if state.lowpass is not None else {}),
            **(
                {
                    **state.correlation.summary(),
                    "participations": getattr(state.accountant, "participations", None),
                    **(
                        {"sensitivity": state.accountant.sensitivity}
                        if isinstance(state.accountant, BLTMinSepAccountant)
                        else {}
                    ),
                }
                if state.correlation is not None
                else {}
            ),
            **(
                {"augmentation_multiplicity": state.config.augmentation_multiplicity}
                if state.config.augmentation_multiplicity > 1
                else {}
            ),
            **(
                {
                    "privacy_unit": "user",
                    "num_users": state.num_samples,
                    "examples_per_user": state.config.examples_per_user or "all",  # the option, no data statistic
                }
                if state.config.privacy_unit == "user"
                else {}
            ),
            **(
                {
                    "max_grad_norm": state.current_max_grad_norm,
                    "initial_max_grad_norm": state.max_grad_norm,
                    "sum_noise_multiplier": state.sum_noise_multiplier,
                    "adaptive_clipping": state.adaptive.describe(),
                }
                if state.adaptive is not None
                else {}
            ),
            **({"BROKEN_FOR_TESTING": state.broken_for_testing} if state.broken_for_testing else {}),
        }
