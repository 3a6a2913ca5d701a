"""Lower-triangular Toeplitz matrices given by their first column, in NumPy float64.

An ``n x n`` lower-triangular Toeplitz matrix ``T`` has ``T[i, j] = t[i - j]`` for ``i >= j`` and 0 above the
diagonal; ``t`` (its first column, the Toeplitz coefficients) determines it. Products and inverses of such matrices
are again lower-triangular Toeplitz, so every function here works on coefficient vectors (the convention of Denisov
et al. 2022 and Choquette-Choo et al. 2023). Coefficients shorter than ``n`` are padded with zeros (a banded matrix);
longer ones are cut to ``n``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

ArrayLike = npt.ArrayLike | Sequence[float]


def integer_at_least(value: object, minimum: int, message: str) -> int:
    """``value`` as an int if it is an integer (an integral float included, a bool not) of at least ``minimum``;
    otherwise ``ValueError(message)``. The one check behind every integer argument of this package."""
    integral = isinstance(value, numbers.Integral) or (isinstance(value, numbers.Real) and float(value).is_integer())
    if isinstance(value, bool) or not integral or int(value) < minimum:  # type: ignore[call-overload]
        raise ValueError(message)
    return int(value)  # type: ignore[call-overload]


def check_size(n: int) -> int:
    """``n`` as an int; raises ``ValueError`` unless it is a positive integer."""
    return integer_at_least(n, 1, f"the number of steps n must be a positive integer, got {n!r}")


def pad_coefs(coefs: ArrayLike, n: int) -> np.ndarray:
    """The first ``n`` Toeplitz coefficients, zero-padded: shape ``[n]``, float64.

    Raises:
        ValueError: ``coefs`` is empty, not one-dimensional or not finite, or ``n < 1``.
    """
    n = check_size(n)
    array = np.asarray(coefs, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"Toeplitz coefficients must be a non-empty 1-D sequence, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        index = int(np.flatnonzero(~np.isfinite(array))[0])
        raise ValueError(f"Toeplitz coefficients must be finite, got {array[index]} at index {index}")
    out = np.zeros(n)
    m = min(n, array.size)
    out[:m] = array[:m]
    return out


def materialize(coefs: ArrayLike, n: int) -> np.ndarray:
    """The dense ``[n, n]`` lower-triangular Toeplitz matrix with first column ``coefs`` (for tests and small ``n``)."""
    t = pad_coefs(coefs, n)
    index = np.arange(n)[:, None] - np.arange(n)[None, :]
    return np.where(index >= 0, t[np.clip(index, 0, None)], 0.0)


def multiply(left: ArrayLike, right: ArrayLike, n: int) -> np.ndarray:
    """Coefficients ``[n]`` of the product ``L R`` of two lower-triangular Toeplitz matrices (a truncated
    convolution)."""
    return np.convolve(pad_coefs(left, n), pad_coefs(right, n))[:n]


def inverse_coefs(coefs: ArrayLike, n: int) -> np.ndarray:
    """Coefficients ``[n]`` of ``T^{-1}``, by forward substitution on ``T g = e_0``:
    ``g_0 = 1 / t_0``, ``g_k = -(sum_{j=1..k} t_j g_{k-j}) / t_0``; ``O(n * len(coefs))`` time.

    Raises:
        ValueError: ``coefs[0] == 0`` (``T`` is singular).
    """
    t = pad_coefs(coefs, n)
    if t[0] == 0:
        raise ValueError("the first Toeplitz coefficient must be non-zero (the matrix is singular)")
    width = int(np.flatnonzero(t)[-1]) + 1  # the band: t_j = 0 for j >= width
    g = np.zeros(n)
    g[0] = 1.0 / t[0]
    for k in range(1, n):
        hi = min(k, width - 1)  # g_k = -(sum_{j=1..hi} t_j g_{k-j}) / t_0
        g[k] = -np.dot(t[1 : hi + 1], g[k - hi : k][::-1]) / t[0]
    return g


def column_norms(coefs: ArrayLike, n: int) -> np.ndarray:
    """The l2 norms ``[n]`` of the columns of the ``n x n`` matrix: column ``i`` holds ``t_0..t_{n-1-i}``, so its norm
    is ``sqrt(sum_{k < n - i} t_k^2)``, non-increasing in ``i``."""
    t = pad_coefs(coefs, n)
    return np.sqrt(np.cumsum(t**2))[::-1].copy()
