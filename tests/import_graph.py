"""graphguard's import graph, read with `ast` (shared by the structure tests).

Every Import / ImportFrom counts, wherever it is: at the top, inside a function, under
`if TYPE_CHECKING:`. A deferred import hides a cycle from Python, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import graphguard

ROOT = Path(graphguard.__file__).parent
Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(*packages: str) -> dict[str, str]:
    """Source text of every module under the given subpackages of graphguard (all of it when
    none is given), by module name."""
    folders = [ROOT / p for p in packages] if packages else [ROOT]
    paths = sorted(path for folder in folders for path in folder.rglob("*.py"))
    return {module_name(path): path.read_text() for path in paths}


def imported_modules(source: str, known: set[str]) -> set[str]:
    """Every module `source` imports, anywhere in it. `from pkg import sub` names `pkg.sub`
    when that is a known module, else `pkg`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            # NOTE: a relative import would name no known module and slip past the walk.
            assert node.level == 0, "graphguard imports absolutely"
            base = node.module or ""
            found |= {
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            }
    return found


def import_graph(texts: dict[str, str]) -> Graph:
    """Edges between the given modules only; a module's own package does not count (Python
    runs it first, as it must)."""
    known = set(texts)
    return {name: imported_modules(src, known) & known - {name} for name, src in texts.items()}


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if target in path:
                return path[path.index(target) :] + [target]
            if target not in done and (cycle := visit(target)):
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None
