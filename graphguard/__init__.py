"""graphguard: bounded, verified CUDA graphs for PyTorch inference."""

from graphguard.core.admission import AdmissionConfig
from graphguard.core.backends import CaptureError, CudaBackend
from graphguard.core.entry import GraphEntry, OwnerCycleError, RetiredEntryError
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import FallbackReason
from graphguard.core.runner import KILL_SWITCH_ENV, GraphRunner, ParityError
from graphguard.core.sim import SimBackend

__version__ = "0.1.0"

__all__ = [
    "AdmissionConfig",
    "Buckets",
    "CaptureError",
    "CudaBackend",
    "FallbackReason",
    "GraphEntry",
    "GraphKey",
    "GraphMetrics",
    "GraphRunner",
    "KILL_SWITCH_ENV",
    "OwnerCycleError",
    "ParityError",
    "RetiredEntryError",
    "SimBackend",
    "__version__",
]
