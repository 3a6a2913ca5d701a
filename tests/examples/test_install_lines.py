"""Every example and docs page that runs code gives its install line, and that line installs what the example imports:
the example's own imports (at any depth), what the ``lightning_dp`` modules they load import when loaded, and what a
third-party class it builds imports late (:data:`LATE_IMPORTS`), each found in the distributions the line installs
(the package's requirements and its named extras, read from pyproject.toml, with their own dependencies). A missing
optional package is refused with the extra's name (:mod:`lightning_dp.utils.extras`)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import venv
from functools import cache
from pathlib import Path

import pytest

import lightning_dp
from lightning_dp.utils.extras import extra_requirements, needs_extra, normalise, require_extra

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "lightning_dp" / "examples").glob("*.py") if p.name != "__init__.py")
#: modules that a third-party class an example builds imports only then: Lightning's ``TensorBoardLogger``.
LATE_IMPORTS = {"quickstart_lightning": {"tensorboard"}}


def pyproject_requires() -> list[str]:
    """The package's requirements as its metadata writes them (``name>=1; extra == "hf"``), from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    return [*project["dependencies"], *(f'{r}; extra == "{e}"' for e, reqs in extras.items() for r in reqs)]


def install_line(text: str) -> tuple[set[str], set[str]]:
    """``(extras, packages)`` of the first ``pip install -e ".[extras]"`` line of ``text`` (the packages installed
    after it on the same line, e.g. a model package)."""
    line = next((line for line in text.splitlines() if 'pip install -e "' in line), None)
    assert line is not None, "no install line"
    extras = re.search(r'pip install -e "\.(?:\[([\w,-]+)\])?"', line)
    assert extras is not None, line
    packages = set()
    for more in re.findall(r"&&\s*pip install ((?:--no-deps )?[\w\s-]+?)\s*(?=&&|#|`|$)", line):
        packages |= {normalise(name) for name in more.removeprefix("--no-deps ").split()}
    return {e for e in (extras.group(1) or "").split(",") if e}, packages


@cache
def _dependencies(distribution: str) -> frozenset[str]:
    """``distribution`` and what it depends on, recursively (installed metadata; extras' requirements left out, markers
    other than ``extra`` read as true)."""
    found = {distribution}
    try:
        requires = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return frozenset(found)
    for requirement in requires:
        if "extra" in requirement.partition(";")[2]:
            continue
        name = normalise(re.match(r"[\w.-]+", requirement).group(0))
        if name not in found:
            found |= _dependencies(name)
    return frozenset(found)


def provided(extras: set[str], packages: set[str]) -> set[str]:
    """The distributions installed by the package with ``extras``, and ``packages``, with their dependencies."""
    requires = pyproject_requires()
    direct = {normalise(re.match(r"[\w.-]+", r).group(0)) for r in requires if ";" not in r} | packages
    for extra in extras:
        direct |= extra_requirements(extra, requires)
    direct.discard(normalise("lightning_dp"))
    return set().union(*(_dependencies(name) for name in direct)) | direct


def _imports(tree: ast.AST, *, loaded_only: bool) -> set[str]:
    """The modules ``tree`` imports (``from a import b`` gives ``a`` and ``a.b``); ``loaded_only``: only those imported
    when the module is loaded (not in a function's body, not under ``if TYPE_CHECKING``)."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if loaded_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if loaded_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        stack.extend(ast.iter_child_nodes(node))
    return found


def _source(module: str) -> Path | None:
    """The file of a ``lightning_dp`` module (a package's ``__init__.py``), ``None`` for another name."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def third_party_imports(example: Path) -> set[str]:
    """The top-level third-party modules running ``example`` imports (module docstring of this file)."""
    pending = sorted(_imports(ast.parse(example.read_text(encoding="utf-8")), loaded_only=False))
    pending.append("lightning_dp.examples")  # imported first by python -m
    seen: set[str] = set()
    third_party: set[str] = set()
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        top = module.partition(".")[0]
        if top != "lightning_dp":
            if top not in sys.stdlib_module_names and top != "__future__":
                third_party.add(top)
            continue
        parts = module.split(".")
        pending += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages are loaded first
        if len(parts) == 2 and parts[1] in lightning_dp._EXPORTS:  # a name the package imports on first use
            pending.append(lightning_dp._EXPORTS[parts[1]])
        if (source := _source(module)) is not None:
            pending += sorted(_imports(ast.parse(source.read_text(encoding="utf-8")), loaded_only=True))
    return third_party | LATE_IMPORTS.get(example.stem, set())


def distribution_of(module: str) -> str:
    """The installed distribution providing top-level module ``module`` (normalised)."""
    names = importlib.metadata.packages_distributions().get(module)
    assert names, f"{module} is imported but no installed distribution provides it"
    return normalise(names[0])


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_example_s_install_line_provides_what_it_imports(example):
    extras, packages = install_line(ast.get_docstring(ast.parse(example.read_text(encoding="utf-8"))) or "")
    assert "examples" in extras
    installed = provided(extras, packages)
    missing = {module: distribution_of(module) for module in third_party_imports(example)}
    missing = {module: name for module, name in missing.items() if name not in installed}
    assert not missing, (
        f'{example.name} imports {missing}, which pip install -e ".[{",".join(extras)}]" does not install'
    )


def test_the_examples_extra_holds_no_more_than_the_examples_import():
    """The extra stays the everyday examples' needs: each of its distributions is imported by one of them."""
    imported = {distribution_of(module) for example in EXAMPLES for module in third_party_imports(example)}
    extra = extra_requirements("examples", pyproject_requires())
    assert extra <= imported, extra - imported


DOCS_WITH_CODE = sorted(
    p for p in (ROOT / "docs").glob("*.md") if re.search(r"^```(bash|python)", p.read_text(encoding="utf-8"), re.M)
)


@pytest.mark.parametrize("page", DOCS_WITH_CODE, ids=[p.stem for p in DOCS_WITH_CODE])
def test_a_docs_page_that_runs_code_gives_its_install_line_first(page):
    head = "\n".join(page.read_text(encoding="utf-8").splitlines()[:12])
    extras, _ = install_line(head)
    assert extras <= set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@pytest.mark.parametrize("page", ["usage.md", "hf.md"])
def test_the_pages_of_the_examples_install_their_extra(page):
    extras, _ = install_line("\n".join((ROOT / "docs" / page).read_text(encoding="utf-8").splitlines()[:12]))
    assert "examples" in extras


# ------------------------------------------------------------------------------------------------ friendly errors
REQUIRES = [
    'transformers>=5.23; extra == "hf"',
    'lightning_dp[hf]; extra == "examples"',
    'no-such-dist; extra == "examples"',
]


def test_a_missing_distribution_of_an_extra_is_named_with_the_extra():
    assert extra_requirements("examples", REQUIRES) == {"transformers", "no-such-dist"}
    require_extra("hf", "lightning_dp.hf", REQUIRES)  # transformers is installed
    with pytest.raises(ModuleNotFoundError) as raised:
        require_extra("examples", "lightning_dp.examples", REQUIRES)
    assert str(raised.value) == (
        "lightning_dp.examples needs the 'examples' extra (no-such-dist is not installed): "
        'pip install -e ".[examples]"'
    )


def test_an_import_error_of_an_extra_s_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails as when not installed
    with pytest.raises(ModuleNotFoundError, match=r"^lightning_dp.hf needs the 'hf' extra \(.*transformers.*\): pip"):
        with needs_extra("hf", "lightning_dp.hf"):
            import transformers  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="^No module named 'not_an_extra_s'$"), needs_extra("hf", "x"):
        import not_an_extra_s  # noqa: F401


# ------------------------------------------------------------------------------------------------ in a fresh venv
#: the quickstarts of docs/usage.md and where each writes its output
QUICKSTARTS = {"quickstart_lightning": "--logdir", "quickstart_hf": "--output-dir"}


@pytest.mark.slow
@pytest.mark.parametrize("name", QUICKSTARTS)
def test_the_quickstart_runs_after_its_documented_install_line_in_a_fresh_venv(name, tmp_path):
    """In a new virtual environment with torch: after ``pip install -e .`` the example refuses with the extra's install
    line; after the line of its docstring it runs (installing takes minutes, the run a minute or a few on CPU)."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = str(env / "bin" / "python")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def pip(*args: str) -> None:
        subprocess.run([python, "-m", "pip", "install", "-q", *args], check=True, timeout=1800, env=clean)

    def example() -> subprocess.CompletedProcess[str]:
        command = [python, "-m", f"lightning_dp.examples.{name}", QUICKSTARTS[name], str(tmp_path / "out")]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=clean)

    pip(f"torch=={importlib.metadata.version('torch').split('+')[0]}")
    pip("-e", str(ROOT))
    refused = example()
    assert refused.returncode != 0
    assert "lightning_dp.examples needs the 'examples' extra" in refused.stderr, refused.stderr[-3000:]
    assert 'pip install -e ".[examples]"' in refused.stderr
    docstring = ast.get_docstring(ast.parse((ROOT / "lightning_dp" / "examples" / f"{name}.py").read_text()))
    line = next(line for line in docstring.splitlines() if 'pip install -e "' in line).partition("#")[0]
    for command in line.split("&&"):  # the documented commands, run from the repository (-e ".[...]": ROOT[...])
        words = shlex.split(command)
        assert words[:2] == ["pip", "install"], line
        pip(*(word.replace(".[", f"{ROOT}[", 1) if word.startswith(".[") else word for word in words[2:]))
    run = example()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "epsilon = " in run.stdout
