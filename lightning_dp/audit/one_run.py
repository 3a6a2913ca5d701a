"""The epsilon lower bound of a one-run audit (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1)
training run", NeurIPS 2023, arXiv:2305.08846, Algorithm 1 and Appendix D).

``m`` canaries are each included with probability 1/2; after one run the auditor guesses IN for the ``k_+`` highest
scores and OUT for the ``k_-`` lowest; ``v`` of the ``r = k_+ + k_-`` guesses are correct. The bound at confidence
``1 - beta`` is the largest epsilon whose p-value (:func:`one_run_p_value`) is below ``beta``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import expit
from scipy.stats import binom


def _validate_counts(m: int, r: int, v: int) -> None:
    if not 0 <= v <= r <= m:
        raise ValueError(f"Need 0 <= correct ({v}) <= guesses ({r}) <= canaries ({m})")


def _validate_delta(delta: float) -> None:
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must lie in [0, 1), got {delta}")


def _validate_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), e.g. 0.95; got {confidence}")


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability of at least ``v`` correct guesses out of ``r`` if the run were (epsilon, delta)-DP.

    Steinke et al. 2023, main theorems for pure DP (``delta = 0``): ``P[Binomial(r, e^eps / (1 + e^eps)) >= v]``, and
    approximate DP: ``f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) - f(v)) / i`` with ``f`` that tail (Appendix D).

    Args:
        m: number of canaries (each included with probability 1/2).
        r: number of guesses (canaries not abstained on).
        v: number of correct guesses.
        epsilon: epsilon >= 0 of the null hypothesis.
        delta: delta in [0, 1) of the null hypothesis.

    Returns:
        The p-value, in [0, 1].

    Raises:
        ValueError: counts not ``0 <= v <= r <= m``, negative epsilon, delta outside [0, 1).
    """
    _validate_counts(m, r, v)
    _validate_delta(delta)
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    accuracy = expit(epsilon)  # e^eps / (1 + e^eps): the accuracy of eps-DP randomized response
    tail = float(binom.sf(v - 1, r, accuracy))  # f(v) = P[Binomial(r, accuracy) >= v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    i = np.arange(1, v + 1)
    # f(v - i) - f(v) = P[v - i <= Binomial < v], summed from the pmf so no precision is lost to cancellation.
    between = np.cumsum(binom.pmf(v - i, r, accuracy))
    return min(tail + 2.0 * m * delta * float(np.max(between / i)), 1.0)


def one_run_epsilon_lower_bound(m: int, r: int, v: int, *, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon the one-run audit rejects at ``confidence``.

    ``sup {eps >= 0 : one_run_p_value(m, r, v, eps, delta) < 1 - confidence}`` (Steinke et al. 2023, Appendix D),
    found to 1e-6.

    Args:
        m: canaries; r: guesses; v: correct guesses (``0 <= v <= r <= m``).
        delta: delta of the claimed guarantee, in [0, 1).
        confidence: 1 - beta, in (0, 1).

    Returns:
        Epsilon lower bound >= 0 (0 when even epsilon = 0 cannot be rejected).

    Raises:
        ValueError: invalid counts, delta or confidence.
    """
    _validate_confidence(confidence)
    beta = 1.0 - confidence

    def excess(epsilon: float) -> float:
        return beta - one_run_p_value(m, r, v, epsilon, delta)

    if excess(0.0) <= 0:
        return 0.0
    low, high = 0.0, 1.0
    while excess(high) > 0:  # terminates: P[Binomial(r, expit(eps)) >= v] tends to 1 as eps grows
        low, high = high, 2.0 * high
    root = float(brentq(excess, low, high, xtol=1e-6))
    return max(low, root - 1e-6)  # the root lies within 1e-6 of brentq's answer: report the side below it


@dataclass(frozen=True)
class OneRunAudit:
    """Outcome of :func:`audit_scores`.

    Attributes:
        epsilon_lower_bound: the best bound over the guess sets, each computed at the Bonferroni-corrected
            confidence, so the whole result holds at ``confidence``.
        confidence: the stated confidence of the bound.
        delta: delta of the audited guarantee.
        num_canaries: m.
        guesses: r of the guess set that gave the bound.
        correct: v of that guess set.
        k_plus: IN guesses of that set; k_minus: OUT guesses of that set.
    """

    epsilon_lower_bound: float
    confidence: float
    delta: float
    num_canaries: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int


def count_correct_guesses(scores: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int) -> int:
    """Correct guesses when the ``k_plus`` highest scores are guessed IN and the ``k_minus`` lowest OUT (ties: canary
    order).

    Args:
        scores: ``[m]`` canary scores (higher means more likely included).
        included: ``[m]`` booleans, the true inclusion.
        k_plus, k_minus: guesses of each kind, ``k_plus + k_minus <= m``.

    Raises:
        ValueError: shapes differ, negative counts, or more guesses than canaries.
    """
    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and included {included.shape} must be 1-d of equal length")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > scores.size:
        raise ValueError(f"Need k_plus, k_minus >= 0 with k_plus + k_minus <= {scores.size}, got {k_plus}, {k_minus}")
    order = np.argsort(scores, kind="stable")
    guessed_out, guessed_in = order[:k_minus], order[scores.size - k_plus :]
    return int(included[guessed_in].sum() + (~included[guessed_out]).sum())


def default_guess_sets(num_canaries: int) -> list[tuple[int, int]]:
    """``(k_plus, k_minus)`` pairs tried by default: guesses on 5%, 10%, 25% and 50% of the canaries in total,
    half IN (highest scores) and half OUT (lowest), at least one of each."""
    return sorted({(max(1, round(f * num_canaries)),) * 2 for f in (0.025, 0.05, 0.125, 0.25)})


def audit_scores(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    guess_sets: Sequence[tuple[int, int]] | None = None,
) -> OneRunAudit:
    """Guess, count and bound epsilon (Steinke et al. 2023, Algorithm 1's last steps).

    Every set in ``guess_sets`` is evaluated at confidence ``1 - beta / len(guess_sets)`` (Bonferroni) and the largest
    bound is reported, so the result holds at ``confidence``.

    Args:
        scores: ``[m]`` canary scores (higher: more likely included).
        included: ``[m]`` true inclusion (booleans).
        delta: delta of the audited guarantee, in [0, 1).
        confidence: stated confidence of the result, in (0, 1).
        guess_sets: ``(k_plus, k_minus)`` pairs fixed in advance (default :func:`default_guess_sets`).

    Raises:
        ValueError: invalid scores, counts, delta or confidence; an empty ``guess_sets``.
    """
    _validate_confidence(confidence)
    m = int(np.asarray(scores).size)
    sets = list(guess_sets) if guess_sets is not None else default_guess_sets(m)
    if not sets:
        raise ValueError("guess_sets must name at least one (k_plus, k_minus) pair")
    per_set_confidence = 1.0 - (1.0 - confidence) / len(sets)
    best: OneRunAudit | None = None
    for k_plus, k_minus in sets:
        v = count_correct_guesses(scores, included, k_plus, k_minus)
        r = k_plus + k_minus
        bound = one_run_epsilon_lower_bound(m, r, v, delta=delta, confidence=per_set_confidence)
        if best is None or bound > best.epsilon_lower_bound:
            best = OneRunAudit(bound, confidence, delta, m, r, v, k_plus, k_minus)
    assert best is not None
    return best
