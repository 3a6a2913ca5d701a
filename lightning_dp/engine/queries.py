"""The calls users make to read the privacy spent, the same on the Lightning strategies and on ``DPTrainer``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dp.engine.privacy_engine import PrivacyEngine


class PrivacyQueries:
    """``get_epsilon`` and ``privacy_summary`` for an object that holds a ``privacy_engine`` (``DPStrategy``,
    ``DPDDPStrategy``, ``DPModelParallelStrategy``, ``DPTrainer``)."""

    privacy_engine: PrivacyEngine

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
