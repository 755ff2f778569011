"""Decoder models of the Llama family over paged KV: the shared trunk and model construction.

A model runs its ops through one kernel set (graphguard/kernels), the reference PyTorch one
unless `use_kernels` picks another before the first forward; graphs capture whatever set the
model runs, so an engine picks it once, before it builds its graphs.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from graphguard.engine.config import ModelConfig
from graphguard.engine.models.attention import AttentionMetadata
from graphguard.engine.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from graphguard.engine.models.parallel_layers import ModelShard, VocabParallelEmbedding
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.kernels import TorchKernels

# arch -> "module:class"; imported on first use so each family stays in its own file.
_FAMILIES = {
    "llama": "graphguard.engine.models.llama:LlamaModel",
    "qwen3": "graphguard.engine.models.qwen3:Qwen3Model",
}


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; families supply the layers.

    Parameter names match Hugging Face checkpoints without their ``model.`` prefix. With a
    `shard` the model is one tensor-parallel rank's (graphguard.engine.models.shard): `config`
    holds the rank's heads and MLP columns, and the embedding, LM head, o_proj and down_proj
    are the parallel layers that call the shard's collectives.
    """

    def __init__(self, config: ModelConfig, shard: ModelShard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            nn.Embedding(config.vocab_size, config.hidden_size)
            if shard is None
            else shard.embedding(config.hidden_size)
        )
        self.layers = nn.ModuleList(self.make_layer(config) for _ in range(config.num_layers))
        if shard is not None:
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                layer.self_attn.o_proj = shard.row_parallel(layer.self_attn.o_proj)
                layer.mlp.down_proj = shard.row_parallel(layer.mlp.down_proj)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # Tied checkpoints have no separate head: compute_logits reads the embedding.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if shard is None
            else shard.lm_head(config.hidden_size)
        )
        self.kernels = TorchKernels()

    def use_kernels(self, kernels: TorchKernels) -> None:
        """Run through `kernels` from now on (before any graph of this model is captured)."""
        self.kernels = kernels

    def fuse_projections(self) -> None:
        """Concatenate each layer's q/k/v and gate/up weights; call once the weights are on
        their device and dtype (moving the model afterwards would separate the views)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def make_layer(self, config: ModelConfig) -> DecoderLayer:
        raise NotImplementedError

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv: PagedKVStorage
    ) -> Tensor:
        """ids/positions ``[num_tokens]`` int64 -> final hidden states ``[num_tokens, hidden]``."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary(positions, h.dtype)
        if not meta.packed:
            ran = self.kernels.decode_layers(self.layers, h, rope, meta, kv)
            if ran is not None:
                return self.final_norm(*ran)
        residual: Tensor | None = None
        for layer, k_cache, v_cache in zip(self.layers, kv.k_cache, kv.v_cache, strict=True):
            h, residual = layer.forward(h, residual, rope, meta, (k_cache, v_cache), self.kernels)
        return self.final_norm(h, residual)

    def final_norm(self, h: Tensor, residual: Tensor | None) -> Tensor:
        """The last layer's output added to the residual stream, normed."""
        if residual is None:  # no layers
            return self.kernels.rms_norm(h, self.norm.weight, self.norm.eps)
        return self.kernels.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.kernels.head(hidden, weight)
        if self.shard is not None:  # this rank's vocabulary rows: gather every rank's
            logits = self.shard.gather_vocab(logits)
        return logits.float()


def model_class(arch: str) -> type[DecoderModel]:
    """The DecoderModel subclass for an architecture name ("llama", "qwen3")."""
    if arch not in _FAMILIES:
        raise ValueError(f"unsupported arch {arch!r}; known: {sorted(_FAMILIES)}")
    module_name, class_name = _FAMILIES[arch].split(":")
    cls: type[DecoderModel] = getattr(importlib.import_module(module_name), class_name)
    return cls


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int | None = None,
) -> DecoderModel:
    """A model with random weights (normal, std 0.02; norms at 1) for tests and benchmarks."""
    with torch.device("meta"):
        model = model_class(config.arch)(config)
    model.to_empty(device=device).to(dtype)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.rotary.reset_buffers(device)
    model.rotary.build_table(config.max_position_embeddings, dtype)
    model.fuse_projections()
    return model.eval().requires_grad_(False)


def build_model_from_weights(
    config: ModelConfig,
    weights: Mapping[str, Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> DecoderModel:
    """A model holding ``weights`` (our parameter names; every parameter must be present)."""
    with torch.device("meta"):
        model = model_class(config.arch)(config)
    state = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.reset_buffers(device)
    model.rotary.build_table(config.max_position_embeddings, dtype)
    model.fuse_projections()
    return model.eval().requires_grad_(False)


__all__ = ["DecoderModel", "build_model", "build_model_from_weights", "model_class"]
