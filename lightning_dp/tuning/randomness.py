"""The dedicated random stream of a private search: the number of candidates ``K`` and each candidate's
hyper-parameters, never from the global RNG (docs/design.md section 3.4)."""

from __future__ import annotations

import numpy as np

from lightning_dp.runtime.randomness import derive_seed, os_seed


class SearchRandomness:
    """Uniform draws for a search.

    Args:
        seed: a seed for experiments (a known seed lets anyone recompute ``K`` and the draws, which voids the
            guarantee); ``None`` takes 64 bits of OS entropy once.
        secure: reseed from fresh OS entropy (:func:`os_seed`) at every draw, as
            :class:`~lightning_dp.runtime.randomness.DPRandomness` does for noise in secure mode.

    Raises:
        ValueError: a ``seed`` with ``secure=True``.
    """

    def __init__(self, seed: int | None = None, *, secure: bool = False) -> None:
        if secure and seed is not None:
            raise ValueError(f"secure_mode draws from the OS CSPRNG and takes no seed, got seed={seed}")
        self.secure = secure
        self.seed = seed
        self._generator = (
            None if secure else np.random.default_rng(derive_seed(os_seed() if seed is None else seed, "search"))
        )

    def _stream(self) -> np.random.Generator:
        return self._generator or np.random.default_rng(os_seed())

    def uniform(self) -> float:
        """One draw of ``U[0, 1)``."""
        return float(self._stream().random())

    def index(self, size: int) -> int:
        """One index drawn uniformly from ``range(size)``."""
        return int(self._stream().integers(size))

    def candidate_seed(self, index: int) -> int | None:
        """The seed of candidate ``index``'s own run: 32 bits (as ``numpy`` and Lightning's ``seed_everything`` take)
        derived from the search's seed when it has one (distinct per candidate, so the repetitions are independent
        runs), else ``None`` (the run draws its own OS entropy)."""
        return None if self.seed is None else derive_seed(self.seed, "candidate", index) >> 31
