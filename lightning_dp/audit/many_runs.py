"""The classic many-run audit (Jagielski, Ullman & Oprea 2020, "Auditing differentially private machine learning:
how private is private SGD?", NeurIPS 2020, Algorithm 2): train many times with the canary and many times without,
threshold a score, and turn Clopper-Pearson intervals of the test's error rates into an epsilon lower bound.

Any test of an (epsilon, delta)-DP mechanism satisfies ``TPR <= e^eps FPR + delta`` and
``1 - FPR <= e^eps (1 - TPR) + delta`` (Kairouz, Oh & Viswanath 2015, Theorem 2.1), so with ``TPR >= TPR_lo`` and
``FPR <= FPR_hi`` (each at confidence ``1 - beta/2``, union bound), with confidence ``1 - beta``:
``eps >= max(log((TPR_lo - delta) / FPR_hi), log((1 - FPR_hi - delta) / (1 - TPR_lo)))``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import beta as beta_distribution


def clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds ``(lower, upper)`` of a binomial proportion, each holding at ``confidence``.

    Raises:
        ValueError: ``0 <= successes <= trials`` fails, ``trials < 1``, or ``confidence`` outside (0, 1).
    """
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"Need 0 <= successes ({successes}) <= trials ({trials}) and trials >= 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    alpha = 1.0 - confidence
    lower = 0.0 if successes == 0 else float(beta_distribution.ppf(alpha, successes, trials - successes + 1))
    upper = 1.0 if successes == trials else float(beta_distribution.ppf(1 - alpha, successes + 1, trials - successes))
    return lower, upper


def many_run_epsilon_lower_bound(
    in_scores: np.ndarray, out_scores: np.ndarray, *, threshold: float, delta: float, confidence: float = 0.95
) -> float:
    """Epsilon lower bound of the threshold test "score >= threshold means the canary was in".

    Args:
        in_scores: ``[n_in]`` scores of runs trained WITH the canary.
        out_scores: ``[n_out]`` scores of runs trained WITHOUT it.
        threshold: fixed before seeing these scores (e.g. chosen on other runs), else the confidence is void.
        delta: delta of the audited guarantee, in [0, 1).
        confidence: stated confidence in (0, 1) of the whole bound (each interval gets half the error).

    Returns:
        The bound, >= 0.

    Raises:
        ValueError: empty score arrays, delta outside [0, 1), confidence outside (0, 1).
    """
    in_scores, out_scores = np.asarray(in_scores, dtype=float), np.asarray(out_scores, dtype=float)
    if in_scores.size == 0 or out_scores.size == 0:
        raise ValueError("Need at least one run with and one without the canary")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must lie in [0, 1), got {delta}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    each = 1.0 - (1.0 - confidence) / 2.0
    tpr_lo, _ = clopper_pearson(int((in_scores >= threshold).sum()), in_scores.size, each)
    _, fpr_hi = clopper_pearson(int((out_scores >= threshold).sum()), out_scores.size, each)
    bounds = [0.0]
    if tpr_lo - delta > 0 and fpr_hi > 0:
        bounds.append(math.log((tpr_lo - delta) / fpr_hi))
    if 1.0 - fpr_hi - delta > 0 and tpr_lo < 1.0:
        bounds.append(math.log((1.0 - fpr_hi - delta) / (1.0 - tpr_lo)))
    return max(bounds)
