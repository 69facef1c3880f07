"""The import graph of src/rl, files as nodes: `python scripts/import_graph.py [checkout]` prints how many modules and
imports between them there are, every import cycle, and every module over MAX_LINES lines.
tests/unit/test_layout.py holds the code to what this measures."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_LINES = 400


def modules(root: Path) -> dict[str, Path]:
    """`rl.x.y` -> its file, for every module of src/rl."""
    found = {}
    for path in sorted((root / "src" / "rl").rglob("*.py")):
        parts = path.relative_to(root / "src").with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(root: Path) -> dict[str, set[str]]:
    """Each module's imports of other modules of src/rl (TYPE_CHECKING imports and those inside functions too)."""
    found = modules(root)
    edges: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in found:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def long_modules(root: Path) -> dict[str, int]:
    return {name: lines for name, path in modules(root).items()
            if (lines := len(path.read_text().splitlines())) > MAX_LINES}


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent)
    sys.setrecursionlimit(10_000)
    edges = imports(root)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports between them, "
          f"{len(cycles(edges))} import cycles, {len(long_modules(root))} modules over {MAX_LINES} lines")
    for group in cycles(edges):
        print("cycle:", " ".join(group))
    for name, lines in long_modules(root).items():
        print(f"long: {name} ({lines} lines)")


if __name__ == "__main__":
    main()
