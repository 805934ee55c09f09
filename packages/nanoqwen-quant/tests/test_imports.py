"""The package's modules import one way: no module reaches itself through its imports, and no module
imports one of the package's own modules inside a function (the way an import cycle is hidden)."""

from __future__ import annotations

import ast
from pathlib import Path

import nanoqwen_quant

PKG = Path(nanoqwen_quant.__file__).parent
MODULES = {p.stem: p for p in PKG.glob("*.py")}


def _own_imports(node: ast.AST) -> set[str]:
    """Modules of this package that an import statement names."""
    if isinstance(node, ast.ImportFrom):
        if node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
        elif node.module == "nanoqwen_quant":
            names = [a.name for a in node.names]
        elif node.module and node.module.startswith("nanoqwen_quant."):
            names = [node.module.split(".")[1]]
        else:
            names = []
    elif isinstance(node, ast.Import):
        names = [a.name.split(".")[1] for a in node.names if a.name.startswith("nanoqwen_quant.")]
    else:
        names = []
    return {n.split(".")[0] for n in names if n.split(".")[0] in MODULES}


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    edges, nested = {}, []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        edges[name] = set()
        for node in ast.walk(tree):
            own = _own_imports(node)
            edges[name] |= own
            if own and id(node) not in top:
                nested.append(f"{name}: {ast.unparse(node)}")
    return edges, nested


def test_no_import_cycles():
    edges, _ = _graph()

    def reach(m: str) -> set[str]:
        seen, todo = set(), list(edges[m])
        while todo:
            d = todo.pop()
            if d not in seen:
                seen.add(d)
                todo += edges[d]
        return seen

    assert "pack" in edges and "gptq" in edges["gptq_layers"]  # the graph was read
    assert [m for m in MODULES if m in reach(m)] == []


def test_no_function_level_imports_of_own_modules():
    _, nested = _graph()
    assert nested == []
