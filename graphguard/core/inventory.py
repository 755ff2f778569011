"""Node inventory of a captured graph, read from the executable graph through cuda.bindings.

For each graph: how many nodes it has, how many of each type, and the names of the kernels its
kernel nodes launch. Reading never raises and never touches the graph's state: where the
inventory cannot be read (the simulation backend, cuda.bindings not installed, a torch without
`raw_cuda_graph()`, a CUDA error), `NodeInventory.unavailable` says why, per graph.

The caller keeps the graph alive (and unreset) while this runs: export holds the entry's lock,
which retire() also takes.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")
_BINDINGS = (("cuda.bindings.runtime", "cuda.bindings.driver"), ("cuda.cudart", "cuda.cuda"))


@dataclass(frozen=True)
class NodeInventory:
    """What a graph launches: node count, nodes by type, kernel launches by kernel name."""

    num_nodes: int | None = None
    node_types: dict[str, int] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)  # name -> launches, most first
    unavailable: str | None = None  # "unavailable: <why>" when nothing could be read

    @property
    def is_available(self) -> bool:
        return self.unavailable is None

    def to_json(self) -> dict[str, Any]:
        if self.unavailable is not None:
            return {"available": False, "reason": self.unavailable}
        return {
            "available": True,
            "num_nodes": self.num_nodes,
            "node_types": dict(self.node_types),
            "kernels": dict(self.kernels),
        }


def unavailable(why: str) -> NodeInventory:
    return NodeInventory(unavailable=f"unavailable: {why}")


def load_bindings() -> tuple[Any, Any] | str:
    """(runtime, driver) modules of cuda.bindings (or of older cuda-python), or why not."""
    # cuda-python before 12.6 exposed the same bindings as cuda.cudart and cuda.cuda.
    for runtime, driver in _BINDINGS:
        try:
            return importlib.import_module(runtime), importlib.import_module(driver)
        except ImportError:
            continue
        except Exception as exc:  # noqa: BLE001 - a broken install reads as unavailable
            return f"cuda.bindings cannot be imported ({type(exc).__name__}: {exc})"
    return "cuda.bindings is not installed (pip install cuda-bindings)"


def read_inventory(graph: Any, backend_name: str | None) -> NodeInventory:
    """The node inventory of `graph` (a torch.cuda.CUDAGraph captured with keep_graph=True)."""
    if backend_name != "cuda":
        return unavailable(f"the {backend_name} backend has no CUDA graph nodes")
    if graph is None:
        return unavailable("the graph was retired")
    bindings = load_bindings()
    if isinstance(bindings, str):
        return unavailable(bindings)
    raw = getattr(graph, "raw_cuda_graph", None)
    if raw is None:
        return unavailable("this torch's CUDAGraph has no raw_cuda_graph()")
    try:
        return _read(bindings[0], bindings[1], int(raw()))
    except Exception as exc:  # noqa: BLE001 - an inventory must never break an export
        return unavailable(f"{type(exc).__name__}: {exc}")


def _read(cudart: Any, driver: Any, handle: int) -> NodeInventory:
    graph = cudart.cudaGraph_t(init_value=handle)
    nodes = _graph_nodes(cudart, graph)
    if isinstance(nodes, str):
        return unavailable(nodes)
    kernel_type = cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel
    types: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for node in nodes:
        err, node_type = cudart.cudaGraphNodeGetType(node)
        if err != cudart.cudaError_t.cudaSuccess:
            return unavailable(f"cudaGraphNodeGetType: {_error_name(err)}")
        types[_type_name(node_type)] += 1
        if node_type == kernel_type:
            kernels[_safe_kernel_name(driver, int(node))] += 1
    return NodeInventory(
        num_nodes=len(nodes),
        node_types=dict(types.most_common()),
        kernels=dict(kernels.most_common()),
    )


def _graph_nodes(cudart: Any, graph: Any) -> list[Any] | str:
    """Every node of `graph`; asked first for the count (numNodes=0), then for the nodes."""
    err, _, count = cudart.cudaGraphGetNodes(graph, 0)
    if err != cudart.cudaError_t.cudaSuccess:
        return f"cudaGraphGetNodes: {_error_name(err)}"
    if not count:
        return []
    err, nodes, count = cudart.cudaGraphGetNodes(graph, count)
    if err != cudart.cudaError_t.cudaSuccess:
        return f"cudaGraphGetNodes: {_error_name(err)}"
    return list(nodes)[:count]


def _safe_kernel_name(driver: Any, node_handle: int) -> str:
    # One unreadable name (say, a driver without cuFuncGetName) keeps the node counts.
    try:
        return kernel_name(driver, node_handle)
    except Exception as exc:  # noqa: BLE001
        return f"<unknown: {type(exc).__name__}: {exc}>"


def kernel_name(driver: Any, node_handle: int) -> str:
    """The name of the kernel a kernel node launches (possibly mangled), or why it has none."""
    node = driver.CUgraphNode(init_value=node_handle)
    err, params = driver.cuGraphKernelNodeGetParams(node)
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"<unknown: cuGraphKernelNodeGetParams {_error_name(err)}>"
    if int(params.func):
        func = driver.CUfunction(init_value=int(params.func))
        err, name = driver.cuFuncGetName(func)
    elif int(getattr(params, "kern", 0) or 0):
        # A node launched through a library kernel handle leaves func empty and sets kern.
        kern = driver.CUkernel(init_value=int(params.kern))
        err, name = driver.cuKernelGetName(kern)
    else:
        return "<unknown: kernel node has no function>"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"<unknown: {_error_name(err)}>"
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _type_name(node_type: Any) -> str:
    """cudaGraphNodeTypeWaitEvent -> "wait_event"."""
    name = getattr(node_type, "name", str(node_type)).removeprefix("cudaGraphNodeType")
    return _CAMEL.sub("_", name).lower()


def _error_name(err: Any) -> str:
    return str(getattr(err, "name", err))
