"""Where the ``lightning_dp`` logger's lines go when nobody set up logging.

The start-up block and the progress lines are INFO records; in a script that configures no logging, Python shows
only warnings (its last-resort handler). As Lightning does for its own logger, :func:`show_info_lines` then gives
the ``lightning_dp`` logger a handler on stderr; it writes only while the root logger has no handler, so a
``logging.basicConfig`` made later takes over without printing any line twice. A user's own set-up (a handler on
the root logger or on ``lightning_dp``, or a level set on ``lightning_dp``) is left as it is.
"""

from __future__ import annotations

import logging


class ConsoleFormatter(logging.Formatter):
    """INFO lines as the bare message; warnings and errors prefixed by their level (``warning: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno <= logging.INFO else f"{record.levelname.lower()}: {message}"


class _UntilConfigured(logging.StreamHandler):
    """A stderr handler that writes only while the root logger has no handler."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def show_info_lines(logger: logging.Logger) -> None:
    """Make ``logger``'s INFO lines visible on stderr when no handler would show them: when neither ``logger`` nor
    an ancestor (the root logger included) has a handler, add one (formatted by :class:`ConsoleFormatter`) and, if
    ``logger`` has no level of its own, set it to INFO. Does nothing otherwise, and nothing the second time."""
    if logger.hasHandlers():
        return
    handler = _UntilConfigured()
    handler.setFormatter(ConsoleFormatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
