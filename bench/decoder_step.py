"""A Qwen3-shaped decoder step with random weights and a static KV cache, for benchmarks.

Self-contained on purpose: the runtime benchmarks measure graph mechanics on a realistic kernel
mix (~700 small kernels per step for the 0.6B shape) without depending on the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass(frozen=True)
class StepShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


SHAPES = {
    "qwen3-0.6b": StepShape(28, 1024, 16, 8, 128, 3072, 151936),
    "smollm2-135m": StepShape(30, 576, 9, 3, 64, 1536, 49152),
    "tiny": StepShape(2, 64, 4, 2, 16, 128, 256),
}


_ALL_SDPA = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class DecoderStep:
    """step(ids[B], pos[B]) -> logits[B, vocab]; row i reads and writes KV cache row i."""

    def __init__(
        self,
        shape: StepShape,
        *,
        max_batch: int,
        context: int,
        dtype,
        device,
        seed=0,
        attention: str = "math",
    ):
        # "math" pins SDPA's math backend; "default" lets PyTorch choose (cuDNN on an H200).
        self.sdpa_backends = [SDPBackend.MATH] if attention == "math" else _ALL_SDPA
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.shape, self.context = shape, context

        def w(*size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=g) * size[-1] ** -0.5).to(dtype).to(device)

        s = shape
        self.embed = w(s.vocab, s.hidden)
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.layers = [
            dict(
                qkv=w(q + 2 * kv, s.hidden),
                o=w(s.hidden, q),
                up=w(2 * s.intermediate, s.hidden),
                down=w(s.hidden, s.intermediate),
                n1=torch.ones(s.hidden, dtype=dtype, device=device),
                n2=torch.ones(s.hidden, dtype=dtype, device=device),
                qn=torch.ones(s.head_dim, dtype=dtype, device=device),
                kn=torch.ones(s.head_dim, dtype=dtype, device=device),
            )
            for _ in range(s.num_layers)
        ]
        self.norm = torch.ones(s.hidden, dtype=dtype, device=device)
        cache = (s.num_layers, max_batch, context, s.num_kv_heads, s.head_dim)
        self.k_cache = torch.zeros(cache, dtype=dtype, device=device)
        self.v_cache = torch.zeros(cache, dtype=dtype, device=device)
        inv = 1.0 / (1e6 ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        angles = torch.outer(torch.arange(context, dtype=torch.float32), inv)
        self.cos = angles.cos().to(dtype).to(device)
        self.sin = angles.sin().to(dtype).to(device)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        s = self.shape
        batch = ids.shape[0]
        rows = torch.arange(batch, device=ids.device)
        x = self.embed[ids]
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        mask = torch.arange(self.context, device=ids.device)[None, :] <= pos[:, None]
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,), layer["n1"])
            q, k, v = (h @ layer["qkv"].T).split(
                [
                    s.num_heads * s.head_dim,
                    s.num_kv_heads * s.head_dim,
                    s.num_kv_heads * s.head_dim,
                ],
                -1,
            )
            q = _rope(
                F.rms_norm(q.view(batch, s.num_heads, s.head_dim), (s.head_dim,), layer["qn"]),
                cos,
                sin,
            )
            k = _rope(
                F.rms_norm(k.view(batch, s.num_kv_heads, s.head_dim), (s.head_dim,), layer["kn"]),
                cos,
                sin,
            )
            self.k_cache[i, rows, pos] = k
            self.v_cache[i, rows, pos] = v.view(batch, s.num_kv_heads, s.head_dim)
            keys, values = self.k_cache[i, :batch], self.v_cache[i, :batch]  # [B, ctx, kvh, hd]
            # NOTE: the math backend on purpose: on an H200 (torch 2.11) the cuDNN attention
            # backend chosen by default here gave graph replays that differ from eager in one
            # or two rows once the KV cache had churned (caught by exact parity admission).
            with sdpa_kernel(self.sdpa_backends):
                attn = F.scaled_dot_product_attention(
                    q[:, :, None, :],
                    keys.transpose(1, 2),
                    values.transpose(1, 2),
                    attn_mask=mask[:, None, None, :],
                    enable_gqa=True,
                )
            x = x + attn.reshape(batch, -1) @ layer["o"].T
            h = F.rms_norm(x, (s.hidden,), layer["n2"])
            gate, up = (h @ layer["up"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        return (F.rms_norm(x, (s.hidden,), self.norm) @ self.embed.T).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def step_inputs(
    batch: int, context: int, device, seed: int = 0, vocab: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (batch,), generator=g).to(device)
    pos = torch.randint(0, context, (batch,), generator=g).to(device)
    return ids, pos
