"""The import graph of the monorepo: no module imports a module that imports it back (module-level
or inside a function), packages depend one way only, and each pyproject.toml declares exactly the
project packages its sources import:

    nanoqwen-format, nanoqwen-model  (leaves: numpy/msgpack/xxhash; torch)
    nanoqwen-quant    -> format, model
    nanoqwen-kernels  -> model (format allowed)
    nanoqwen-runtime  -> format, model, kernels
    nanoqwen-bench    -> format, model, quant, kernels, runtime (every benchmark; nothing imports it
                         but the cli's `bench` command)
    nanoqwen-cli      -> format, runtime, bench, quant (models by name: fetch and pack; model and
                         kernels allowed)

Read from the sources with `ast`, so nothing is imported and no optional dependency is needed."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "nanoqwen_format": set(),
    "nanoqwen_model": set(),
    "nanoqwen_quant": {"nanoqwen_format", "nanoqwen_model"},
    "nanoqwen_kernels": {"nanoqwen_format", "nanoqwen_model"},
    "nanoqwen_runtime": {"nanoqwen_format", "nanoqwen_model", "nanoqwen_kernels"},
    "nanoqwen_bench": {"nanoqwen_format", "nanoqwen_model", "nanoqwen_quant", "nanoqwen_kernels",
                       "nanoqwen_runtime"},
    "nanoqwen_cli": {"nanoqwen_format", "nanoqwen_model", "nanoqwen_kernels", "nanoqwen_runtime",
                     "nanoqwen_bench", "nanoqwen_quant"},
}


def modules() -> dict[str, Path]:
    out = {}
    for src in ROOT.glob("packages/*/src"):
        for f in src.rglob("*.py"):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Repo modules `name` imports anywhere in its source (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:  # the longest repo module that t names
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def test_no_import_cycles():
    mods = modules()
    known = set(mods)
    graph = {m: imports_of(m, p, known) for m, p in mods.items()}
    # a package's __init__ re-exporting its submodules is not a cycle with them: drop parent -> child
    # edges, keep child -> parent ones (a submodule importing its package's __init__ would be one)
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
    assert len(graph) > 50  # the walk saw the whole tree


def test_packages_depend_one_way():
    mods = modules()
    known = set(mods)
    bad = []
    for m, p in mods.items():
        top = m.split(".")[0]
        for t in imports_of(m, p, known):
            other = t.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                bad.append(f"{m} imports {t}")
    assert not bad, "\n".join(bad)


def test_every_package_has_a_layer():
    """A new package must be placed in ALLOWED (and so in the layering) before it can pass."""
    tops = {src.parent.name.replace("-", "_") for src in ROOT.glob("packages/*/src")}
    assert tops == set(ALLOWED)


def _declared_project_dependencies(pyproject: Path) -> set[str]:
    """The nanoqwen-* distributions in [project].dependencies (the name before any version, extra or
    marker; PEP 503-normalized)."""
    deps = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
    names = {re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", d).group(1)).lower()
             for d in deps}
    return {n for n in names if n.startswith("nanoqwen-")}


def _imported_project_distributions(src: Path, own: str) -> set[str]:
    """The nanoqwen-* distributions whose top-level package (nanoqwen_x -> nanoqwen-x) a module under
    `src` imports anywhere (module level or inside a function), its own package left out. Relative
    imports stay inside the package, so only absolute ones are read."""
    found = set()
    for f in src.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top.startswith("nanoqwen_") and top != own:
                    found.add(top.replace("_", "-"))
    return found


def test_each_pyproject_declares_exactly_the_project_packages_it_imports():
    """Both directions: an imported nanoqwen-* package that is not declared breaks a lone install of
    the package; a declared one that is never imported is a false edge in the dependency graph."""
    bad = []
    pyprojects = sorted(ROOT.glob("packages/*/pyproject.toml"))
    assert len(pyprojects) == len(ALLOWED)
    for pyproject in pyprojects:
        pkg = pyproject.parent
        own = pkg.name.replace("-", "_")
        declared = _declared_project_dependencies(pyproject)
        imported = _imported_project_distributions(pkg / "src", own)
        if missing := imported - declared:
            bad.append(f"{pkg.name} imports but does not declare {sorted(missing)}")
        if unused := declared - imported:
            bad.append(f"{pkg.name} declares but never imports {sorted(unused)}")
    assert not bad, "\n".join(bad)


def test_declared_dependencies_point_down():
    """The declared graph obeys the same layering as the imports (no upward or sideways edge)."""
    bad = []
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        own = pyproject.parent.name.replace("-", "_")
        for dep in _declared_project_dependencies(pyproject):
            if dep.replace("-", "_") not in ALLOWED[own]:
                bad.append(f"{pyproject.parent.name} declares {dep}")
    assert not bad, "\n".join(bad)
