"""The shape of graphguard.core and graphguard.segmented: their modules import each other
without a cycle, and the runtime imports nothing from the layers above it.

Every Import / ImportFrom counts, wherever it is: at the top, inside a function, under
`if TYPE_CHECKING:`. A deferred import hides a cycle from Python, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import graphguard

ROOT = Path(graphguard.__file__).parent
LAYERS = ("core", "segmented")
# the one module outside graphguard.core that the runtime may import: a leaf
LEAVES = {"graphguard.version"}

Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_sources() -> dict[str, str]:
    """Source text of every graphguard.core and graphguard.segmented module, by name."""
    paths = sorted(p for layer in LAYERS for p in (ROOT / layer).glob("*.py"))
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


def import_graph(sources: dict[str, str]) -> Graph:
    """Edges between the given modules only; a module's own package does not count (Python
    runs it first, as it must)."""
    known = set(sources)
    return {name: imported_modules(src, known) & known - {name} for name, src in sources.items()}


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
    assert "graphguard.core.base" in graph["graphguard.core.runner"]  # the walk saw edges
    assert "graphguard.core.base" in graph["graphguard.segmented.runner"]
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
        "import graphguard.engine.kv\n"
        "from graphguard.version import __version__\n"
        "from graphguard.core.keys import GraphKey\n"
    )
    assert above_core(source) == [
        "graphguard",
        "graphguard.engine.kv",
        "graphguard.segmented.group",
    ]


def test_the_version_module_is_a_leaf() -> None:
    for leaf in LEAVES:
        path = ROOT.parent.joinpath(*leaf.split(".")).with_suffix(".py")
        assert graphguard_imports(path.read_text()) == set(), leaf


def test_manifests_import_no_runner() -> None:
    # export and prewarm read a runner through its public surface (their own Protocols), so
    # the runner may offer them as methods without a cycle.
    sources = runtime_sources()
    runners = {"graphguard.core.runner", "graphguard.segmented.runner"}
    for name in ("graphguard.core.export", "graphguard.core.prewarm"):
        assert graphguard_imports(sources[name]) & runners == set(), name
