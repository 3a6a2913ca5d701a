"""Imports between the packages of ``lightning_dp`` go one way: library core < ``tasks`` < entry points.

Every module under ``lightning_dp/`` is parsed (not imported: the recipes' and examples' optional extras need not be
installed) and every ``import`` / ``from ... import`` in it, at module level or inside a function or class, and every
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name, is checked against :data:`FORBIDDEN`.

Groups: ``tasks`` (``tasks/``: models and data shared by the entry points), the entry points ``examples``
(``examples/``), ``recipes`` (``recipes/``), ``audit`` (``audit/``) and ``cli`` (``cli/``: every ``lightning-dp``
command, the demo among them), and ``core``: every other module (the root modules, ``engine/``, ``config/``,
``runtime/``, ``utils/``, clipping, mechanisms, accounting, the Lightning and HF integrations, ...).

- ``core`` imports no other group (it does not today, so the rule is kept whole rather than the narrower "no
  examples, recipes or tasks").
- ``tasks`` imports only the core: no entry point.
- ``examples`` imports no other entry point (in particular not ``recipes``).
- ``audit`` imports no other entry point (in particular neither ``examples`` nor ``recipes``).
- The command line is the one place where entry points meet, so these imports are allowed: ``cli`` may import
  ``audit`` (``lightning-dp audit`` runs the audit setups; the demo, ``lightning-dp demo``, is part of ``cli``);
  ``recipes`` may import ``cli`` (the CIFAR recipe is a LightningCLI config run through ``lightning-dp fit``).
  Every other import between entry points is forbidden.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dp"
ENTRY_POINTS = frozenset({"examples", "recipes", "audit", "cli"})
#: group -> groups it must not import.
FORBIDDEN: dict[str, frozenset[str]] = {
    "core": ENTRY_POINTS | {"tasks"},
    "tasks": ENTRY_POINTS,
    "examples": ENTRY_POINTS - {"examples"},
    "audit": ENTRY_POINTS - {"audit"},
    "recipes": ENTRY_POINTS - {"recipes", "cli"},
    "cli": ENTRY_POINTS - {"cli", "audit"},
}


def group(module: str) -> str | None:
    """The group of a dotted module name inside ``lightning_dp`` (``None`` outside it)."""
    parts = module.split(".")
    if parts[0] != "lightning_dp":
        return None
    if len(parts) == 1:
        return "core"
    top = parts[1]
    if top in ("examples", "recipes", "audit", "tasks", "cli"):
        return top
    return "core"


def module_name(path: Path) -> str:
    """``lightning_dp/a/b.py`` -> ``lightning_dp.a.b``; ``lightning_dp/a/__init__.py`` -> ``lightning_dp.a``."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module name ``source`` (the code of ``module``) may import, anywhere in its body: ``import X`` gives
    ``X``; ``from X import Y`` gives ``X`` and ``X.Y`` (``Y`` may be a submodule), relative imports resolved; a call
    ``import_module("X")`` / ``__import__("X")`` with a literal name gives ``X``."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names.add(origin)
            names.update(f"{origin}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def violations(module: str, imports: set[str]) -> list[str]:
    """``"module -> imported (group -> group)"`` for each import of ``module`` that :data:`FORBIDDEN` rules out."""
    source = group(module)
    found = []
    for name in sorted(imports):
        target = group(name)
        if target is not None and target in FORBIDDEN[source]:
            found.append(f"{module} -> {name} ({source} -> {target})")
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_walked():
    """The walk sees the package: a module of every group, and the imports the rules are about."""
    groups = {group(module_name(path)) for path in MODULES}
    assert groups == {"core", "tasks", "examples", "recipes", "audit", "cli"}
    demo = PACKAGE / "cli" / "demo.py"
    assert "lightning_dp.tasks.digits" in imported_modules(demo.read_text(), "lightning_dp.cli.demo")


def test_groups_of_the_packages():
    """The command line, the demo included, is one entry point; the engine, the configuration, the runtime, the
    internal helpers and the root modules are core."""
    for name in ("cli", "cli.main", "cli.args", "cli.demo", "cli.fit", "cli.privacy", "cli.audit"):
        assert group(f"lightning_dp.{name}") == "cli", name
    for name in ("engine.privacy_engine", "config", "config.errors", "runtime.distributed", "utils.naming"):
        assert group(f"lightning_dp.{name}") == "core", name
    for name in ("", ".augmentation", ".weight_standardisation", ".registration"):
        assert group(f"lightning_dp{name}") == "core", name


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_respect_the_layers(path: Path):
    module = module_name(path)
    imports = imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
    assert violations(module, imports) == []


def test_imports_inside_functions_and_relative_imports_are_seen():
    """The checker itself: an import inside a function, a relative import and ``import_module`` all count."""
    source = (
        "def f():\n"
        "    from lightning_dp.recipes import glue\n"
        "from ..examples import sst2_hf\n"
        "import importlib\n"
        "importlib.import_module('lightning_dp.audit.setups')\n"
    )
    imports = imported_modules(source, "lightning_dp.tasks.digits")
    assert {"lightning_dp.recipes.glue", "lightning_dp.examples.sst2_hf", "lightning_dp.audit.setups"} <= imports
    assert (
        len(violations("lightning_dp.tasks.digits", imports)) == 5
    )  # recipes(.glue), examples(.sst2_hf), audit.setups
    assert violations("lightning_dp.cli.audit", {"lightning_dp.audit.setups"}) == []
    assert violations("lightning_dp.engine.privacy_engine", {"lightning_dp.tasks.digits"}) != []


# ------------------------------------------------------------------------------------------------ import cycles
def _under_type_checking(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports for annotations only, never executed)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            inside.update(id(sub) for statement in node.body for sub in ast.walk(statement))
    return inside


def runtime_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` imports when it runs (at module level or in a function, not under
    ``TYPE_CHECKING``): ``from X import Y`` counts as ``X.Y`` when that is a module, else as ``X``."""
    tree = ast.parse(source)
    skipped = _under_type_checking(tree)
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            origin = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{origin}.{alias.name}"
                found.add(name if name in known else origin)
    return (found & known) - {module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_inside_the_package():
    """Modules import one another one way (imports for annotations under ``TYPE_CHECKING`` aside)."""
    known = {module_name(path) for path in MODULES}
    graph = {
        module_name(path): runtime_imports(
            path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py", known
        )
        for path in MODULES
    }
    assert import_cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import():
    known = {"p.a", "p.b", "p.c"}
    annotations_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.a\n"
    graph = {
        "p.a": runtime_imports("from p.b import thing\n", "p.a", False, known),
        "p.b": runtime_imports("def f():\n    from p import a\n", "p.b", False, known),
        "p.c": runtime_imports(annotations_only, "p.c", False, known),
    }
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}
    assert import_cycles(graph) == [["p.a", "p.b"]]
