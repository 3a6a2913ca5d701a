"""Correlated-noise strategies: lower-triangular Toeplitz matrices ``C`` of the matrix mechanism.

The matrix mechanism releases ``B (C G + Z)`` for the workload ``A = B C`` (Denisov et al. 2022; Kairouz et
al. 2021): the noise added to the gradient of step ``t`` is ``(C^{-1} Z)_t``. Both strategies here keep
``c_0 = 1`` (the scale of ``C`` is carried by its sensitivity, so this loses nothing: the error times the squared
sensitivity is invariant to scaling ``C``).

- :class:`BandedToeplitz`: ``b``-banded, ``c_0 = 1, c_1..c_{b-1}``, ``c_k = 0`` for ``k >= b`` (Choquette-Choo et
  al. 2023). ``b = 1`` is ``C = I``: DP-SGD.
- :class:`BufferedToeplitz` (BLT): ``c_0 = 1`` and ``c_k = sum_j w_j theta_j^(k-1)`` for ``k >= 1``, with ``d``
  buffer decays ``theta_j`` and output scales ``w_j`` (Dvijotham et al. 2024, and McMahan et al. 2024, in
  this parameterisation). Its inverse is again a BLT (:meth:`BufferedToeplitz.inverse`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lightning_dp.correlated_noise import toeplitz


def _floats(values: Sequence[float] | np.ndarray, what: str) -> tuple[float, ...]:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} must be finite, got {array.tolist()}")
    return tuple(float(v) for v in array)


@dataclasses.dataclass(frozen=True)
class BandedToeplitz:
    """The ``b``-banded lower-triangular Toeplitz strategy with coefficients ``coefs = (1, c_1, ..., c_{b-1})``.

    Hashable and immutable (the optimiser's cache returns it). Source: Choquette-Choo et al. 2023 (banded
    matrix factorization); streaming ``C^{-1}`` by forward substitution, their Algorithm 9.

    Args:
        coefs: the ``b >= 1`` leading Toeplitz coefficients; ``coefs[0]`` must be 1.

    Raises:
        ValueError: empty or non-finite ``coefs``, or ``coefs[0] != 1``.
    """

    coefs: tuple[float, ...]

    def __post_init__(self) -> None:
        coefs = _floats(self.coefs, "banded Toeplitz coefficients")
        if not coefs:
            raise ValueError("a banded strategy needs at least one coefficient (band b >= 1); pass coefs=(1.0,)")
        if coefs[0] != 1.0:
            raise ValueError(
                f"coefs[0] must be 1 (the scale of C is carried by its sensitivity), got {coefs[0]}; "
                "pass coefs / coefs[0]"
            )
        object.__setattr__(self, "coefs", coefs)

    @classmethod
    def identity(cls) -> BandedToeplitz:
        """``C = I`` (band 1): DP-SGD's independent noise."""
        return cls((1.0,))

    @property
    def band(self) -> int:
        """The number of bands ``b`` (``c_k = 0`` for ``k >= b``)."""
        return len(self.coefs)

    @property
    def num_buffers(self) -> int:
        """Model-sized tensors the streaming noise keeps: ``b - 1``."""
        return self.band - 1

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        """The first column of ``C`` (``n x n``): shape ``[n]``, float64."""
        return toeplitz.pad_coefs(self.coefs, n)

    def inverse_coefs(self, n: int) -> np.ndarray:
        """The first column of ``C^{-1}`` (not banded in general): shape ``[n]``."""
        return toeplitz.inverse_coefs(self.coefs, n)

    def dense(self, n: int) -> np.ndarray:
        """``C`` as a dense ``[n, n]`` array (tests and small ``n``)."""
        return toeplitz.materialize(self.coefs, n)

    def inverse_dense(self, n: int) -> np.ndarray:
        """``C^{-1}`` as a dense ``[n, n]`` array."""
        return toeplitz.materialize(self.inverse_coefs(n), n)

    def column_norms(self, n: int) -> np.ndarray:
        """The l2 norms ``[n]`` of ``C``'s columns (non-increasing; the first is ``||coefs||``)."""
        return toeplitz.column_norms(self.coefs, n)


@dataclasses.dataclass(frozen=True)
class BufferedToeplitz:
    """A buffered-linear-Toeplitz (BLT) strategy: ``c_0 = 1``, ``c_k = sum_j scales[j] * decays[j]^(k-1)`` (``k >= 1``).

    With ``d`` buffers, ``C`` (and ``C^{-1}``, see :meth:`inverse`) is applied to a stream with ``d`` state vectors
    (Dvijotham et al. 2024; McMahan et al. 2024, Algorithms 2 and 3). Example, ``d = 2``::

        c_1 = w_1 + w_2,   c_2 = w_1 theta_1 + w_2 theta_2,   c_3 = w_1 theta_1^2 + w_2 theta_2^2, ...

    Args:
        decays: ``theta_j``, shape ``[d]``, ``d >= 1``.
        scales: ``w_j``, shape ``[d]``.

    Raises:
        ValueError: ``d < 1``, unequal lengths, or non-finite values.
    """

    decays: tuple[float, ...]
    scales: tuple[float, ...]

    def __post_init__(self) -> None:
        decays = _floats(self.decays, "BLT buffer decays")
        scales = _floats(self.scales, "BLT output scales")
        if not decays:
            raise ValueError("a BLT strategy needs at least one buffer (d >= 1)")
        if len(decays) != len(scales):
            raise ValueError(f"BLT decays and scales must have the same length, got {len(decays)} and {len(scales)}")
        object.__setattr__(self, "decays", decays)
        object.__setattr__(self, "scales", scales)

    @property
    def num_buffers(self) -> int:
        """The number of buffers ``d`` (model-sized tensors the streaming noise keeps)."""
        return len(self.decays)

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        """The first column of ``C`` (``n x n``): shape ``[n]``, float64."""
        n = toeplitz.check_size(n)
        theta, w = np.asarray(self.decays), np.asarray(self.scales)
        powers = np.arange(n - 1)[:, None]
        return np.concatenate([[1.0], (w * theta**powers).sum(axis=1)])

    def inverse(self) -> BufferedToeplitz:
        """The BLT of ``C^{-1}`` (its Toeplitz coefficients equal :meth:`inverse_coefs` for every ``n``).

        Closed form, from the state-space realisation ``y_t = x_t + w^T s_t``, ``s_{t+1} = Theta s_t + 1 x_t``
        (``Theta = diag(theta)``) of ``y = C x``: solving for ``x_t`` gives ``x_t = y_t - w^T s_t``,
        ``s_{t+1} = (Theta - 1 w^T) s_t + 1 y_t``. Diagonalising ``Theta - 1 w^T = V diag(lambda) V^{-1}`` gives
        ``C^{-1}``'s decays ``lambda`` and scales ``-(V^T w) * (V^{-1} 1)`` (elementwise). By the matrix determinant
        lemma the ``lambda`` are the roots of ``1 + sum_j w_j / (lambda - theta_j) = 0``: real and interlacing with
        distinct ``theta`` when every ``w_j > 0`` (this derivation is ours; the test checks it against the dense
        inverse). That the inverse of a BLT is a BLT with as many buffers is Dvijotham et al. 2024, Section 5
        (Lemma 5.2; Proposition 5.6, the reciprocal of a rational generating function).

        Raises:
            ValueError: the decays are not distinct, or ``Theta - 1 w^T`` has complex eigenvalues (no real BLT).
        """
        theta, w = np.asarray(self.decays), np.asarray(self.scales)
        d = theta.size
        gaps = np.abs(theta[:, None] - theta[None, :])
        np.fill_diagonal(gaps, np.inf)
        if d > 1 and gaps.min() < 1e-9:
            raise ValueError(
                f"BLT decays must be distinct (gap >= 1e-9) to invert in closed form, got {theta.tolist()}"
            )
        state = np.diag(theta) - np.outer(np.ones(d), w)
        eigenvalues, vectors = np.linalg.eig(state)
        if np.max(np.abs(eigenvalues.imag)) > 1e-12 * max(1.0, float(np.max(np.abs(eigenvalues)))):
            raise ValueError(f"the inverse of this BLT has complex decays {eigenvalues.tolist()}; it is not a real BLT")
        vectors = vectors.real
        inv_scales = -(vectors.T @ w) * np.linalg.solve(vectors, np.ones(d))
        return BufferedToeplitz(tuple(eigenvalues.real), tuple(inv_scales))

    def inverse_coefs(self, n: int) -> np.ndarray:
        """The first column of ``C^{-1}``: shape ``[n]`` (by forward substitution, exact up to rounding)."""
        return toeplitz.inverse_coefs(self.toeplitz_coefs(n), n)

    def dense(self, n: int) -> np.ndarray:
        """``C`` as a dense ``[n, n]`` array (tests and small ``n``)."""
        return toeplitz.materialize(self.toeplitz_coefs(n), n)

    def inverse_dense(self, n: int) -> np.ndarray:
        """``C^{-1}`` as a dense ``[n, n]`` array."""
        return toeplitz.materialize(self.inverse_coefs(n), n)

    def column_norms(self, n: int) -> np.ndarray:
        """The l2 norms ``[n]`` of ``C``'s columns (non-increasing)."""
        return toeplitz.column_norms(self.toeplitz_coefs(n), n)

    def is_monotone(self) -> bool:
        """Whether ``C``'s coefficients are non-negative and non-increasing for every ``n``: true when every
        ``w_j >= 0``, ``0 <= theta_j <= 1`` and ``sum_j w_j <= 1`` (then ``c_1 <= c_0 = 1`` and each term decays). The
        min-separation sensitivity of :mod:`~lightning_dp.correlated_noise.sensitivity` is exact for such ``C``."""
        theta, w = np.asarray(self.decays), np.asarray(self.scales)
        return bool(np.all(w >= 0) and np.all(theta >= 0) and np.all(theta <= 1) and w.sum() <= 1.0)


Strategy = BandedToeplitz | BufferedToeplitz


def sqrt_prefix_coefs(n: int) -> np.ndarray:
    """The Toeplitz coefficients ``[n]`` of ``A^{1/2}`` for prefix sums ``A``: ``c_k = prod_{i=1..k} (2i - 1)/(2i)``,
    the series of ``(1 - x)^{-1/2}`` (Fichtenberger et al. 2023, Algorithm 1; optimal for max error under single
    participation, Dvijotham et al. 2024). Used to start the banded optimisation."""
    n = toeplitz.check_size(n)
    k = np.arange(1, n)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))]) if n > 1 else np.ones(1)


def check_band(band: int, n: int) -> int:
    """``band`` as an int; raises ``ValueError`` unless ``1 <= band <= n``."""
    message = f"band b must be an integer in [1, n={n}], got {band!r}"
    band = toeplitz.integer_at_least(band, 1, message)
    if band > n:
        raise ValueError(message)
    return band


def check_buffers(buffers: int) -> int:
    """``buffers`` as an int; raises ``ValueError`` unless it is ``>= 1``."""
    return toeplitz.integer_at_least(
        buffers, 1, f"the number of BLT buffers d must be an integer >= 1, got {buffers!r}"
    )
