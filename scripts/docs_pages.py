"""The docs site's generated pages, made from the code at every build (a MkDocs hook, ``hooks:`` in mkdocs.yml).

* ``index.md``: README.md, its links into ``docs/`` made relative to the site;
* ``changelog.md``: CHANGELOG.md;
* ``reference/api.md`` and ``reference/hf.md``: one mkdocstrings entry per name of ``lightning_dp.__all__`` and
  ``lightning_dp.hf.__all__`` (a new public name is documented without touching the docs);
* ``reference/cli.md``: the ``--help`` of every ``lightning-dp`` subcommand, as the command prints it;
* ``reference/options.md``: the privacy options, one row per field of ``PrivacyConfig``.

Nothing here is written to disk: the pages exist only in the built site. Build with ``mkdocs build --strict``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import html
import io
import os
import re
import sys
from pathlib import Path
from unittest import mock

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]

#: a Sphinx cross-reference role in a docstring, as Markdown renders it: ``:class:<code>~a.b.C</code>``.
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>(?P<reference>[^<]+)</code>")

#: the public surfaces documented in the API reference: page -> (module, title, what the page says first).
API_PAGES = {
    "reference/api.md": ("lightning_dp", "API: lightning_dp", "Lightning strategies, callbacks and the engine."),
    "reference/hf.md": ("lightning_dp.hf", "API: lightning_dp.hf", "The HuggingFace `Trainer` path."),
}


def front_page() -> str:
    """README.md as the site's index: its ``docs/...`` links (and the changelog's) point to the pages beside it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme.replace("](docs/", "](").replace("](CHANGELOG.md)", "](changelog.md)")


def public_names(module: str) -> list[str]:
    """``module.__all__``, read from the source (importing the module would import Lightning or transformers)."""
    path = ROOT.joinpath(*module.split(".")) / "__init__.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{path} has no __all__")


def api_page(module: str, title: str, lead: str) -> str:
    """One mkdocstrings entry per public name of ``module``, in ``__all__``'s order."""
    entries = [f"::: {module}.{name}" for name in public_names(module)]
    return f"# {title}\n\n{lead} Generated from the docstrings (`{module}.__all__`).\n\n" + "\n\n".join(entries) + "\n"


def command_help(argv: list[str]) -> str:
    """What ``lightning-dp *argv`` prints on stdout, run in this process under the console script's name."""
    from lightning_dp.cli.main import main

    out, program = io.StringIO(), sys.argv[0]
    sys.argv[0] = "lightning-dp"
    try:  # argparse wraps the help at $COLUMNS: a fixed width, whatever terminal builds the site
        with contextlib.redirect_stdout(out), mock.patch.dict(os.environ, {"COLUMNS": "100"}):
            main(argv)
    except SystemExit as done:  # argparse's --help exits
        if done.code not in (0, None):
            raise RuntimeError(f"lightning-dp {' '.join(argv)} exited with {done.code}") from done
    finally:
        sys.argv[0] = program
    return out.getvalue().rstrip()


def cli_page() -> str:
    """The help of ``lightning-dp`` and of each subcommand."""
    from lightning_dp.cli.main import COMMANDS

    parts = ["# Command line reference", "What `lightning-dp COMMAND --help` prints, generated at each docs build."]
    for argv in (["--help"], *([name, "--help"] for name in COMMANDS)):
        parts.append(f"## `lightning-dp {' '.join(argv)}`\n\n```text\n{command_help(argv)}\n```")
    return "\n\n".join(parts) + "\n"


def _code(text: str) -> str:
    """Inline code for a table cell, as HTML: in a Markdown code span a table's escaped pipe keeps its backslash."""
    return f"<code>{html.escape(text).replace('|', '&#124;')}</code>"


def _cell(text: str) -> str:
    """A field's documentation as one table cell, its ``code`` spans kept."""
    parts = re.split(r"``(.+?)``", " ".join(text.split()))  # prose, code, prose, ...
    return "".join(_code(part) if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def options_page() -> str:
    """Every field of ``PrivacyConfig``: name (and its HF name), type, default and documentation."""
    from lightning_dp.config.privacy_config import HF_NAMES, PrivacyConfig

    rows = []
    for option in dataclasses.fields(PrivacyConfig):
        name = f"`{option.name}`" + (f" (HF: `{HF_NAMES[option.name]}`)" if option.name in HF_NAMES else "")
        cells = [name, _code(str(option.type)), _code(repr(option.default)), _cell(option.metadata["doc"])]
        rows.append(f"| {' | '.join(cells)} |")
    return (
        "# Privacy options\n\nThe options of `DPStrategy`, `DPDDPStrategy`, `DPModelParallelStrategy`, "
        "`PrivacyEngine` and (under the HF names) `lightning_dp.hf.PrivacyArguments`: the fields of "
        "`PrivacyConfig`, generated from its code at each docs build.\n\n"
        "::: lightning_dp.config.PrivacyConfig\n    options:\n      members: false\n      show_signature: false\n\n"
        "| option | type | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def generated_pages() -> dict[str, str]:
    """Site path -> Markdown of every generated page."""
    pages = {
        "index.md": front_page(),
        "changelog.md": (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"),
        "reference/cli.md": cli_page(),
        "reference/options.md": options_page(),
    }
    pages.update({path: api_page(*spec) for path, spec in API_PAGES.items()})
    return pages


def _autoref(role: re.Match[str]) -> str:
    """A Sphinx role as an optional mkdocs-autorefs reference (no warning when the site does not document it)."""
    reference = html.unescape(role["reference"])
    if explicit := re.fullmatch(r"(.+?)\s*<(.+)>", reference):  # :meth:`title <target>`
        title, target = explicit.groups()
    else:  # :class:`~a.b.C` shows C, :class:`a.b.C` the whole path
        target = reference.removeprefix("~")
        title = target.rsplit(".", 1)[-1] if reference.startswith("~") else target
    return f'<autoref optional identifier="{html.escape(target)}"><code>{html.escape(title)}</code></autoref>'


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """MkDocs hook: add the generated pages to the site's files."""
    for path, content in generated_pages().items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_content(content: str, **kwargs: object) -> str:
    """MkDocs hook: the docstrings' Sphinx roles (``:class:`~a.b.C` ``) become links to the object where the site
    documents it (mkdocs-autorefs resolves them after every page is built), and code otherwise."""
    return SPHINX_ROLE.sub(_autoref, content)
