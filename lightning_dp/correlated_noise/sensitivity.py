"""L2 sensitivity of a lower-triangular Toeplitz strategy ``C`` under min-separated participation.

Participation (Choquette-Choo et al. 2023, Section 3): an example may take part in steps ``pi`` of the ``n`` steps
when any two differ by at least ``min_sep`` and ``|pi| <= k`` (``k`` defaults to ``ceil(n / min_sep)``, the most
that fits). Cyclic Poisson sampling with ``b`` groups (step ``t`` samples only from group ``t mod b``) gives
``min_sep = b`` and ``k = ceil(n / b)``; so does any balls-in-bins scheme with at least ``b`` steps between two uses.
The sensitivity is ``sens(C) = sup ||C (G - G')||_F`` over neighbouring inputs under add/remove adjacency: rows
``g_t - g'_t`` (the added or removed example's clipped gradients, any dimension) of norm at most 1 on the steps of
``pi``, zero elsewhere (clip norm 1; the noise is scaled by it separately). With ``X = C^T C``::

    sens(C)^2 = max_pi  sup_{||u_i|| <= 1}  sum_{i, j in pi} X_ij <u_i, u_j>   <=   max_pi sum_{i, j in pi} |X_ij|

and the bound is attained, by aligned ``u_i``, when the entries of ``X`` on ``pi x pi`` are non-negative. The
supremum is over vectors ``u_i`` (gradients), which can exceed the one over signs ``u_i = +-1``; every result below is
exact or an upper bound for the vector case.

Cases this module computes (each function says whether its result is exact or an upper bound):

1. ``C`` with band ``<= min_sep`` (:func:`minsep_sensitivity`, any signs): two columns at distance ``>= min_sep`` have
   disjoint supports, so the cross terms vanish and ``sens^2 = max_pi sum_{i in pi} ||C[:, i]||^2``: the column norms
   suffice, with no condition on the signs of ``X`` (Choquette-Choo et al. 2023: b-banded ``C`` under
   b-min-separation). Toeplitz column norms fall with the index, so the maximum takes steps
   ``0, min_sep, ..., (k - 1) min_sep``; exact.
2. Toeplitz ``C`` whose coefficients are non-negative and non-increasing (any band; every BLT with ``w_j >= 0``,
   ``0 <= theta_j <= 1``, ``sum w_j <= 1``): ``X >= 0`` and the worst pattern is again ``0, min_sep, ...``, so
   ``sens = ||C (e_0 + e_{min_sep} + ... + e_{(k-1) min_sep})||`` (Kalinin and Lampert 2024, Theorem 2); exact.
   Proof sketch: for ``i <= j``, ``X_ij = sum_{r < n - j} c_r c_{r + j - i}`` falls as the gap ``j - i`` grows and as
   ``j`` grows; a pattern ``p_0 < p_1 < ...`` has ``p_m >= m min_sep`` and ``p_m - p_l >= (m - l) min_sep``, so each
   of its terms is at most the matching term of ``0, min_sep, ..., (k - 1) min_sep`` (which has at least as many,
   all ``>= 0``, and fits in ``n`` steps since ``k <= ceil(n / min_sep)``).
3. Any other Toeplitz ``C``: case 2 applied to the smallest non-negative non-increasing majorant
   ``m_k = max_{j >= k} |c_j|``. Every ``|X_ij|`` is at most the majorant's ``X'_ij``, so this is an upper bound
   (sound, possibly loose).
4. A dense ``C`` (:func:`dense_minsep_sensitivity_upper_bound`): the two-stage bound of Choquette-Choo et al. 2023
   (maximise ``sum_j |X_ij|`` over patterns for each row, then over rows); an upper bound for any ``C``.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from lightning_dp.correlated_noise import toeplitz


def check_min_sep(min_sep: int) -> int:
    """``min_sep`` as an int; raises ``ValueError`` unless ``1 <= min_sep``."""
    return toeplitz.integer_at_least(
        min_sep,
        1,
        f"min_sep must be an integer >= 1 (1: an example may take part in consecutive steps), got {min_sep!r}",
    )


def participation_count(n: int, min_sep: int, cap: int | None = None) -> int:
    """The most participations ``k`` a ``min_sep``-separated pattern over ``n`` steps allows: ``ceil(n / min_sep)``,
    or ``cap`` if smaller.

    Raises:
        ValueError: ``n < 1``, ``min_sep < 1`` or ``cap < 1``.
    """
    n = toeplitz.check_size(n)
    min_sep = check_min_sep(min_sep)
    most = math.ceil(n / min_sep)
    if cap is None:
        return most
    cap = toeplitz.integer_at_least(cap, 1, f"max_participations must be an integer >= 1 or None, got {cap!r}")
    return min(cap, most)


def max_over_patterns(values: npt.ArrayLike, min_sep: int, max_participations: int | None = None) -> float:
    """``max_pi sum_{i in pi} values[i]`` over index sets ``pi`` with gaps ``>= min_sep`` and ``|pi| <= k``
    (the empty set included: the result is ``>= 0``). Dynamic programme in ``O(len(values) * k)``
    (Choquette-Choo et al. 2023, Algorithm 3, VecSens).

    Args:
        values: shape ``[n]``.
        min_sep: the minimum separation, ``>= 1``.
        max_participations: ``k`` (``None``: ``ceil(n / min_sep)``).
    """
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    n = x.size
    k = participation_count(n, min_sep, max_participations)
    best = np.zeros(n + min_sep)  # best[i]: the best sum over x[i:] with the participations left
    for _ in range(k):
        take = np.zeros(n + min_sep)
        take[:n] = x + best[min_sep : n + min_sep]
        best = np.maximum.accumulate(take[::-1])[::-1]
    return float(best[0])


def band_of(coefs: npt.ArrayLike) -> int:
    """The band of Toeplitz coefficients: one more than the index of the last non-zero (1 for all zeros)."""
    nonzero = np.flatnonzero(np.asarray(coefs, dtype=np.float64))
    return int(nonzero[-1]) + 1 if nonzero.size else 1


def is_monotone(coefs: npt.ArrayLike) -> bool:
    """Whether the coefficients are non-negative and non-increasing (case 2 of the module docstring)."""
    c = np.asarray(coefs, dtype=np.float64)
    return bool(np.all(c >= 0) and np.all(np.diff(c) <= 0))


def minsep_sensitivity_is_exact(coefs: npt.ArrayLike, n: int, min_sep: int) -> bool:
    """Whether :func:`minsep_sensitivity` is exact for these coefficients (cases 1 and 2), not only an upper bound."""
    c = toeplitz.pad_coefs(coefs, n)
    return band_of(c) <= min_sep or is_monotone(c)


def shifted_sum(coefs: np.ndarray, min_sep: int, k: int) -> np.ndarray:
    """``C (e_0 + e_{min_sep} + ... + e_{(k-1) min_sep})`` for Toeplitz coefficients ``coefs`` ``[n]``: shape ``[n]``,
    entry ``t`` is ``sum_{j < k, j min_sep <= t} c_{t - j min_sep}``."""
    n = coefs.size
    out = np.zeros(n)
    for j in range(k):
        start = j * min_sep
        if start >= n:
            break
        out[start:] += coefs[: n - start]
    return out


def minsep_sensitivity(coefs: npt.ArrayLike, n: int, min_sep: int, max_participations: int | None = None) -> float:
    """The L2 sensitivity (clip norm 1) of the ``n x n`` Toeplitz ``C`` with first column ``coefs`` under
    ``min_sep``-separated participation with at most ``k`` participations.

    Exact when the band of ``coefs`` is at most ``min_sep`` (case 1 of the module docstring: column norms,
    Choquette-Choo et al. 2023) or the coefficients are non-negative and non-increasing (case 2: Kalinin
    and Lampert 2024, Theorem 2); otherwise a sound upper bound through the monotone majorant (case 3).
    :func:`minsep_sensitivity_is_exact` tells which. ``min_sep = 1, k = 1`` is single participation: ``||coefs||``.

    Args:
        coefs: the Toeplitz coefficients of ``C``, shape ``[m]`` (padded or cut to ``n``).
        n: the number of steps.
        min_sep: the minimum separation of two participations (cyclic Poisson over ``b`` groups: ``b``).
        max_participations: ``k``; ``None``: ``ceil(n / min_sep)``.

    Returns:
        The sensitivity, in units of the clip norm.

    Raises:
        ValueError: ``n < 1``, ``min_sep < 1``, ``max_participations < 1``, or bad coefficients.
    """
    c = toeplitz.pad_coefs(coefs, n)
    min_sep = check_min_sep(min_sep)
    k = participation_count(n, min_sep, max_participations)
    if band_of(c) <= min_sep:
        norms = toeplitz.column_norms(c, n)
        return math.sqrt(sum(norms[j * min_sep] ** 2 for j in range(k)))
    majorant = np.maximum.accumulate(np.abs(c)[::-1])[::-1]
    return float(np.linalg.norm(shifted_sum(majorant, min_sep, k)))


def dense_minsep_sensitivity_upper_bound(
    matrix: npt.ArrayLike, min_sep: int, max_participations: int | None = None
) -> float:
    """An upper bound on the min-separation sensitivity of any dense ``C`` ``[n, n]`` (case 4): with ``X = C^T C``,
    ``sqrt(max_pi sum_{i in pi} max_pi' sum_{j in pi'} |X_ij|)`` (Choquette-Choo et al. 2023: the rows' and the
    columns' patterns chosen separately, which only enlarges the maximum). It can be loose even for a banded
    ``C`` (use :func:`minsep_sensitivity` for Toeplitz ``C``).

    Raises:
        ValueError: ``matrix`` is not square, or bad ``min_sep`` / ``max_participations``.
    """
    c = np.asarray(matrix, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"C must be a square matrix, got shape {c.shape}")
    gram = np.abs(c.T @ c)
    rows = [max_over_patterns(row, min_sep, max_participations) for row in gram]
    return math.sqrt(max_over_patterns(rows, min_sep, max_participations))
