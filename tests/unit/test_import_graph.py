"""graphguard's import graph as a whole: no cycle anywhere, and the layers stand on each other.

The package's layers, lowest first: core < segmented < engine < server. Inside the engine,
its floors, lowest first: config (and generation_config); tokens; scheduling; shapes; models;
parallel; graphs; step; then the top (engine, llm and its arguments and outputs, outputs,
intake, fidelity, launch). A module imports only modules on
its own floor or below: nothing inside engine/ imports one that stands above it.
"""

from __future__ import annotations

from tests.import_graph import find_cycle, import_graph, sources

E = "graphguard.engine."
# The engine's floors, lowest first; a floor is a module or a package (its modules).
ENGINE_FLOORS = (
    ("config", "generation_config"),
    ("tokens",),
    ("scheduling",),
    ("shapes",),
    ("models",),
    ("parallel",),
    ("graphs",),
    ("step",),
    ("engine", "llm", "llm_args", "llm_outputs", "outputs", "intake", "fidelity", "launch"),
)
# module (or package) prefix -> what it must not import (prefixes)
FORBIDDEN = {
    "graphguard.core": ("graphguard.engine", "graphguard.server", "graphguard.segmented"),
    "graphguard.segmented": ("graphguard.engine", "graphguard.server"),
    "graphguard.engine": ("graphguard.server",),
}


def floor_of(module: str) -> int | None:
    """The engine floor `module` stands on (None: outside the engine's floors)."""
    if not module.startswith(E):
        return None
    head = module[len(E) :].split(".")[0]
    return next((i for i, floor in enumerate(ENGINE_FLOORS) if head in floor), None)


def back_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run from a lower layer or floor up to a higher one."""
    found = []
    for module, imports in sorted(graph.items()):
        for prefix, banned in FORBIDDEN.items():
            if module == prefix or module.startswith(prefix + "."):
                found += [f"{module} -> {m}" for m in sorted(imports) if m.startswith(banned)]
        floor = floor_of(module)
        if floor is not None:
            above = [m for m in sorted(imports) if (floor_of(m) or 0) > floor]
            found += [f"{module} -> {m}" for m in above]
    return found


def test_graphguard_imports_without_a_cycle() -> None:
    graph = import_graph(sources())
    assert E + "engine" in graph and graph[E + "engine"]  # the walk read the whole package
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_every_engine_module_stands_on_a_floor() -> None:
    graph = import_graph(sources("engine"))
    homeless = sorted(m for m in graph if m != E[:-1] and floor_of(m) is None)
    assert homeless == []


def test_no_import_runs_back_up() -> None:
    graph = import_graph(sources())
    assert E + "graphs.component" in graph[E + "step.model_runner"]  # a forward edge, read
    assert back_edges(graph) == []


def test_a_back_edge_is_found() -> None:
    graph = {
        E + "step.model_runner": {E + "scheduling.batch", E + "engine"},
        E + "graphs.runners": {E + "models.forward"},
        E + "models.forward": {E + "graphs.runners"},
        "graphguard.core.runner": {"graphguard.engine.scheduling.kv"},
    }
    assert back_edges(graph) == [
        "graphguard.core.runner -> graphguard.engine.scheduling.kv",
        "graphguard.engine.models.forward -> graphguard.engine.graphs.runners",
        "graphguard.engine.step.model_runner -> graphguard.engine.engine",
    ]
