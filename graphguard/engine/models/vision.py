"""A small ViT vision encoder whose output is spliced into the decoder's prompt embeddings.

Patch embedding (a strided convolution), learned position embeddings, a few pre-norm
transformer blocks with full (non-causal) attention, a final norm and a two-layer MLP projector
into the decoder's hidden size: the LLaVA layout. Weights are random with a fixed seed
(``VisionConfig.seed``): the tower exercises the data path, shapes and kernels, not vision
quality. Images become ``num_tokens_per_image`` embeddings each.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphguard.engine.models.images import ImageError, ImageLimits, image_positions

log = logging.getLogger("graphguard")


@dataclass(frozen=True)
class VisionConfig:
    """Shapes of the vision tower and the placeholder token that marks an image in a prompt."""

    image_size: int = 64
    patch_size: int = 16
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    layer_norm_eps: float = 1e-6
    seed: int = 0
    # A special token that chat text never produces; SmolLM2's tokenizer has it.
    image_token: str = "<empty_output>"
    limits: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError("image_size must be a multiple of patch_size")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class VisionBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); attention over all patches of one image."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(hidden, hidden * config.mlp_ratio)
        self.fc2 = nn.Linear(hidden * config.mlp_ratio, hidden)

    def forward(self, x: Tensor) -> Tensor:
        batch, num_patches, hidden = x.shape
        head_dim = hidden // self.num_heads
        qkv = self.qkv(self.norm1(x)).view(batch, num_patches, 3, self.num_heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, N, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, num_patches, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionEncoder(nn.Module):
    """Pixels ``[B, 3, S, S]`` -> image embeddings ``[B, num_patches, text_hidden]``."""

    def __init__(self, config: VisionConfig, text_hidden_size: int, image_token_id: int) -> None:
        super().__init__()
        self.config = config
        self.image_token_id = image_token_id
        hidden = config.hidden_size
        self.patch_embed = nn.Conv2d(3, hidden, config.patch_size, stride=config.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(config.num_patches, hidden))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.projector = nn.Sequential(
            nn.Linear(hidden, text_hidden_size),
            nn.GELU(),
            nn.Linear(text_hidden_size, text_hidden_size),
        )

    @property
    def num_tokens_per_image(self) -> int:
        return self.config.num_patches

    def forward(self, pixels: Tensor) -> Tensor:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)  # [B, N, hidden]
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.projector(self.norm(x))

    @torch.no_grad()
    def embed_images(self, images: Sequence[Tensor]) -> Tensor:
        """Embeddings of every image in order, ``[len(images) * num_tokens_per_image, hidden]``."""
        weight = self.pos_embed
        size = self.config.image_size
        for pixels in images:
            if tuple(pixels.shape) != (3, size, size):
                raise ImageError(f"pixels must be [3, {size}, {size}], got {tuple(pixels.shape)}")
        batch = torch.stack(list(images)).to(device=weight.device, dtype=weight.dtype)
        return self(batch).flatten(0, 1)


def build_vision_encoder(
    config: VisionConfig,
    *,
    text_hidden_size: int,
    image_token_id: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> VisionEncoder:
    """A vision encoder with random weights drawn on the CPU from ``config.seed``.

    Drawing on the CPU first makes the weights the same on every device.
    """
    encoder = VisionEncoder(config, text_hidden_size, image_token_id)
    generator = torch.Generator().manual_seed(config.seed)
    with torch.no_grad():
        for name, param in encoder.named_parameters():
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)


def request_image_embeds(
    encoder: VisionEncoder, prompt_token_ids: list[int], images: Sequence[Tensor]
) -> tuple[Tensor, list[int]]:
    """(embeddings, prompt positions) for a request's images; ValueError when they disagree.

    The prompt must hold exactly ``num_tokens_per_image`` placeholder tokens per image
    (``expand_image_tokens`` makes them); embeddings land on those positions in order.
    """
    limits = encoder.config.limits
    if len(images) > limits.max_images:
        raise ImageError(f"At most {limits.max_images} images per request are accepted.")
    positions = image_positions(prompt_token_ids, encoder.image_token_id)
    expected = len(images) * encoder.num_tokens_per_image
    if len(positions) != expected:
        raise ImageError(
            f"The prompt holds {len(positions)} image placeholder tokens; {len(images)} images "
            f"need {expected}.",
            code="invalid_image_placeholder",
        )
    return encoder.embed_images(images), positions


def engine_vision_encoder(
    tokenizer: Any,
    text_hidden_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    config: VisionConfig | None = None,
) -> VisionEncoder | None:
    """The engine's vision encoder, or None when the tokenizer lacks the placeholder token."""
    config = config or VisionConfig()
    token_id = tokenizer.token_to_id(config.image_token)
    if token_id is None:
        log.info("graphguard vision off: the tokenizer has no %r token", config.image_token)
        return None
    return build_vision_encoder(
        config,
        text_hidden_size=text_hidden_size,
        image_token_id=int(token_id),
        dtype=dtype,
        device=device,
    )
