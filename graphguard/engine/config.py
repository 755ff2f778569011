"""Frozen configuration for the engine: model shapes and engine settings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from graphguard.core.admission import AdmissionConfig

# The engine's admission policy: the runtime's defaults plus payback (rent-or-buy break-even).
ENGINE_ADMISSION = AdmissionConfig(payback=1.0)

# What EngineConfig.kernels accepts (graphguard.kernels.KernelChoice's values).
KERNEL_CHOICES = ("auto", "torch", "triton", "q4")
OVERLAP_CHOICES = ("auto", "on", "off")

# The model families the engine runs: arch -> the Hugging Face architecture name it loads.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama, Qwen3)."""

    arch: str  # a key of ARCHITECTURES (qwen3 adds RMSNorm on each head of q and k)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            expected = " or ".join(repr(a) for a in ARCHITECTURES)
            raise ValueError(f"unsupported arch {self.arch!r}; expected {expected}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )


# Real shapes of the published checkpoints; random-weight benchmarks build from these.
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
}


@dataclass(frozen=True)
class CapturePacing:
    """How much of a step a capture in flight may take (graphguard/engine/graphs/pacing.py)."""

    max_deferred_steps: int = 8  # steps in a row a pending prefill may put a capture off...
    max_deferred_ms: float = 200.0  # ...and for at least this long
    slice_ms: float = 10.0  # capture work per step; a unit that starts inside it runs whole

    def __post_init__(self) -> None:
        if self.max_deferred_steps < 0:
            raise ValueError(f"max_deferred_steps must be >= 0, got {self.max_deferred_steps}")
        if self.max_deferred_ms < 0:
            raise ValueError(f"max_deferred_ms must be >= 0, got {self.max_deferred_ms}")
        if self.slice_ms < 0:
            raise ValueError(f"slice_ms must be >= 0, got {self.slice_ms}")


@dataclass(frozen=True)
class GraphConfig:
    """How the engine uses CUDA graphs; graphguard/engine/graphs builds them from this."""

    enforce_eager: bool = False  # decode and prefill eagerly, never through graphs
    backend: str = "auto"  # "auto" -> CUDA graphs where capable; "sim" -> CPU stand-in
    # each graph holds its own cuBLAS workspace (32 MiB with serve's CUBLAS_WORKSPACE_CONFIG),
    # so 2 GiB keeps every decode key of the narrowest table resident (seven buckets up to the
    # default 64 sequences, 224 MiB of workspaces) with room for the wider tables' keys
    max_bytes: int = 2 << 30  # budget of the decode graphs, and separately of the prefill ones
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    manifest: str | None = None  # prewarm the decode graphs of this manifest at start
    warmup: bool = False  # capture every decode (batch, width) key at start, in budget
    # segmented prefill graphs next to decode graphs, and packed prefills padded to token
    # buckets (so their keys recur) whether or not graphs run
    prefill: bool = True
    # capture a key earned by traffic between steps, one bounded unit of work per step, while
    # its steps run eagerly (capture_in_progress); False captures inside the step that earns it
    background_capture: bool = True
    # how much of a step those captures may take: none while prefills wait (within a bound),
    # else units up to a time slice (graphguard/engine/graphs/pacing.py)
    capture_pacing: CapturePacing = CapturePacing()
    # eager runs of a key on its graph's stream before the capture: the engine compiles its
    # kernels at start, so one does (the runtime's default, for any function, is two)
    capture_warmups: int = 1
    # a lazy start (no warmup) captures a ladder of decode and prefill keys a pad factor
    # apart (below), so the payback rule knows what a capture costs before traffic earns one
    # and every decode batch and short prefill rides a graph from the first step (graphs.py
    # `_price_captures`, keys.py `pad_ladder`)
    price_captures: bool = True
    # a decode batch (a prefill as rows) whose bucket has no graph yet, its capture not
    # earned or in flight, replays the smallest admitted larger bucket of the same width, up
    # to this many times its rows, instead of running eagerly (GraphRunner max_pad_factor):
    # a wave's last rows ride the graph of its 16, a small prefill that of a larger one
    decode_pad_factor: int = 16
    row_pad_factor: int = 4
    verify: str = "exact"  # parity before admission: "exact" | "off"
    reverify_every: int = 0  # compare every N-th decode replay with eager too (0: never)
    # when traffic earns a key (graphguard/core/admission.py): the engine's default adds the
    # payback rule, so a key is captured once its eager steps have cost a capture's price
    admission: AdmissionConfig = ENGINE_ADMISSION  # decode graphs
    prefill_admission: AdmissionConfig = ENGINE_ADMISSION  # prefill groups

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "cuda", "sim"):
            raise ValueError(f"graph backend must be auto, cuda or sim, got {self.backend!r}")
        if self.verify not in ("exact", "off"):
            raise ValueError(f"graph verify must be exact or off, got {self.verify!r}")
        if self.capture_warmups < 1:
            raise ValueError(f"capture_warmups must be >= 1, got {self.capture_warmups}")
        if self.decode_pad_factor < 1 or self.row_pad_factor < 1:
            raise ValueError(
                f"pad factors must be >= 1, got {self.decode_pad_factor}, {self.row_pad_factor}"
            )
        if self.reverify_every < 0:
            raise ValueError(f"reverify_every must be >= 0, got {self.reverify_every}")
        if self.max_bytes < 0:
            raise ValueError(f"max graph bytes must be >= 0, got {self.max_bytes}")
        if not self.batch_buckets or any(b <= 0 for b in self.batch_buckets):
            raise ValueError(f"batch buckets must be positive, got {self.batch_buckets}")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one LLMEngine; "auto" device and dtype are resolved when the engine starts."""

    model: str | None = None  # load_model source: None/"embedded", a HF folder, or a .gguf file
    device: str = "auto"  # "auto" -> cuda if available else cpu
    dtype: str = "auto"  # "auto" -> bfloat16 on cuda, float32 on cpu
    max_num_seqs: int = 64
    # tokens one step may run, decodes and prefills together; a longer prompt is prefilled in
    # chunks of what is left. 0 -> step_token_budget(): by the device's memory
    max_num_batched_tokens: int = 0
    # longest prompt plus completion; 0: the model's own context, at most DEFAULT_MAX_MODEL_LEN
    # (the KV pool is sized for max_num_seqs requests this long). More than the model's is
    # refused (model_len), as vLLM refuses it.
    max_model_len: int = 0
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 -> max_num_seqs full-length requests, within a memory allowance
    seed: int = 0
    # the decoder's kernel set: "auto" (fused Triton kernels on CUDA in half precision, else
    # the plain PyTorch ops), "torch" or "triton" (graphguard/kernels)
    kernels: str = "auto"
    # ranks of tensor parallelism, one process (and GPU) each (graphguard/engine/parallel)
    tensor_parallel_size: int = 1
    # how long a rank waits on the others in a collective before serving ends with an error
    collective_timeout_s: float = 120.0
    # launch a greedy decode step before the host reads the last one's tokens: "auto" on
    # CUDA with one rank, "on" anywhere with one rank, "off" (graphguard/engine/step/overlap.py)
    overlap_decode: str = "auto"
    # reuse the KV blocks of the longest cached prefix of a prompt (scheduling/prefix_cache.py)
    prefix_caching: bool = True
    # vLLM's: the share of the GPU's whole memory the engine may hold, its KV pool sized to
    # what the weights leave of it; 0: half of the memory free when the pool is made
    gpu_memory_utilization: float = 0.0
    graphs: GraphConfig = GraphConfig()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len < 0:
            raise ValueError(
                f"max_model_len must be >= 0 (0: the model's own), got {self.max_model_len}"
            )
        if self.max_num_batched_tokens < 0:
            raise ValueError(
                f"max_num_batched_tokens must be >= 0 (0: by the device), "
                f"got {self.max_num_batched_tokens}"
            )
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1] (0: by the free memory), "
                f"got {self.gpu_memory_utilization}"
            )
        if self.tensor_parallel_size < 1 or self.collective_timeout_s <= 0:
            raise ValueError("tensor_parallel_size must be >= 1 and collective_timeout_s > 0")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.kernels == "q4" and self.dtype not in ("auto", "float32"):
            raise ValueError(
                "kernels='q4' runs on a CPU with float32 activations: dtype auto or float32"
            )
        if self.kernels == "q4" and self.tensor_parallel_size > 1:
            raise ValueError("kernels='q4' runs in one process: tensor_parallel_size must be 1")
        if self.overlap_decode not in OVERLAP_CHOICES:
            raise ValueError(
                f"overlap_decode must be one of {OVERLAP_CHOICES}, got {self.overlap_decode!r}"
            )
        # One decode token for every running sequence must fit one step's token budget;
        # prompts longer than what a step has left are prefilled in chunks.
        if 0 < self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )


DEFAULT_MAX_MODEL_LEN = 2048  # max_model_len 0: the model's context, at most this


def model_len(config: EngineConfig, max_positions: int) -> int:
    """The context the engine serves: config.max_model_len, or where that is 0 the model's
    `max_positions`, at most DEFAULT_MAX_MODEL_LEN; ValueError where the config asks for more
    than the model has."""
    if not config.max_model_len:
        return min(max_positions, DEFAULT_MAX_MODEL_LEN)
    if config.max_model_len > max_positions:
        raise ValueError(
            f"max_model_len {config.max_model_len} is longer than the model's context of "
            f"{max_positions} tokens (max_position_embeddings in its config.json); give at "
            f"most {max_positions}"
        )
    return config.max_model_len


# A step's token budget when the config leaves it to the device (max_num_batched_tokens 0):
# STEP_TOKENS_LARGE_GPU on a GPU of LARGE_GPU_BYTES or more (H100, H200 class), where the larger
# chunk lifts a long prompt's prefill (one 30k-token prompt on an H200: 56k tok/s at 4,096-token
# chunks, 67k at 8,192) at the cost of twice as long a pause for the decodes that share its
# steps; STEP_TOKENS elsewhere.
STEP_TOKENS = 4096
STEP_TOKENS_LARGE_GPU = 8192
LARGE_GPU_BYTES = 70 << 30


def step_token_budget(config: EngineConfig, device_memory_bytes: int | None) -> int:
    """Tokens one step may run: the config's max_num_batched_tokens, or when that is 0, the
    default for a device of `device_memory_bytes` (None: not a GPU); never fewer than
    max_num_seqs, so that every running sequence's decode token fits a step."""
    if config.max_num_batched_tokens:
        return config.max_num_batched_tokens
    large = device_memory_bytes is not None and device_memory_bytes >= LARGE_GPU_BYTES
    return max(STEP_TOKENS_LARGE_GPU if large else STEP_TOKENS, config.max_num_seqs)


# The engine's settings as flat names (the serve flags' vocabulary: --enforce-eager,
# --max-graph-bytes, ...) -> the GraphConfig field each one sets.
GRAPH_SETTINGS = {
    "enforce_eager": "enforce_eager",
    "graph_backend": "backend",
    "max_graph_bytes": "max_bytes",
    "batch_buckets": "batch_buckets",
    "graph_manifest": "manifest",
    "warmup_graphs": "warmup",
    "prefill_graphs": "prefill",
    "background_capture": "background_capture",
    "price_captures": "price_captures",
}


def engine_config(**settings: Any) -> EngineConfig:
    """An EngineConfig from flat settings: EngineConfig fields, plus the graph settings of
    GRAPH_SETTINGS (``engine_config(max_model_len=256, enforce_eager=True)``)."""
    graphs = {GRAPH_SETTINGS[k]: settings.pop(k) for k in list(settings) if k in GRAPH_SETTINGS}
    base = settings.pop("graphs", GraphConfig())
    return EngineConfig(**settings, graphs=replace(base, **graphs))
