"""Drop three exact lines of Lightning's output (its cloud-logger and checkpoint-upload adverts, and the ``LeafSpec``
deprecation warning) once a DP strategy exists; imports nothing of Lightning.
"""

from __future__ import annotations

import logging
import warnings

#: The starts of Lightning's adverts: for its cloud logger (``litlogger``) and its model registry (``litmodels``).
ADVERTS = ("💡 Tip: For seamless cloud logging", "💡 Tip: For seamless cloud uploads")
#: The deprecation message torch gives for Lightning's ``_pytree`` helper (a regular expression, as ``warnings`` takes).
PYTREE_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _DropAdvert(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(ADVERTS)


def drop_lightning_noise() -> None:
    """Drop the three messages (idempotent): a filter on Lightning's rank-zero logger and a ``warnings`` filter."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvert) for f in logger.filters):
        logger.addFilter(_DropAdvert())
    warnings.filterwarnings("ignore", message=PYTREE_DEPRECATION)
