"""Two lines of Lightning's own output that a DP run's log is better without, dropped once a DP strategy exists
(and by the ``lightning-dp`` commands). This module imports nothing of Lightning.

- Lightning's advert for its cloud logger (``"💡 Tip: For seamless cloud logging ... litlogger"``), logged at INFO
  whenever a Trainer has no such logger: an advert, not information about the run.
- ``"`isinstance(treespec, LeafSpec)` is deprecated"``, which Lightning's own ``_pytree`` helper triggers in torch
  at every step: nothing a user can act on.

Only these two exact messages are dropped; every other line of Lightning's output, warnings included, is kept.
"""

from __future__ import annotations

import logging
import warnings

#: The start of Lightning's cloud-logger advert.
ADVERT = "💡 Tip: For seamless cloud logging"
#: The deprecation message torch gives for Lightning's ``_pytree`` helper (a regular expression, as ``warnings`` takes).
PYTREE_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _DropAdvert(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(ADVERT)


def drop_lightning_noise() -> None:
    """Drop the two messages (idempotent): a filter on Lightning's rank-zero logger and a ``warnings`` filter."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvert) for f in logger.filters):
        logger.addFilter(_DropAdvert())
    warnings.filterwarnings("ignore", message=PYTREE_DEPRECATION)
