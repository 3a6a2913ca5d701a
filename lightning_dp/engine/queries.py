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
        """Epsilon spent so far (all optimizer steps of this run and of the runs it resumed), as Opacus's
        ``PrivacyEngine.get_epsilon``.

        Args:
            delta: the delta of the (epsilon, delta) guarantee; default the run's ``target_delta``. Ignored by the
                pure-DP accountants (Laplace).

        Returns:
            Epsilon (0.0 before the first step, ``inf`` when no noise is added).
        """
        return self.privacy_engine.epsilon(delta)

    def privacy_summary(self) -> dict[str, Any]:
        """The run's privacy state: epsilon and delta, the noise and its parameters, steps, sample rate, number of
        trainable parameters, accountant and clipping engine (what ``PrivacyAccountantCallback`` logs at the end).

        Raises:
            RuntimeError: before training started (no noise or accountant is fixed yet).
        """
        engine = self.privacy_engine
        if engine.accountant is None or engine.mechanism is None:
            raise RuntimeError("no privacy state yet: the summary exists once training has started")
        return engine.summary()
