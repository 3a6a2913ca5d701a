"""The optional extras of ``lightning_dp`` (``pip install -e ".[hf]"``), read from the installed package's metadata, and
errors that name the extra to install when an optional package is missing.

:func:`require_extra` refuses up front when a distribution of an extra is not installed (the examples, some of whose
packages are imported late: Lightning's ``TensorBoardLogger`` imports tensorboard when it is built);
:func:`needs_extra` turns a ``ModuleNotFoundError`` raised within into one that names the extra.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

PACKAGE = "lightning_dp"

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[([^\]]*)\])?")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def normalise(name: str) -> str:
    """A distribution's or module's name as PEP 503 compares them (``rouge_score`` and ``rouge-score``: the same)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_requirements(extra: str, requires: Iterable[str] | None = None) -> set[str]:
    """The distributions (normalised names) that ``extra`` installs, with those of the ``lightning_dp[other]`` extras
    it names; ``requires`` are the package's requirement strings (default: the installed package's metadata, empty
    when it is not installed)."""
    if requires is None:
        try:
            requires = importlib.metadata.requires(PACKAGE) or []
        except importlib.metadata.PackageNotFoundError:
            requires = []
    requires = list(requires)
    names: set[str] = set()
    for requirement in requires:
        marker = _EXTRA.search(requirement.partition(";")[2])
        match = _NAME.match(requirement)
        if marker is None or marker.group(1) != extra or match is None:
            continue
        if normalise(match.group(1)) == normalise(PACKAGE):
            for other in (match.group(2) or "").split(","):
                names |= extra_requirements(other.strip(), requires)
        else:
            names.add(normalise(match.group(1)))
    return names


def install_line(extra: str) -> str:
    """The command that installs ``extra`` in a clone of the repository."""
    return f'pip install -e ".[{extra}]"'


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def require_extra(extra: str, what: str, requires: Iterable[str] | None = None) -> None:
    """Raise unless every distribution of ``extra`` is installed (nothing to check when the package's metadata is not
    installed).

    Raises:
        ModuleNotFoundError: ``"WHAT needs the 'EXTRA' extra (tensorboard is not installed): pip install -e
            ".[EXTRA]""``; its ``name`` is the first missing distribution.
    """
    missing = sorted(name for name in extra_requirements(extra, requires) if not _installed(name))
    if missing:
        are = "is" if len(missing) == 1 else "are"
        raise ModuleNotFoundError(
            f"{what} needs the {extra!r} extra ({', '.join(missing)} {are} not installed): {install_line(extra)}",
            name=missing[0],
        )


@contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Re-raise a ``ModuleNotFoundError`` raised within, for a package that ``extra`` installs, as one naming the
    extra and its install line (``"lightning_dp.hf needs the 'hf' extra (No module named 'transformers'): ..."``);
    any other error passes unchanged."""
    try:
        yield
    except ModuleNotFoundError as error:
        top = (error.name or "").partition(".")[0]
        if not top or normalise(top) not in extra_requirements(extra):
            raise
        raise ModuleNotFoundError(
            f"{what} needs the {extra!r} extra ({error}): {install_line(extra)}", name=error.name
        ) from error
