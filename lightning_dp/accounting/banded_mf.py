"""Accountant of banded matrix factorization (BandMF) under cyclic Poisson sampling: amplification by subsampling.

**The mechanism.** ``n`` steps; ``x_t`` is step ``t``'s sum of clipped gradients (clip norm 1; the noise is scaled by
the clip norm separately, as everywhere in this library). The released stream is ``C x + sigma Z`` (``Z`` standard
normal, one row per step), or equivalently the noisy gradients ``x + sigma C^{-1} Z`` (its post-processing by
``C^{-1}``), for a lower-triangular ``C`` whose band is at most ``b``: ``C[t, j] = 0`` for ``t - j >= b``.

**The sampling (cyclic Poisson).** The training set is partitioned into ``b`` groups; step ``t`` includes each
example of group ``t mod b`` independently with probability ``q_b``, and no example of another group. For the same
expected batch ``q N`` as DP-SGD at rate ``q``, ``q_b = b q`` (each group holds ``N / b`` examples on average).

**The theorem** (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization: A unified approach to
private training", NeurIPS, Section 5; jax_privacy's documentation numbers the informal statement Theorem 1 and the
formal ones Theorems 4 and 5, which we have not checked against the paper's own text). Under the conditions below,
the mechanism is at least as private as ``k = ceil(n / b)`` adaptive compositions of the Poisson-subsampled Gaussian
mechanism with sampling rate ``q_b`` and noise multiplier ``sigma / s``, where ``s`` is the largest l2 norm of a
column of ``C``. With ``b = 1`` and ``C = I`` this is DP-SGD's accounting exactly.
It is an upper bound: exact only when the reduction is (e.g. ``q_b = 1`` and ``k`` columns of norm ``s``).

Why (our sketch; the tests check it numerically on small dense ``C``, with and without subsampling): an example of
group ``g`` can only enter ``x_j`` for ``j = g, g + b, g + 2b, ...`` (``ceil((n - g) / b) <= k`` steps), and since
``C`` is ``b``-banded, ``x_j`` enters only the rows ``j .. j + b - 1`` of ``C x``: one block of rows per
participation, the blocks disjoint. In block ``j``, row ``t`` is ``C[t, j] x_j + f_t + sigma z_t``, where ``f_t``
sums the ``x_{j'}`` of other steps: those come from other groups, so ``f_t`` is the same function of the earlier
rows (and of data both neighbouring datasets share) under both datasets, and subtracting it row by row is a
bijection common to both. So, given the earlier blocks, the block is a Poisson-subsampled (rate ``q_b``) Gaussian
mechanism with l2 sensitivity ``||C[:, j]|| <= s`` and noise ``sigma`` (the gradient ``x_j`` may depend on every
earlier release: adaptivity is covered), and the adaptive composition of the ``k`` blocks is dominated by the
``k``-fold composition of the worst one.

**Conditions the caller must meet** (the accountant checks what it can see and says what it cannot):

1. ``C`` is lower triangular with band at most ``b`` (the number of groups). Refused otherwise.
2. ``s`` bounds every column norm of ``C`` (:meth:`BandedMFAccountant.for_strategy` computes it; a hand-built
   :class:`BandedMFEvent` must pass it). No monotonicity of the column norms is needed; for a Toeplitz ``C`` they
   are non-increasing and ``s = ||c||``, the first column's. Only the single-participation norm enters, not the
   multi-participation sensitivity of :mod:`lightning_dp.correlated_noise.sensitivity`.
3. The partition into ``b`` groups is fixed before training and independent of the data; each example is in exactly
   one group; under add/remove adjacency (this library's, docs/design.md section 3.1) adding or removing one example
   must not move any other example to another group (e.g. each example's group drawn independently and uniformly,
   or a fixed function of a data-independent identifier; an equal-size split of a shuffle does not qualify).
4. Within its group's steps, each example is included independently with probability ``q_b`` (true Poisson
   sampling), with fresh randomness at every step, independent of the noise.
5. The noise ``Z`` is independent of the data and of the sampling; the gradients ``x_t`` may depend adaptively on
   every earlier release (covered by the argument above).
6. The same ``sigma``, ``q_b``, ``b`` and ``C`` for the whole run (the accountant refuses a ledger that mixes them:
   a change of ``sigma`` mid-band mixes noise scales within one participation's rows, which the reduction does not
   cover).

**Segments.** A training run that restarts the correlation (a resume: the streaming state is noise and is never
checkpointed, docs/design.md section 5.1) releases, from then on, a new banded-MF mechanism with the same ``C``,
whose noise and partition are drawn afresh; :attr:`BandedMFEvent.segment` numbers these pieces. The whole run is the
adaptive composition of its segments, each bounded as above, so a ledger of segments of ``n_1, n_2, ...`` steps is
``sum_i ceil(n_i / b)`` compositions of the reduced event (at most one more participation per restart than without
it). Segments differ only in their number: every other field must agree.

**Computation.** dp-accounting's PLD accountant on ``PoissonSampledDpEvent(q_b, GaussianDpEvent(sigma / s))``
composed ``k`` times, with the ``pld`` accountant's discretisation (``value_discretization_interval = 1e-4``,
pessimistic), both directions of add/remove (the larger epsilon). The bound is the reduction's; it can be loose
against the exact privacy of the correlated mechanism but is never below it (up to the discretisation, which is
pessimistic).

Registered as ``"banded-mf"``: the default, and the only accountant accepted, of ``noise_correlation='banded'``
(docs/design.md section 5.1 says what the training run provides for each condition).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import dp_accounting
import numpy as np
import numpy.typing as npt
from dp_accounting import pld

from lightning_dp.accounting.base import register_accountant, validate_delta, validate_epsilon
from lightning_dp.accounting.events import register_event
from lightning_dp.accounting.segments import SegmentedAccountant
from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz

#: Loss-grid spacing of the PLD (the same as the ``pld`` accountant's, :class:`~lightning_dp.accounting.gaussian.
#: PLDAccountant`).
VALUE_DISCRETIZATION_INTERVAL = 1e-4


@register_event
@dataclasses.dataclass(frozen=True)
class BandedMFEvent:
    """One step of banded MF under cyclic Poisson sampling: the release ``C x + sigma Z`` of module docstring.

    Attributes:
        noise_multiplier: ``sigma``, the standard deviation of the noise added to ``C x`` (per coordinate and row) in
            units of the clip norm, ``>= 0``. With the scaling of docs/design.md section 5.1 (noise ``sigma' * clip
            * s`` on ``C x``), pass ``sigma' * s``.
        group_sample_rate: ``q_b`` in ``[0, 1]``, the probability that an example of the step's group is included.
            For DP-SGD's expected batch ``q N``: ``b * q``.
        num_groups: ``b >= 1``, the number of groups of the cyclic partition; ``C``'s band must be at most ``b``.
        max_column_norm: ``s > 0``, an upper bound on every column norm of ``C`` (clip norm 1).
        segment: ``>= 0``, the number of the piece of the run since the correlation last restarted (module
            docstring, "Segments"); 0 for a run that never restarted.
    """

    noise_multiplier: float
    group_sample_rate: float
    num_groups: int
    max_column_norm: float
    segment: int = 0

    def __post_init__(self) -> None:  # plain Python numbers, so that the ledger's state is JSON (NumPy scalars are not)
        for field in ("noise_multiplier", "group_sample_rate", "max_column_norm"):
            if isinstance(getattr(self, field), numbers.Real):
                object.__setattr__(self, field, float(getattr(self, field)))
        for field in ("num_groups", "segment"):
            value = getattr(self, field)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, field, int(value))


def validate_banded_mf_event(event: BandedMFEvent) -> None:
    """Raise ``ValueError`` (one line saying what to change) unless the event's parameters are valid."""
    if not (event.noise_multiplier >= 0 and math.isfinite(event.noise_multiplier)):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {event.noise_multiplier}")
    if not 0.0 <= event.group_sample_rate <= 1.0:
        raise ValueError(
            f"the group sample rate q_b must lie in [0, 1], got {event.group_sample_rate}; with b groups q_b = b * q "
            "for an overall rate q: use fewer groups or a smaller expected batch"
        )
    if isinstance(event.num_groups, bool) or not isinstance(event.num_groups, numbers.Integral) or event.num_groups < 1:
        raise ValueError(f"num_groups (b, the cycle length) must be an integer >= 1, got {event.num_groups!r}")
    if not (event.max_column_norm > 0 and math.isfinite(event.max_column_norm)):
        raise ValueError(f"max_column_norm must be finite and > 0, got {event.max_column_norm}")
    if isinstance(event.segment, bool) or not isinstance(event.segment, numbers.Integral) or event.segment < 0:
        raise ValueError(f"segment must be an integer >= 0, got {event.segment!r}")


def band_and_max_column_norm(strategy: BandedToeplitz | npt.ArrayLike, steps: int) -> tuple[int, float]:
    """The band ``b`` and the largest column norm ``s`` of an ``steps x steps`` strategy ``C``.

    Args:
        strategy: a :class:`~lightning_dp.correlated_noise.strategies.BandedToeplitz`, or a dense ``C`` of shape
            ``[steps, steps]`` (any lower-triangular banded matrix, Toeplitz or not).
        steps: the number of steps ``n``.

    Returns:
        ``(band, max_column_norm)``; the band of a dense ``C`` is one more than the largest ``t - j`` with
        ``C[t, j] != 0``.

    Raises:
        ValueError: a BLT (:class:`~lightning_dp.correlated_noise.strategies.BufferedToeplitz`: not banded), a dense
            ``C`` that is not square ``[steps, steps]``, not finite, or not lower triangular, a zero ``C``, or a band
            larger than ``steps``.
    """
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps (n) must be a positive integer, got {steps!r}")
    steps = int(steps)
    if isinstance(strategy, BufferedToeplitz):
        raise ValueError(
            "a BLT strategy is not banded: no amplification theorem covers it; use a BandedToeplitz strategy, or an "
            "unamplified min-separation accountant"
        )
    if isinstance(strategy, BandedToeplitz):
        band = strategy.band
        if band > steps:
            raise ValueError(f"the band b={band} exceeds the number of steps n={steps}; use a band <= n")
        return band, float(np.max(strategy.column_norms(steps)))
    matrix = np.asarray(strategy, dtype=np.float64)
    if matrix.shape != (steps, steps):
        raise ValueError(f"C must be a [n, n] = [{steps}, {steps}] matrix, got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise ValueError("C must be finite")
    rows, cols = np.nonzero(matrix)
    if rows.size == 0:
        raise ValueError("C is zero; a strategy needs a non-zero column")
    if np.any(cols > rows):
        raise ValueError("C must be lower triangular (C[t, j] = 0 for j > t): the theorem needs a causal strategy")
    band = int(np.max(rows - cols)) + 1
    return band, float(np.max(np.linalg.norm(matrix, axis=0)))


@register_accountant
class BandedMFAccountant(SegmentedAccountant):
    """Epsilon and delta of banded MF under cyclic Poisson sampling (module docstring: theorem, conditions).

    The ledger holds one :class:`BandedMFEvent` per step (equal but for their segment); ``get_epsilon(delta)`` and
    ``get_delta(epsilon)`` compose ``k = sum over segments of ceil(steps / b)`` Poisson-subsampled Gaussian mechanisms
    (rate ``q_b``, noise multiplier ``sigma / s``) with dp-accounting's PLD. Build it with :meth:`for_strategy`, or
    ``compose`` events as training proceeds. Source: Choquette-Choo et al. 2023, Section 5.
    """

    name = "banded-mf"
    event_type = BandedMFEvent
    label = "banded MF"
    keep = "sigma, q_b, b and C"
    note = "banded MF, cyclic Poisson over b groups (Choquette-Choo et al. 2023, Sec. 5)"
    value_discretization_interval = VALUE_DISCRETIZATION_INTERVAL

    def validate(self, event: Any) -> None:
        validate_banded_mf_event(event)

    @classmethod
    def for_strategy(
        cls,
        strategy: BandedToeplitz | npt.ArrayLike,
        *,
        steps: int,
        noise_multiplier: float,
        group_sample_rate: float,
        num_groups: int | None = None,
    ) -> BandedMFAccountant:
        """The accountant of ``steps`` steps with strategy ``C``.

        Args:
            strategy: a :class:`~lightning_dp.correlated_noise.strategies.BandedToeplitz` or a dense lower-triangular
                banded ``C`` ``[steps, steps]``.
            steps: ``n >= 1``, the number of steps of the run.
            noise_multiplier: ``sigma`` of :class:`BandedMFEvent` (noise on ``C x``, clip-norm units).
            group_sample_rate: ``q_b`` in ``[0, 1]``.
            num_groups: ``b``, the number of groups (``None``: ``C``'s band). Must be at least ``C``'s band and at
                most ``steps``.

        Raises:
            ValueError: a strategy that is not banded lower triangular (see :func:`band_and_max_column_norm`), a band
                or ``num_groups`` above ``steps``, ``num_groups`` below the band, ``q_b`` outside ``[0, 1]``, or a
                negative ``sigma``.
        """
        band, max_norm = band_and_max_column_norm(strategy, steps)
        groups = band if num_groups is None else num_groups
        if isinstance(groups, bool) or int(groups) != groups or groups < 1:
            raise ValueError(f"num_groups must be an integer >= 1, got {groups!r}")
        groups = int(groups)
        if groups < band:
            raise ValueError(
                f"C has band {band} but only {groups} groups: the theorem needs band <= number of groups; use "
                f"num_groups >= {band} (or a strategy with band <= {groups})"
            )
        if groups > steps:
            raise ValueError(f"num_groups b={groups} exceeds the number of steps n={steps}; use b <= n")
        accountant = cls()
        accountant.compose(BandedMFEvent(float(noise_multiplier), float(group_sample_rate), groups, max_norm), steps)
        return accountant

    def _reduced(self) -> tuple[dp_accounting.DpEvent, int] | None:
        """The reduced event (``PoissonSampled(q_b, Gaussian(sigma / s))``) and ``k``; ``None`` when ``sigma = 0``."""
        event: BandedMFEvent = self.ledger[0][0]
        if event.noise_multiplier == 0:
            return None
        gaussian = dp_accounting.GaussianDpEvent(event.noise_multiplier / event.max_column_norm)
        return dp_accounting.PoissonSampledDpEvent(event.group_sample_rate, gaussian), self.participations

    def _backend(self) -> pld.PLDAccountant:
        return pld.PLDAccountant(value_discretization_interval=self.value_discretization_interval)

    def _epsilon(self, delta: float) -> float:
        reduced = self._reduced()
        if reduced is None:
            return math.inf if self.ledger[0][0].group_sample_rate > 0 else 0.0
        event, k = reduced
        return float(self._backend().compose(event, k).get_epsilon(delta))

    def get_delta(self, epsilon: float) -> float:
        """Delta of all composed steps at ``epsilon`` (0.0 for an empty ledger).

        Returns:
            Delta in ``[0, 1]``; with ``sigma = 0`` (and ``q_b > 0``) the trivial bound 1.0.

        Raises:
            ValueError: ``epsilon <= 0``.
        """
        validate_epsilon(epsilon)
        if not self.ledger:
            return 0.0
        reduced = self._reduced()
        if reduced is None:
            return 1.0 if self.ledger[0][0].group_sample_rate > 0 else 0.0
        event, k = reduced
        return float(self._backend().compose(event, k).get_delta(epsilon))


def banded_mf_epsilon(
    strategy: BandedToeplitz | npt.ArrayLike,
    *,
    steps: int,
    noise_multiplier: float,
    group_sample_rate: float,
    delta: float,
    num_groups: int | None = None,
) -> float:
    """Epsilon at ``delta`` of ``steps`` steps of banded MF under cyclic Poisson sampling (arguments and errors:
    :meth:`BandedMFAccountant.for_strategy`; ``delta`` in ``(0, 1)``)."""
    validate_delta(delta)
    accountant = BandedMFAccountant.for_strategy(
        strategy,
        steps=steps,
        noise_multiplier=noise_multiplier,
        group_sample_rate=group_sample_rate,
        num_groups=num_groups,
    )
    return accountant.get_epsilon(delta)
