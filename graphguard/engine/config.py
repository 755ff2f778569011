"""Frozen configuration for the engine: model shapes and engine settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama, Qwen3)."""

    arch: str  # "llama" | "qwen3"
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
    qk_norm: bool  # True for qwen3: RMSNorm on each head of q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen3"):
            raise ValueError(f"unsupported arch {self.arch!r}; expected 'llama' or 'qwen3'")
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
        qk_norm=False,
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
        qk_norm=True,
        bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
}


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one LLMEngine; "auto" device and dtype are resolved when the engine starts."""

    model: str | None = None  # load_model source: None/"embedded", a HF folder, or a .gguf file
    device: str = "auto"  # "auto" -> cuda if available else cpu
    dtype: str = "auto"  # "auto" -> bfloat16 on cuda, float32 on cpu
    enforce_eager: bool = False
    # each graph holds its own cuBLAS workspace (32 MiB with serve's CUBLAS_WORKSPACE_CONFIG),
    # so 2 GiB keeps every decode key of a 32-sequence server resident
    max_graph_bytes: int = 2 << 30
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 -> max_num_seqs full-length requests, within a memory allowance
    seed: int = 0
    graph_backend: str = "auto"  # "auto" -> CUDA graphs where capable; "sim" -> CPU stand-in
    graph_manifest: str | None = None  # prewarm the decode graphs of this manifest at start
    warmup_graphs: bool = False  # capture every decode (batch, width) key at start, in budget
    prefill_graphs: bool = True  # segmented prefill graphs next to decode graphs

    def __post_init__(self) -> None:
        if self.graph_backend not in ("auto", "cuda", "sim"):
            raise ValueError(f"graph_backend must be auto, cuda or sim, got {self.graph_backend!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        # One decode token for every running sequence must fit one step's token budget;
        # prompts longer than what a step has left are prefilled in chunks.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
