"""Module-level imports inside the package: no cycle, and the ops never import the layers."""
from __future__ import annotations

import ast
from pathlib import Path

import dsv4attn

ROOT = Path(dsv4attn.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.parse(path.read_text()).body:            # module level only: lazy imports are not edges
            if isinstance(node, ast.Try):
                nodes = node.body
            else:
                nodes = [node]
            for n in nodes:
                if isinstance(n, ast.Import):
                    targets = [a.name for a in n.names]
                elif isinstance(n, ast.ImportFrom):
                    base = n.module or ""
                    if n.level:
                        anchor = package.rsplit(".", n.level - 1)[0] if n.level > 1 else package
                        base = f"{anchor}.{base}" if base else anchor
                    targets = [base] + [f"{base}.{a.name}" for a in n.names]
                else:
                    continue
                edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            # A package's __init__ importing its own submodules (and they, being inside it, the package) is how
            # Python packages work: only edges between modules that are not each other's parent count.
            if n.startswith(m + ".") or m.startswith(n + "."):
                continue
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_ops_never_import_layers():
    bad = [(m, n) for m, edges in _graph().items() if m.startswith("dsv4attn.ops")
           for n in edges if n.startswith("dsv4attn.layers")]
    assert not bad, bad
