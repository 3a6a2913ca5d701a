"""Empirical privacy auditing: a lower bound on the epsilon of a DP training run, with a stated confidence.

One training run (Steinke, Nasr & Jagielski 2023) with gradient canaries (white-box, Nasr et al. 2023; added after
clipping, or canary examples clipped by the run's clipper) or input canaries (loss scores); the classic many-run
audit (Jagielski et al. 2020) for small models; and TEST-ONLY controls that break a run's noise or its clipping so
the audit can be shown to fail when it should. See docs/audit.md.
"""

from lightning_dp.audit.callback import (
    ClippedGradientCanaryAudit,
    GradientCanaryAudit,
    ScaleClippingForTesting,
    ScaleNoiseForTesting,
)
from lightning_dp.audit.clipped import ClippedGradientCanaries, per_sample_loss_with_canaries
from lightning_dp.audit.controls import NoiseScaledForTesting, scale_clipping_for_testing
from lightning_dp.audit.gradient import GradientCanaries
from lightning_dp.audit.inputs import InputCanaries
from lightning_dp.audit.one_run import (
    OneRunAudit,
    audit_scores,
    count_correct_guesses,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from lightning_dp.audit.report import AuditReport
from lightning_dp.audit.runner import AuditConfig, run_audit

__all__ = [
    "AuditConfig",
    "AuditReport",
    "ClippedGradientCanaries",
    "ClippedGradientCanaryAudit",
    "GradientCanaries",
    "GradientCanaryAudit",
    "InputCanaries",
    "NoiseScaledForTesting",
    "OneRunAudit",
    "ScaleClippingForTesting",
    "ScaleNoiseForTesting",
    "audit_scores",
    "count_correct_guesses",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
    "per_sample_loss_with_canaries",
    "run_audit",
    "scale_clipping_for_testing",
]
