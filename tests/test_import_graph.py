"""The import graph of the monorepo: no module imports a module that imports it back (module-level
or inside a function), and packages depend one way only:

    nanoqwen-format, nanoqwen-model  (leaves: numpy/msgpack/xxhash; torch)
    nanoqwen-quant    -> format, model
    nanoqwen-kernels  -> format, model
    nanoqwen-runtime  -> format, model, kernels
    nanoqwen-cli      -> runtime (and what runtime uses), quant (models by name: fetch and pack)

Read from the sources with `ast`, so nothing is imported and no optional dependency is needed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "nanoqwen_format": set(),
    "nanoqwen_model": set(),
    "nanoqwen_quant": {"nanoqwen_format", "nanoqwen_model"},
    "nanoqwen_kernels": {"nanoqwen_format", "nanoqwen_model"},
    "nanoqwen_runtime": {"nanoqwen_format", "nanoqwen_model", "nanoqwen_kernels"},
    "nanoqwen_cli": {"nanoqwen_format", "nanoqwen_model", "nanoqwen_quant", "nanoqwen_kernels",
                     "nanoqwen_runtime"},
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
