"""The shape of graphguard.core and graphguard.segmented: their modules import each other
without a cycle, and the runtime imports nothing from the layers above it (tests/import_graph.py
reads the imports)."""

from __future__ import annotations

import ast

from tests.import_graph import ROOT, find_cycle, import_graph, imported_modules, sources

LAYERS = ("core", "segmented")
# the one module outside graphguard.core that the runtime may import: a leaf
LEAVES = {"graphguard.version"}


def runtime_sources() -> dict[str, str]:
    """Source text of every graphguard.core and graphguard.segmented module, by name."""
    return sources(*LAYERS)


def graphguard_imports(source: str) -> set[str]:
    return {m for m in imported_modules(source, set()) if m.split(".")[0] == "graphguard"}


def above_core(source: str) -> list[str]:
    """The graphguard modules `source` imports that are neither in graphguard.core nor leaves:
    the package itself, graphguard.engine, graphguard.server, graphguard.segmented, ..."""
    inside = ("graphguard.core", "graphguard.core.")
    return sorted(
        m for m in graphguard_imports(source) if not m.startswith(inside) and m not in LEAVES
    )


def test_runtime_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph(runtime_sources())
    assert "graphguard.core.runner" in graph["graphguard.core.graph_runner"]  # the walk saw edges
    assert "graphguard.core.runner" in graph["graphguard.segmented.runner"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_an_import_inside_a_function_or_under_type_checking_closes_a_cycle() -> None:
    # The cycle this test was written against: the runner imported export inside a method,
    # and export imported the runner for a type.
    runner = "def export(self):\n    from graphguard.core.export import export_manifest\n"
    export = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from graphguard.core.runner import GraphRunner\n"
    )
    graph = import_graph({"graphguard.core.runner": runner, "graphguard.core.export": export})
    assert find_cycle(graph) == [
        "graphguard.core.export",
        "graphguard.core.runner",
        "graphguard.core.export",
    ]


def test_core_imports_nothing_from_the_layers_above_it() -> None:
    sources = runtime_sources()
    found = {
        name: above_core(src) for name, src in sources.items() if name.startswith("graphguard.core")
    }
    assert "graphguard.core.export" in found  # the walk read the runtime
    assert {name: modules for name, modules in found.items() if modules} == {}


def test_importing_the_package_or_a_layer_above_counts_as_reaching_up() -> None:
    # export once read the version through the package, which imports the runner back.
    source = (
        "def environment():\n"
        "    from graphguard import __version__\n"
        "from graphguard.segmented.group import SegmentGroup\n"
        "import graphguard.engine.scheduling.kv\n"
        "from graphguard.version import __version__\n"
        "from graphguard.core.keys import GraphKey\n"
    )
    assert above_core(source) == [
        "graphguard",
        "graphguard.engine.scheduling.kv",
        "graphguard.segmented.group",
    ]


def test_the_version_module_is_a_leaf() -> None:
    for leaf in LEAVES:
        path = ROOT.parent.joinpath(*leaf.split(".")).with_suffix(".py")
        assert graphguard_imports(path.read_text()) == set(), leaf


def test_core_knows_nothing_of_ranks() -> None:
    # Tensor parallelism wraps a runner from graphguard.engine.parallel: core stays one process.
    words = ("rank", "leader", "follower", "vote", "agree", "orders")
    for name, source in runtime_sources().items():
        found = {n for n in identifiers(source) if any(w in n.lower() for w in words)}
        assert found == set(), name


def identifiers(source: str) -> set[str]:
    """Every name a module defines, reads or passes as a keyword."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            names.add(node.arg)
    return names


def test_manifests_import_no_runner() -> None:
    # export and prewarm read a runner through its public surface (their own Protocols), so
    # the runner may offer them as methods without a cycle.
    sources = runtime_sources()
    runners = {
        "graphguard.core.runner",
        "graphguard.core.graph_runner",
        "graphguard.segmented.runner",
    }
    for name in ("graphguard.core.export", "graphguard.core.prewarm"):
        assert graphguard_imports(sources[name]) & runners == set(), name
