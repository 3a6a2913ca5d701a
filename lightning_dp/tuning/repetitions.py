"""The law of the number of candidates ``K`` a private search trains (Papernot & Steinke 2022, Definition 1 and
Theorem 6).

Parameterised as dp-accounting's ``RepeatAndSelectDpEvent(event, mean, shape)``:

- ``shape`` in ``(-1, 0) U (0, inf)``: the truncated negative binomial ``D_{eta, gamma}`` on ``{1, 2, ...}``,
  ``P[K = k] = (1 - gamma)^k / (gamma^-eta - 1) prod_{l=0}^{k-1} (l + eta) / (l + 1)``; ``shape = 1`` is the
  geometric law ``gamma (1 - gamma)^(k - 1)`` (Liu & Talwar 2019);
- ``shape = 0``: the logarithmic law ``P[K = k] = (1 - gamma)^k / (k log(1 / gamma))`` on ``{1, 2, ...}``;
- ``shape = inf``: the Poisson law of mean ``mean`` on ``{0, 1, ...}`` (Papernot & Steinke 2022, Theorem 6): ``K = 0``
  is possible, and then nothing is released.

``gamma`` is found from the mean ``E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta))`` (``(1 - gamma) / (gamma log(1 /
gamma))`` at ``eta = 0``). Draws come from a uniform the caller supplies (a dedicated generator,
:class:`~lightning_dp.tuning.randomness.SearchRandomness`), by inversion of the distribution function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

#: Relative accuracy of ``gamma`` (bisection on the mean, which decreases in ``gamma``).
GAMMA_RTOL = 1e-12


def _tnb_mean(gamma: float, shape: float) -> float:
    """``E[K]`` of the truncated negative binomial (``shape != 0``) or logarithmic (``shape == 0``) law at ``gamma``
    in ``(0, 1)``."""
    if shape == 0:
        return (1.0 - gamma) / (gamma * -math.log(gamma))
    return shape * (1.0 - gamma) / (gamma * -math.expm1(shape * math.log(gamma)))


def _log_abs_expm1(x: float) -> float:
    """``log |exp(x) - 1|`` for ``x != 0``, without overflow for a large ``x``."""
    if x > 1.0:
        return x + math.log1p(-math.exp(-x))
    return math.log(abs(math.expm1(x)))


@dataclasses.dataclass(frozen=True)
class RepetitionDistribution:
    """The law of the number of candidates ``K``.

    Attributes:
        mean: ``E[K] > 1``, the expected number of candidates.
        shape: ``eta``: ``> -1`` (truncated negative binomial; ``1`` geometric, ``0`` logarithmic) or ``inf``
            (Poisson).

    Raises:
        ValueError: a mean that is not a finite number above 1, or a shape that is not ``> -1``.
    """

    mean: float
    shape: float

    def __post_init__(self) -> None:
        if not (isinstance(self.mean, int | float) and 1.0 < self.mean < math.inf):
            raise ValueError(
                f"mean_repetitions must be a finite number above 1 (the expected number of candidates), got "
                f"{self.mean}; a single candidate is one ordinary run: train it without a search"
            )
        if not (isinstance(self.shape, int | float) and self.shape > -1.0):
            raise ValueError(
                f"shape must be above -1 (0 logarithmic, 1 geometric, other values truncated negative binomial) or "
                f"inf (Poisson), got {self.shape}"
            )

    @property
    def name(self) -> str:
        """``"Poisson"``, ``"geometric"``, ``"logarithmic"`` or ``"truncated negative binomial"``."""
        if self.shape == math.inf:
            return "Poisson"
        return {1.0: "geometric", 0.0: "logarithmic"}.get(float(self.shape), "truncated negative binomial")

    @property
    def smallest(self) -> int:
        """The least value ``K`` can take: 0 for Poisson, else 1."""
        return 0 if self.shape == math.inf else 1

    @property
    def gamma(self) -> float:
        """``gamma`` of the truncated laws: the largest found with ``E[K] <= mean`` (so the accountant's ``log(mean)``
        and its ``gamma``, found from below, are both on the safe side of the law sampled here).

        Raises:
            ValueError: for the Poisson law, which has no ``gamma``.
        """
        if self.shape == math.inf:
            raise ValueError("the Poisson law has no gamma")
        if self.shape == 1:
            return 1.0 / self.mean
        low, high = 0.0, 1.0  # E[K] -> inf as gamma -> 0 and -> 1 as gamma -> 1
        while high - low > GAMMA_RTOL * high:
            mid = 0.5 * (low + high)
            if _tnb_mean(mid, self.shape) > self.mean:
                low = mid
            else:
                high = mid
        return high

    def probabilities(self) -> Iterator[tuple[int, float]]:
        """``(k, P[K = k])`` for ``k = smallest, smallest + 1, ...`` without end, each term from its logarithm: the
        Poisson ``exp(-mean)`` underflows above a mean of about 745 (as ``gamma^-eta`` overflows for a large mean and
        shape), and a walk from an underflowed first term would give one ``K`` for every uniform."""
        k = self.smallest
        if self.shape == math.inf:
            log_mean = math.log(self.mean)
            while True:
                yield k, math.exp(k * log_mean - self.mean - math.lgamma(k + 1))
                k += 1
        gamma, eta = self.gamma, float(self.shape)
        log_keep = math.log1p(-gamma)
        if eta == 0:  # (1 - gamma)^k / (k log(1 / gamma))
            log_norm = math.log(-math.log(gamma))
            while True:
                yield k, math.exp(k * log_keep - math.log(k) - log_norm)
                k += 1
        # (1 - gamma)^k Gamma(k + eta) / ((gamma^-eta - 1) Gamma(eta) k!); for eta in (-1, 0) both gamma^-eta - 1 and
        # Gamma(eta) are negative, so their logarithms are those of their magnitudes
        log_norm = _log_abs_expm1(-eta * math.log(gamma)) + math.lgamma(eta)
        while True:
            yield k, math.exp(k * log_keep + math.lgamma(k + eta) - math.lgamma(k + 1) - log_norm)
            k += 1

    def pmf(self, k: int) -> float:
        """``P[K = k]`` (0 below :attr:`smallest`)."""
        for value, p in self.probabilities():
            if value == k:
                return p
            if value > k:
                return 0.0
        raise AssertionError("unreachable")

    def sample(self, uniform: float) -> int:
        """``K`` by inversion: the least ``k`` with ``P[K <= k] > uniform``.

        Args:
            uniform: a draw of ``U[0, 1)`` from a dedicated generator (never the global RNG).

        Raises:
            ValueError: ``uniform`` outside ``[0, 1)``.
        """
        if not 0.0 <= uniform < 1.0:
            raise ValueError(f"uniform must lie in [0, 1), got {uniform}")
        cumulative = 0.0
        for k, p in self.probabilities():
            total = cumulative + p
            # the sum of the rounded terms may stop short of 1: past the mean, a term too small to move it ends the walk
            if uniform < total or (total == cumulative and k > self.mean):
                return k
            cumulative = total
        raise AssertionError("unreachable")
