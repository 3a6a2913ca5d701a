"""The calls users make to read the privacy spent, the same on the Lightning strategies and on ``DPTrainer``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dp.engine.privacy_engine import PrivacyEngine


class PrivacyQueries:
    """The queries of :class:`~lightning_dp.engine.adapter.TrainerAdapter` for an object that holds a
    ``privacy_engine``: a base class of every adapter (``DPStrategy``, ``DPDDPStrategy``, ``DPModelParallelStrategy``,
    ``DPTrainer``), so they answer alike."""

    privacy_engine: PrivacyEngine

    @property
    def sample_rate(self) -> float | None:
        """The run's Poisson rate q (known once the training loader is built)."""
        return self.privacy_engine.loader_sample_rate

    @property
    def num_samples(self) -> int | None:
        """The training set's size N (known once the training loader is built)."""
        return self.privacy_engine.num_samples

    @property
    def last_clip_fraction(self) -> float | None:
        """Fraction of the last clipped pass's examples whose norm exceeded ``max_grad_norm`` (diagnostic only)."""
        return self.privacy_engine.last_clip_fraction

    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far (this run and the runs it resumed), as Opacus's ``PrivacyEngine.get_epsilon``.

        Args:
            delta: the delta of the guarantee; default the run's ``target_delta``; ignored by pure-DP accountants.

        Returns:
            Epsilon (0.0 before the first step, ``inf`` without noise).
        """
        return self.privacy_engine.epsilon(delta)

    def privacy_summary(self) -> dict[str, Any]:
        """The run's privacy state (:meth:`~lightning_dp.engine.accounting.PrivacyLedger.summary`).

        Raises:
            RuntimeError: before training started.
        """
        engine = self.privacy_engine
        if engine.accountant is None or engine.mechanism is None:
            raise RuntimeError("no privacy state yet: the summary exists once training has started")
        return engine.summary()
