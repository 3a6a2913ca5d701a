"""Where the ``lightning_dp`` logger's lines go when nobody set up logging.

The start-up block and the progress lines are INFO records; in a script that configures no logging, Python shows
only warnings (its last-resort handler). As Lightning does for its own logger, :func:`show_info_lines` then gives
the ``lightning_dp`` logger a handler on stderr and the INFO level; once the root logger has a handler (a
``logging.basicConfig`` made later) both are handed back, so that set-up decides, with no line printed twice. A
user's own set-up (a handler on the root logger or on ``lightning_dp``, or a level set on ``lightning_dp``) is
left as it is.
"""

from __future__ import annotations

import logging


class ConsoleFormatter(logging.Formatter):
    """INFO lines as the bare message; warnings and errors prefixed by their level (``warning: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno <= logging.INFO else f"{record.levelname.lower()}: {message}"


class _UntilConfigured(logging.Filter):
    """Hands ``logger`` back once the root logger has a handler (a ``logging.basicConfig`` made later): removes the
    stderr handler and this filter, resets the level it set, and lets the record through only if the level now
    allows it (so ``basicConfig(level=logging.WARNING)`` hides the INFO lines, as for any other logger)."""

    def __init__(self, logger: logging.Logger, handler: logging.Handler, set_level: bool) -> None:
        super().__init__()
        self.logger, self.handler, self.set_level = logger, handler, set_level

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.getLogger().handlers:
            return True
        self.logger.removeHandler(self.handler)
        self.logger.removeFilter(self)
        if self.set_level and self.logger.level == logging.INFO:
            self.logger.setLevel(logging.NOTSET)
        return record.levelno >= self.logger.getEffectiveLevel()


def show_info_lines(logger: logging.Logger) -> None:
    """Make ``logger``'s INFO lines visible on stderr when no handler would show them: when neither ``logger`` nor
    an ancestor (the root logger included) has a handler, add one (formatted by :class:`ConsoleFormatter`) and, if
    ``logger`` has no level of its own, set it to INFO. Once the root logger gets a handler, both are undone
    (:class:`_UntilConfigured`). Does nothing otherwise, and nothing the second time."""
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(ConsoleFormatter("%(message)s"))
    logger.addHandler(handler)
    set_level = logger.level == logging.NOTSET
    if set_level:
        logger.setLevel(logging.INFO)
    logger.addFilter(_UntilConfigured(logger, handler, set_level))
