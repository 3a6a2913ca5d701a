"""The docs site builds with warnings as errors, and a browser shows its navigation and the API reference.

One ``mkdocs build --strict`` for the module (15 to 30 s on 2 cores) into a temporary folder; the front page and
the API page are then opened in headless Chromium (Debian's ``chromium`` package, which ``.ci/run`` installs) and
checked in the DOM the browser built after running the theme's scripts: the navigation's sections, the README's
opening, and ``DPStrategy``'s docstring with a parameter. Chromium cannot be installed by pip, so the README's test
command, run on a machine without it, checks the same in the built HTML files instead (all but the theme's scripts
having run); under ``.ci/run`` (``LIGHTNING_DP_REQUIRE_BROWSER=1``) a missing Chromium fails the test. The generated
pages (API, privacy options, command line) are checked against the code in the built HTML.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the top-level sections of mkdocs.yml's navigation.
SECTIONS = ["Get started", "Guides", "Concepts", "Reference", "Benchmarks", "Design for contributors"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module with ``mkdocs build --strict`` (a warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-4000:]}"
    return out


#: set by .ci/run, where Debian's Chromium is installed: the browser's DOM is required, not the HTML file's.
BROWSER_REQUIRED = os.environ.get("LIGHTNING_DP_REQUIRE_BROWSER") == "1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browser_dom(page: Path, profile: Path) -> str:
    """The DOM of ``page`` after headless Chromium loaded it and ran its scripts (``--virtual-time-budget``); without
    Chromium (and not :data:`BROWSER_REQUIRED`), the built HTML file itself."""
    if CHROMIUM is None:
        assert not BROWSER_REQUIRED, "headless Chromium is needed (Debian: apt-get install chromium, as .ci/run does)"
        return page.read_text(encoding="utf-8")
    chromium = CHROMIUM
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
    flags += ["--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}"]
    run = subprocess.run(
        [chromium, *flags, "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and "</html>" in run.stdout, f"chromium failed on {page}:\n{run.stderr[-2000:]}"
    return run.stdout


def text_of(markup: str) -> str:
    """The visible text of HTML, whitespace collapsed (scripts and styles dropped)."""
    markup = re.sub(r"<(script|style)\b.*?</\1>", " ", markup, flags=re.DOTALL)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup)).split())


def test_front_page_shows_the_navigation_and_the_readme(site: Path, tmp_path: Path) -> None:
    dom = browser_dom(site / "index.html", tmp_path)
    if CHROMIUM is not None:
        assert re.search(r'<html[^>]*class="[^"]*\bjs\b', dom), "the theme's scripts did not run"
    nav = text_of(dom[dom.index('<nav class="md-nav md-nav--primary"') :])
    for section in SECTIONS:
        assert section in nav
    opening = (ROOT / "README.md").read_text(encoding="utf-8").split("\n\n")[1].split("`")[0]  # before any code
    assert " ".join(opening.split()) in text_of(dom)
    assert 'data-md-component="search-query"' in dom


def class_docstring(path: Path, name: str) -> str:
    """The docstring of class ``name`` in the module at ``path``, read from the source (no import of Lightning)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (node,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    return ast.get_docstring(node) or ""


def test_api_page_shows_a_rendered_docstring(site: Path, tmp_path: Path) -> None:
    docstring = class_docstring(ROOT / "lightning_dp" / "lightning" / "strategy.py", "DPStrategy")
    dom = browser_dom(site / "reference" / "api" / "index.html", tmp_path)
    start = dom.index('id="lightning_dp.DPStrategy"')
    entry = text_of(dom[start : dom.index('id="lightning_dp.PrivacyAccountantCallback"')])
    assert docstring.splitlines()[0] in entry
    assert re.search(r"Parameters: Name Type Description Default device\b", entry), entry[:2000]
    assert 'href="../options/#lightning_dp.config.PrivacyConfig"' in dom[start:]  # a Sphinx role made a link


@pytest.mark.parametrize(("module", "page"), [("lightning_dp", "api"), ("lightning_dp.hf", "hf")])
def test_api_reference_lists_every_public_name(site: Path, module: str, page: str) -> None:
    built = (site / "reference" / page / "index.html").read_text(encoding="utf-8")
    names = importlib.import_module(module).__all__
    if module == "lightning_dp":
        assert {"DPStrategy", "DPDDPStrategy", "DPModelParallelStrategy"} <= set(names)
    missing = [name for name in names if f'id="{module}.{name}"' not in built]
    assert not missing, f"{module}.__all__ names without an entry in the API reference: {missing}"


def test_generated_pages_follow_the_code(site: Path) -> None:
    from lightning_dp.cli.main import COMMANDS
    from lightning_dp.config.privacy_config import PrivacyConfig

    options = text_of((site / "reference" / "options" / "index.html").read_text(encoding="utf-8"))
    assert all(f" {field.name} " in options for field in dataclasses.fields(PrivacyConfig))
    cli = text_of((site / "reference" / "cli" / "index.html").read_text(encoding="utf-8"))
    assert all(f"usage: lightning-dp {name}" in cli for name in COMMANDS if name != "fit")
    assert "--trainer.strategy" in cli  # fit's help is LightningCLI's
