"""The end-of-run report of a DP run: one warning per thing that happened to the private data and that no step
raised for (docs/privacy.md, "Non-finite losses and gradients" and "Run-time checks"). Statements about the private
data, outside the guarantee; no count is kept or released."""

from __future__ import annotations

import logging

log = logging.getLogger("lightning_dp")

DROPPED_WARNING = (
    "Some examples had a non-finite loss or gradient and were left out of the clipped sum on the steps that sampled "
    "them (no count is kept). This message is about the private data and is not covered by the privacy guarantee: "
    "keep it, like the training loss, out of published logs"
)
POSTPONED_WARNING = (
    "The per-sample sum check was due on a batch with non-finite examples and did not run after it: a parameter used "
    "outside its layer would not have been seen (it loses that gradient; it never leaks). Remove the examples whose "
    "loss is not finite"
)
UNRESOLVED_WARNING = (
    "A batch-independence or leave-half-out check was inconclusive on its last batch (a non-finite loss) and did not "
    "conclude before the end: mixing of examples was not ruled out for the steps after the last conclusive check. "
    "This message is about the private data and is not covered by the privacy guarantee: keep it out of published logs"
)


def log_end_of_run(dropped: bool, postponed: bool, unresolved: bool) -> None:
    """Log the warning of each flag that is set (the flags already OR-ed over the ranks): examples dropped for a
    non-finite loss or gradient, a sum check postponed by them that never ran again, a batch-independence check left
    inconclusive."""
    for flag, message in ((dropped, DROPPED_WARNING), (postponed, POSTPONED_WARNING), (unresolved, UNRESOLVED_WARNING)):
        if flag:
            log.warning(message)
