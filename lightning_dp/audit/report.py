"""The audit's result next to the epsilon the run reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_dp.audit.one_run import OneRunAudit, audit_scores
from lightning_dp.engine.privacy_engine import PrivacyEngine


@dataclass(frozen=True)
class AuditReport:
    """An empirical epsilon lower bound and the epsilon the accountant printed for the same run.

    Attributes:
        reported_epsilon: the accountant's epsilon at ``audit.delta`` after the run.
        audit: the one-run audit (bound, confidence, guesses).
        noise: the mechanism's name; steps: optimizer steps taken; mode: ``"gradient"``, ``"clipped-gradient"`` or
            ``"input"`` canaries.
        clipping: the clipping engine that ran (the resolved one when the run asked for ``"auto"``).
    """

    reported_epsilon: float
    audit: OneRunAudit
    noise: str
    steps: int
    mode: str
    clipping: str

    @property
    def violated(self) -> bool:
        """True when the audit's lower bound exceeds the reported epsilon: at the stated confidence, the run is
        NOT as private as reported."""
        return self.audit.epsilon_lower_bound > self.reported_epsilon

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON-friendly dictionary."""
        return {
            "mode": self.mode,
            "noise": self.noise,
            "clipping": self.clipping,
            "steps": self.steps,
            "reported_epsilon": self.reported_epsilon,
            **asdict(self.audit),
            "violated": self.violated,
        }


def report_for(
    engine: PrivacyEngine,
    scores: Any,
    included: Any,
    mode: str,
    confidence: float,
    guess_sets: Sequence[tuple[int, int]] | None,
) -> AuditReport:
    """The one-run audit of ``scores`` at the run's ``target_delta``, next to the run's reported epsilon."""
    audit = audit_scores(scores, included, delta=engine.target_delta, confidence=confidence, guess_sets=guess_sets)
    return AuditReport(engine.epsilon(), audit, engine.mechanism.name, engine.steps, mode, engine.clipping)
