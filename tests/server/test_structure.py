"""The shape of graphguard.server: its modules import each other without a cycle, and none
reaches through the AsyncEngine into the engine it guards (`ctx.engine.engine`)."""

from __future__ import annotations

import ast

from tests.import_graph import find_cycle, import_graph, sources

PACKAGE = "graphguard.server"


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
    graph = import_graph(sources("server"))
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
    found = {name: reach_throughs(source) for name, source in sources("server").items()}
    assert {name: exprs for name, exprs in found.items() if exprs} == {}


def test_a_reach_through_is_caught_and_a_module_path_is_not() -> None:
    source = (
        "from graphguard.engine.engine import LLMEngine\n"
        "graphs = ctx.engine.engine.graphs\n"
        "vision = ctx.engine._engine.vision\n"
    )
    assert reach_throughs(source) == ["ctx.engine.engine", "ctx.engine._engine"]
