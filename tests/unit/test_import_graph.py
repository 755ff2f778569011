"""graphguard's import graph as a whole: no cycle anywhere, and the request path
server -> async engine -> engine -> scheduler -> model runner -> graphs -> core has no
back-edge (a lower layer never imports a higher one)."""

from __future__ import annotations

from tests.import_graph import find_cycle, import_graph, sources

E = "graphguard.engine."
# Modules every engine layer may use: model code, the KV cache and the data they pass around.
ENGINE_ABOVE_MODELS = (E + "engine", E + "llm", E + "scheduler", E + "model_runner")
GRAPH_MODULES = (E + "graphs", E + "decode_graphs", E + "prefill_graphs")
# module (or package) prefix -> what it must not import (prefixes)
FORBIDDEN = {
    "graphguard.core": ("graphguard.engine", "graphguard.server", "graphguard.segmented"),
    "graphguard.segmented": ("graphguard.engine", "graphguard.server"),
    "graphguard.engine": ("graphguard.server",),
    E + "scheduler": (E + "engine", E + "llm", E + "model_runner", *GRAPH_MODULES),
    E + "model_runner": (E + "engine", E + "llm", E + "scheduler", *GRAPH_MODULES),
    **{m: ENGINE_ABOVE_MODELS for m in GRAPH_MODULES},
    **{
        E + m: ENGINE_ABOVE_MODELS + GRAPH_MODULES
        for m in ("forward", "models", "attention", "kv", "batch", "sequence", "sampling")
    },
}


def back_edges(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imports in sorted(graph.items()):
        for prefix, banned in FORBIDDEN.items():
            if module == prefix or module.startswith(prefix + "."):
                found += [f"{module} -> {m}" for m in sorted(imports) if m.startswith(banned)]
    return found


def test_graphguard_imports_without_a_cycle() -> None:
    graph = import_graph(sources())
    assert E + "engine" in graph and graph[E + "engine"]  # the walk read the whole package
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_request_path_has_no_back_edge() -> None:
    graph = import_graph(sources())
    assert E + "graphs" in graph[E + "engine"]  # the engine builds its graphs: a forward edge
    assert back_edges(graph) == []


def test_a_back_edge_is_found() -> None:
    graph = {
        E + "model_runner": {E + "scheduler", E + "kv"},
        E + "graphs": {E + "forward"},
        "graphguard.core.runner": {"graphguard.engine.kv"},
    }
    assert back_edges(graph) == [
        "graphguard.core.runner -> graphguard.engine.kv",
        "graphguard.engine.model_runner -> graphguard.engine.scheduler",
    ]
