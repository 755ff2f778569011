"""graphguard: bounded, verified CUDA graphs for PyTorch inference.

The graph runtime is imported here; the serving engine's offline API (`graphguard.LLM`,
`graphguard.SamplingParams`, `graphguard.RequestOutput`, `graphguard.CompletionOutput`,
`graphguard.Logprob`) is imported on first use, so that
`import graphguard` stays light for users of the runtime alone.
"""

from typing import Any

from graphguard.core.admission import AdmissionConfig
from graphguard.core.backends import CaptureError, CudaBackend
from graphguard.core.entry import GraphEntry, OwnerCycleError, RetiredEntryError
from graphguard.core.graph_runner import GraphRunner
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.options import CaptureConfig
from graphguard.core.reasons import CaptureOutcome, EvictionCause, FallbackReason
from graphguard.core.sim import SimBackend
from graphguard.core.switch import KILL_SWITCH_ENV
from graphguard.core.verify import ParityError, VerifyConfig
from graphguard.version import __version__

# name -> module of the lazily imported offline API
_LAZY = {
    "LLM": "graphguard.engine.llm",
    "CompletionOutput": "graphguard.engine.llm",
    "RequestOutput": "graphguard.engine.llm",
    "Logprob": "graphguard.engine.llm",
    "SamplingParams": "graphguard.engine.tokens.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphguard' has no attribute {name!r}")


__all__ = [
    "AdmissionConfig",
    "Buckets",
    "CaptureConfig",
    "CaptureError",
    "CaptureOutcome",
    "CompletionOutput",
    "CudaBackend",
    "EvictionCause",
    "FallbackReason",
    "GraphEntry",
    "GraphKey",
    "GraphMetrics",
    "GraphRunner",
    "KILL_SWITCH_ENV",
    "LLM",
    "Logprob",
    "OwnerCycleError",
    "ParityError",
    "RequestOutput",
    "RetiredEntryError",
    "SamplingParams",
    "SimBackend",
    "VerifyConfig",
    "__version__",
]
