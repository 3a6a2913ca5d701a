"""Where the ``lightning_dp`` logger's INFO lines go when nobody set up logging: stderr, until the root logger gets a
handler (:func:`show_info_lines`); a user's own logging set-up is left as it is.
"""

from __future__ import annotations

import logging


class ConsoleFormatter(logging.Formatter):
    """INFO lines as the bare message; warnings and errors prefixed by their level (``warning: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno <= logging.INFO else f"{record.levelname.lower()}: {message}"


class _UntilConfigured(logging.Filter):
    """Hands ``logger`` back once the root logger has a handler: removes the stderr handler and this filter, resets the
    level, and passes the record only if the level now allows it.
    """

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
    """Make ``logger``'s INFO lines visible on stderr when neither it nor an ancestor has a handler (a handler formatted
    by :class:`ConsoleFormatter`, and INFO if it has no level), undone once the root logger gets a handler; idempotent.
    """
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(ConsoleFormatter("%(message)s"))
    logger.addHandler(handler)
    set_level = logger.level == logging.NOTSET
    if set_level:
        logger.setLevel(logging.INFO)
    logger.addFilter(_UntilConfigured(logger, handler, set_level))
