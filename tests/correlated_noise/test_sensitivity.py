"""Min-separation sensitivity against brute force on small ``n``: every participation pattern (gaps >= min_sep, at
most k steps) and every sign vector, ``max ||C u||`` with ``u`` in {-1, 0, 1}^n on the pattern (the sensitivity for
scalar contributions), and ``max_pi sum_{i, j in pi} |X_ij|`` (an upper bound on the sensitivity for vector
contributions, equal to it when X = C^T C >= 0 on the pattern).

The sensitivity that matters is the vector one, ``max_pi sup_{||u_i|| <= 1} ||sum_{i in pi} C[:, i] u_i^T||_F``: it
lies between the scalar one (``u_i = +-e_1``) and the absolute sum, so where those two agree the vector one is pinned
to them. It can exceed the scalar one (``test_vector_contributions_can_beat_signs``), so the vector case is also
maximised directly, over unit vectors, and the code's value must be at least that."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lightning_dp.correlated_noise import sensitivity, toeplitz
from lightning_dp.correlated_noise.strategies import BufferedToeplitz

N = 10


def patterns(n: int, min_sep: int, k: int):
    for size in range(1, k + 1):
        for pi in itertools.combinations(range(n), size):
            if all(b - a >= min_sep for a, b in itertools.pairwise(pi)):
                yield pi


def brute_force(c: np.ndarray, min_sep: int, k: int) -> tuple[float, float]:
    """(scalar sensitivity by enumeration, max over patterns of sum |X_ij|, square-rooted)."""
    gram = np.abs(c.T @ c)
    scalar, absolute = 0.0, 0.0
    for pi in patterns(c.shape[0], min_sep, k):
        index = list(pi)
        absolute = max(absolute, gram[np.ix_(index, index)].sum())
        signs = np.array(list(itertools.product((-1.0, 1.0), repeat=len(pi))))
        scalar = max(scalar, float(np.max(np.sum((c[:, index] @ signs.T) ** 2, axis=0))))
    return math.sqrt(scalar), math.sqrt(absolute)


@pytest.mark.parametrize("min_sep", [1, 2, 3, 4])
@pytest.mark.parametrize("cap", [None, 2])
def test_banded_column_norms_are_exact_for_any_signs(min_sep, cap):
    rng = np.random.default_rng(min_sep)
    k = sensitivity.participation_count(N, min_sep, cap)
    for band in range(1, min_sep + 1):
        coefs = np.concatenate([[1.0], rng.normal(size=band - 1)])
        value = sensitivity.minsep_sensitivity(coefs, N, min_sep, cap)
        scalar, absolute = brute_force(toeplitz.materialize(coefs, N), min_sep, k)
        assert sensitivity.minsep_sensitivity_is_exact(coefs, N, min_sep)
        assert value == pytest.approx(scalar, rel=1e-12) and value == pytest.approx(absolute, rel=1e-12)


def vector_sensitivity(c: np.ndarray, min_sep: int, k: int, seed: int = 0) -> float:
    """``max_pi sup_{||u_i|| = 1} sum_{i, j in pi} X_ij <u_i, u_j>`` by enumeration of the patterns and, per pattern,
    ascent over ``|pi|`` unit vectors in ``R^{|pi|}`` (``U <- rows of X U normalised``: X is positive semi-definite,
    so the objective is convex and each step does not decrease it) from the best sign vector and random starts; a
    lower bound on the vector sensitivity (square-rooted), at least the scalar one."""
    rng = np.random.default_rng(seed)
    best = 0.0
    for pi in patterns(c.shape[0], min_sep, k):
        index = list(pi)
        gram = c[:, index].T @ c[:, index]
        signs = np.array(list(itertools.product((-1.0, 1.0), repeat=len(pi))))
        top = signs[np.argmax(np.einsum("si,ij,sj->s", signs, gram, signs))]
        starts = [np.outer(top, np.eye(len(pi))[0])] + [rng.normal(size=(len(pi), len(pi))) for _ in range(2)]
        for u in starts:
            for _ in range(100):
                u = u / np.linalg.norm(u, axis=1, keepdims=True)
                u = gram @ u
            u = u / np.linalg.norm(u, axis=1, keepdims=True)
            best = max(best, float(np.trace(u.T @ gram @ u)))
    return math.sqrt(best)


def test_vector_contributions_can_beat_signs():
    """``X = C^T C`` with mixed signs such that no sign vector makes every cross term positive: vectors at wide
    angles do better (measured: 3.187 against 3.072). The code's upper bound (the monotone majorant) covers them."""
    coefs, n = [1.0, 0.8, 0.0, -0.4], 4
    c = toeplitz.materialize(coefs, n)
    scalar, absolute = brute_force(c, 1, n)
    vector = vector_sensitivity(c, 1, n)
    assert vector > scalar * 1.03 and absolute >= vector * (1 - 1e-12)
    assert not sensitivity.minsep_sensitivity_is_exact(coefs, n, 1)
    assert sensitivity.minsep_sensitivity(coefs, n, 1) >= vector * (1 - 1e-12)


@pytest.mark.parametrize("min_sep", [1, 2, 3])
@pytest.mark.parametrize("cap", [None, 2])
def test_code_covers_the_vector_case(min_sep, cap):
    """Exact cases equal the directly maximised vector sensitivity; the others are at least it (n = 7)."""
    rng = np.random.default_rng(20 + min_sep)
    n = 7
    k = sensitivity.participation_count(n, min_sep, cap)
    cases = [
        np.concatenate([[1.0], rng.normal(size=min_sep - 1)]),  # band <= min_sep, any signs
        [1.0, 0.7, 0.7, 0.3, 0.1],  # non-negative, non-increasing
        np.concatenate([[1.0], -np.abs(rng.normal(size=4))]),  # negative tail: X has negative entries
        rng.normal(size=6),  # anything
    ]
    for coefs in cases:
        vector = vector_sensitivity(toeplitz.materialize(coefs, n), min_sep, k)
        value = sensitivity.minsep_sensitivity(coefs, n, min_sep, cap)
        assert value >= vector * (1 - 1e-9)
        if sensitivity.minsep_sensitivity_is_exact(coefs, n, min_sep):
            assert value == pytest.approx(vector, rel=1e-9)


@pytest.mark.parametrize("min_sep", [1, 2, 3])
@pytest.mark.parametrize("cap", [None, 2])
def test_monotone_toeplitz_is_exact(min_sep, cap):
    for coefs in ([1.0, 0.8, 0.5, 0.45, 0.2, 0.1], BufferedToeplitz((0.9, 0.4), (0.3, 0.2)).toeplitz_coefs(N)):
        k = sensitivity.participation_count(N, min_sep, cap)
        scalar, absolute = brute_force(toeplitz.materialize(coefs, N), min_sep, k)
        value = sensitivity.minsep_sensitivity(coefs, N, min_sep, cap)
        assert sensitivity.minsep_sensitivity_is_exact(coefs, N, min_sep)
        assert value == pytest.approx(scalar, rel=1e-12) and value == pytest.approx(absolute, rel=1e-12)


@pytest.mark.parametrize("min_sep", [1, 2, 3])
def test_other_toeplitz_is_an_upper_bound(min_sep):
    rng = np.random.default_rng(10 + min_sep)
    for _ in range(5):
        coefs = np.concatenate([[1.0], rng.normal(size=6)])
        k = sensitivity.participation_count(N, min_sep)
        c = toeplitz.materialize(coefs, N)
        scalar, absolute = brute_force(c, min_sep, k)
        value = sensitivity.minsep_sensitivity(coefs, N, min_sep)
        assert not sensitivity.minsep_sensitivity_is_exact(coefs, N, min_sep)
        assert value >= absolute * (1 - 1e-12) and absolute >= scalar * (1 - 1e-12)
        assert sensitivity.dense_minsep_sensitivity_upper_bound(c, min_sep) >= absolute * (1 - 1e-12)


def test_single_participation_is_the_coefficient_norm():
    coefs = [1.0, -0.4, 0.3]
    assert sensitivity.minsep_sensitivity(coefs, 12, 1, 1) == pytest.approx(np.linalg.norm(coefs))
    assert sensitivity.minsep_sensitivity([1.0], 12, 1) == pytest.approx(math.sqrt(12))  # DP-SGD, every step


def test_participation_count_and_patterns():
    assert sensitivity.participation_count(10, 3) == 4 and sensitivity.participation_count(10, 3, 2) == 2
    assert sensitivity.max_over_patterns([5.0, 1.0, 5.0, 1.0], 2) == 10.0
    assert sensitivity.max_over_patterns([5.0, 1.0, 5.0, 1.0], 3) == 6.0
    assert sensitivity.max_over_patterns([-1.0, -2.0], 1) == 0.0
    with pytest.raises(ValueError, match="min_sep must be an integer >= 1"):
        sensitivity.minsep_sensitivity([1.0], 5, 0)
    with pytest.raises(ValueError, match="max_participations must be an integer >= 1"):
        sensitivity.minsep_sensitivity([1.0], 5, 1, 0)
