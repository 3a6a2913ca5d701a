"""Run the test suite against the lowest versions that pyproject.toml accepts of the libraries whose APIs
lightning_dp builds on, so that those lower bounds are tested claims.

Usage (from the repository root): ``python scripts/floor_versions.py [--venv PATH] [PYTEST ARGS...]``, e.g.
``python scripts/floor_versions.py -q -n 2``. It creates a fresh virtual environment (``--venv``, emptied first)
that also sees this interpreter's packages, after its own (a ``.pth`` file adds this interpreter's site-packages, so
that every other package is the one this interpreter has, whether or not it is itself a virtual environment),
installs each package of :data:`FLOORED` there at the version its ``>=`` bound in pyproject.toml names (with the
build-system requirements, for the tests that build the package without isolation), prints the versions it got,
and runs ``python -m pytest`` there on this checkout with the other arguments; the exit status is pytest's (a
failed install: pip's). Run by hand, not by CI.

torch is among them: where PyPI serves only its CUDA build (Linux x86_64), that is what the environment gets (several
GB with the NVIDIA libraries it needs; the suite runs on the CPU all the same). numpy, scipy and scikit-learn are not,
as their compiled dependants in the environment (pandas, pyarrow) are built against the installed numpy.
"""

from __future__ import annotations

import argparse
import os
import re
import site
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

#: The distributions installed at their lower bound: lightning_dp subclasses or calls into their internals.
FLOORED = ("torch", "lightning", "transformers", "accelerate", "peft", "dp-accounting", "jsonargparse")

#: A quoted requirement with a lower bound: ``"name[extras]>=version..."`` (the project's and its extras' lists).
_REQUIREMENT = re.compile(r'"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s"]*)')


def floors(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """``{distribution: requirement at its floor}`` for each of :data:`FLOORED`, from the quoted ``>=`` bounds of
    ``pyproject`` (its dependencies and optional dependencies; extras kept, e.g. ``jsonargparse[signatures]==4.51``).

    Raises:
        ValueError: a distribution of :data:`FLOORED` has no ``>=`` bound there, or two different ones.
    """
    found: dict[str, str] = {}
    for match in _REQUIREMENT.finditer(pyproject.read_text(encoding="utf-8")):
        if match.group(1).lower() not in FLOORED:
            continue
        name, extras, version = match.group(1).lower(), match.group(2) or "", match.group(3)
        pinned = f"{name}{extras}=={version}"
        if found.setdefault(name, pinned).split("==")[1] != version:
            raise ValueError(f"{name} has two lower bounds in {pyproject.name}: {found[name]} and {pinned}")
    missing = [name for name in FLOORED if name not in found]
    if missing:
        raise ValueError(f"no '>=' bound in {pyproject.name} for {', '.join(missing)}")
    return found


def main(argv: list[str]) -> int:
    """Create the environment, install the floors, run pytest; pytest's exit status."""
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--venv", type=Path, default=Path("/tmp/lightning_dp_floor_versions"))
    args, pytest_args = parser.parse_known_args(argv)
    pinned = floors()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(args.venv)], check=True)
    python = str(args.venv / "bin" / "python")
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, stdout=subprocess.PIPE, text=True,
    ).stdout.strip()  # fmt: skip
    parents = "".join(f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages())
    Path(own, "zz_parent_site_packages.pth").write_text(parents, encoding="utf-8")
    # the build backend at the version pyproject.toml asks for (the venv's own setuptools may be older), for the tests
    # that build the package without isolation
    build = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["build-system"]["requires"]
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", *pinned.values(), *build])
    if install.returncode:
        return install.returncode
    versions = subprocess.run(
        [python, "-c", "import importlib.metadata as m, sys; print(*(f'{d} {m.version(d)}' for d in sys.argv[1:]))",
         *pinned],
        check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    print(f"floors: {versions.stdout.strip()}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([python, "-m", "pytest", *pytest_args], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
