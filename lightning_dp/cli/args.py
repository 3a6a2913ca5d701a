"""What every ``lightning-dp`` subcommand shares: its argument parser, typed options, and one error handler (bad input
is one ``lightning-dp CMD: error: ...`` line with exit code 2; ``LIGHTNING_DP_TRACEBACK=1`` re-raises).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from lightning_dp.runtime.console import ConsoleFormatter
from lightning_dp.utils.help_format import HelpFormatter
from lightning_dp.utils.lightning_log_filter import drop_lightning_noise
from lightning_dp.utils.naming import Naming, did_you_mean

#: Exit code of every usage or invalid-value error (as argparse's own).
USAGE_ERROR = 2


def error_line(prog: str, err: BaseException | str) -> str:
    """``"PROG: error: MESSAGE"`` on one line (a multi-line message is joined with spaces)."""
    return f"{prog}: error: {' '.join(str(err).split())}"


def report(prog: str, err: BaseException | str, code: int = USAGE_ERROR) -> int:
    """Print :func:`error_line` to stderr and return ``code`` (re-raise ``err`` if ``LIGHTNING_DP_TRACEBACK=1``)."""
    if isinstance(err, BaseException) and os.environ.get("LIGHTNING_DP_TRACEBACK") == "1":
        raise err
    print(error_line(prog, err), file=sys.stderr)
    return code


def guarded(prog: str, run: Callable[[], int]) -> int:
    """Run a subcommand; a ``ValueError`` (invalid value) becomes one error line and exit code 2, an
    ``ImportError`` (a missing optional extra) one error line and exit code 1."""
    try:
        return run()
    except ValueError as err:
        return report(prog, err)
    except ImportError as err:
        return report(prog, err, code=1)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line (no usage block) with exit code 2, and whose
    invalid values are reported under their flags (:meth:`run`).

    Args:
        aliases: a name the library's messages use -> the flag's name where they differ (``{"target_delta":
            "delta"}``: ``target_delta`` is reported as ``--delta``).
    """

    def __init__(
        self, prog: str, description: str | None = None, aliases: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)
        self.aliases = aliases or {}

    def error(self, message: str) -> NoReturn:
        print(error_line(self.prog, f"{message} (see {self.prog} --help)"), file=sys.stderr)
        raise SystemExit(USAGE_ERROR)

    def run(self, argv: list[str], body: Callable[[argparse.Namespace], None]) -> int:
        """Parse ``argv`` and run ``body(args)`` under :func:`guarded`; return the exit code. An invalid value's
        message names options by their flags and writes settings as flags (``--accountant rdp``;
        :class:`~lightning_dp.utils.naming.Naming`)."""
        args = self.parse_args(argv)
        flags = [flag for action in self._actions for flag in action.option_strings]

        def call() -> int:
            with Naming.of_flags(flags, self.aliases).applied():
                body(args)
            return 0

        return guarded(self.prog, call)


def choice(names: Iterable[str]) -> Callable[[str], str]:
    """An argparse ``type`` accepting one of ``names``, suggesting the closest for a misspelt one (use with
    ``metavar=metavar_of(names)``).
    """
    valid = tuple(names)

    def parse(value: str) -> str:
        if value not in valid:
            raise argparse.ArgumentTypeError(
                f"invalid choice {value!r}{did_you_mean(value, valid)}; choose from {', '.join(valid)}"
            )
        return value

    parse.__name__ = "choice"
    return parse


def metavar_of(names: Iterable[str]) -> str:
    """``{a,b,c}``, the metavar argparse shows for choices."""
    return "{" + ",".join(names) + "}"


def positive_int(value: str) -> int:
    """An argparse ``type``: an integer >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def positive_float(value: str) -> float:
    """An argparse ``type``: a finite float > 0."""
    number = float(value)
    if not 0.0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {value}")
    return number


def quiet_lightning() -> None:
    """Console output of ``demo`` and ``fit``: lightning_dp's INFO lines and all warnings, without Lightning's
    GPU/TPU/seed info lines (the Python API leaves the user's logging untouched).
    """
    import lightning.pytorch  # noqa: F401  (first: importing Lightning sets its loggers' levels and handlers)

    if not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(ConsoleFormatter("%(message)s"))
        logging.getLogger().addHandler(handler)
    logging.getLogger("lightning_dp").setLevel(logging.INFO)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    drop_lightning_noise()
