"""The package as it would be published: one version number, and a wheel that holds the package, its ``py.typed``
marker and every file of ``lightning_dp/`` (a data file the code loads from its own folder included), but no tests.

The wheel is built from a copy of the files a build reads (the top-level files and ``lightning_dp/``), so that a
``build/`` folder left in the checkout by an earlier build cannot add stale modules. ``.ci/run`` builds the sdist too,
runs ``twine check`` and imports the installed wheel in a fresh virtual environment.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser

import pytest
from process_helpers import ROOT, repository_files

import lightning_dp

PACKAGE = "lightning_dp"


def test_the_version_is_written_once() -> None:
    """``pyproject.toml`` reads the version from ``lightning_dp.__version__`` instead of holding a number."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', text, re.MULTILINE)
    assert re.search(r'^version = { attr = "lightning_dp.__version__" }$', text, re.MULTILINE)
    assert not re.search(r"^version = [\"']", text, re.MULTILINE)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    pytest.importorskip("build", reason="the packaging check needs the dev extra (pip install -e '.[dev]')")
    files = [name for name in repository_files() if "/" not in name or name.startswith(f"{PACKAGE}/")]
    if not files:
        pytest.skip("the wheel test needs git to list the repository's files")
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    command = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = dist.glob("*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_the_package_and_its_typing_marker_but_no_tests(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert f"{PACKAGE}/py.typed" in names
    assert {name.split("/")[0] for name in names} == {PACKAGE, f"{PACKAGE}-{lightning_dp.__version__}.dist-info"}
    tracked = {name for name in repository_files() if name.startswith(f"{PACKAGE}/")}
    assert tracked - names == set()  # every module, and every data file the code could load from its folder


def test_the_wheel_metadata_carries_the_version_licence_and_command(wheel: zipfile.ZipFile) -> None:
    info = f"{PACKAGE}-{lightning_dp.__version__}.dist-info"
    metadata = Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
    assert metadata["Version"] == lightning_dp.__version__
    assert metadata["License-Expression"] == "Apache-2.0" and f"{info}/licenses/LICENSE" in wheel.namelist()
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert "lightning-dp = lightning_dp.cli.main:main" in wheel.read(f"{info}/entry_points.txt").decode()
