"""The shape of graphguard.server: its modules import each other without a cycle, and none
reaches through the AsyncEngine into the engine it guards (`ctx.engine.engine`)."""

from __future__ import annotations

import ast
from pathlib import Path

import graphguard.server

PACKAGE = "graphguard.server"
SERVER_DIR = Path(graphguard.server.__file__).parent

Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVER_DIR).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join((PACKAGE, *parts))


def server_sources() -> dict[str, str]:
    """Source text of every graphguard.server module, by module name."""
    return {module_name(path): path.read_text() for path in sorted(SERVER_DIR.rglob("*.py"))}


def imported_modules(module: str, source: str, known: set[str]) -> set[str]:
    """The modules of `known` that `source` imports anywhere: at the top, under
    `if TYPE_CHECKING:`, inside functions. `from pkg import sub` names the module `pkg.sub`;
    the package a module sits in is not counted (Python runs it first, as it must)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            # NOTE: a relative import would name no known module and slip past the walk.
            assert node.level == 0, f"{module} imports relatively; graphguard imports absolutely"
            base = node.module or ""
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found & known - {module}


def import_graph(sources: dict[str, str]) -> Graph:
    known = set(sources)
    return {name: imported_modules(name, source, known) for name, source in sources.items()}


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


def reach_throughs(source: str) -> list[str]:
    """Expressions that read `<x>.engine.engine` or `<x>.engine._engine`: the engine behind an
    AsyncEngine. Module paths (`graphguard.engine.engine`) are imports, not reads, and pass."""
    return [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr in ("engine", "_engine")
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "engine"
    ]


def test_server_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph(server_sources())
    assert f"{PACKAGE}.handlers" in graph and graph[f"{PACKAGE}.handlers"]  # the walk saw edges
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_an_import_under_type_checking_closes_a_cycle() -> None:
    # The cycle this module was written against: images needed handlers' context for a type.
    images = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from graphguard.server.handlers import ServingContext\n"
    )
    handlers = "from graphguard.server.images import chat_prompt\n"
    graph = import_graph({f"{PACKAGE}.images": images, f"{PACKAGE}.handlers": handlers})
    assert find_cycle(graph) == [f"{PACKAGE}.handlers", f"{PACKAGE}.images", f"{PACKAGE}.handlers"]


def test_no_server_module_reaches_through_the_async_engine() -> None:
    found = {name: reach_throughs(source) for name, source in server_sources().items()}
    assert {name: exprs for name, exprs in found.items() if exprs} == {}


def test_a_reach_through_is_caught_and_a_module_path_is_not() -> None:
    source = (
        "from graphguard.engine.engine import LLMEngine\n"
        "graphs = ctx.engine.engine.graphs\n"
        "vision = ctx.engine._engine.vision\n"
    )
    assert reach_throughs(source) == ["ctx.engine.engine", "ctx.engine._engine"]
