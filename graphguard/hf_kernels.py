"""graphguard's fused Triton kernels in a transformers model's RMSNorms and SwiGLU MLPs (opt-in).

A graph replays the kernels a step launches; a transformers decoder layer launches about 60 at
decode (an RMSNorm alone is 8: cast, square, mean, add, rsqrt, multiply, cast, scale), so a
small model's replay is bound by launches, not by bytes. `fuse_kernels(model)` swaps each
RMSNorm for one kernel (graphguard/kernels/triton_norm.py) and each SwiGLU MLP's activation and
product for one (triton_mlp.py), about halving a layer's launches. The swapped modules hold the
model's own weights and projections (a PEFT adapter on a projection still applies; weights
loaded in place are read), and `Fusion.restore()` puts the originals back.

What is swapped is checked first: each module class's fused forward is compared with its own
forward on random rows, and a class that computes something else (Gemma's ``1 + weight``, a
norm with a bias, an MLP whose activation is not SiLU) is left as it is, with the reason in
`Fusion.skipped`. The fused kernels compute in float32 as transformers does but reduce in
another order: logits agree within rounding, not bit for bit, so greedy tokens can part where
two logits nearly tie. Parity of graphs is unaffected: graph and eager run the same kernels.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from graphguard.kernels.reference import QKNorm

# Relative error of a fused module against its own forward on random rows that a swap may have,
# by dtype: a few roundings of it (2**-8 each in bfloat16), far under what a different formula
# gives.
MAX_REL_ERROR = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SILU_NAMES = frozenset({"SiLU", "SiLUActivation"})


class FusedRMSNorm(nn.Module):
    """One kernel for a transformers RMSNorm (``weight * (x / rms(x)).to(dtype)``, statistics in
    float32): the original's weight, read in place. Falls to the original where the input is
    not the weight's dtype (transformers then returns the wider dtype)."""

    original: Any  # the transformers module: its weight, and its forward as the fallback

    def __init__(self, original: nn.Module, eps: float):
        super().__init__()
        self.original = original
        self.eps = eps
        self.rms_norm = kernel_ops().rms_norm

    def forward(self, x: Tensor) -> Tensor:
        weight = self.original.weight
        if x.dtype != weight.dtype or x.shape[-1] != weight.shape[0]:
            return self.original(x)
        rows = x.reshape(-1, x.shape[-1])
        return self.rms_norm(rows, weight, self.eps).view(x.shape)


class FusedSwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the activation and product in one kernel; the
    projections are the original modules (adapters on them apply)."""

    original: Any  # the transformers MLP: gate_proj, up_proj, down_proj

    def __init__(self, original: nn.Module):
        super().__init__()
        self.original = original
        self.silu_mul_pair = kernel_ops().silu_mul_pair

    def forward(self, x: Tensor) -> Tensor:
        mlp = self.original
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        width = gate.shape[-1]
        both = self.silu_mul_pair(gate.reshape(-1, width), up.reshape(-1, width))
        return mlp.down_proj(both.view(gate.shape))


class FusedAttention(nn.Module):
    """A transformers attention with its q/k norms (where the model has them) and RoPE in one
    kernel (graphguard/kernels/triton_rope.py `rope_pair`); the projections, the cache update
    (`past_key_values.update`) and the attention function (transformers' registry, by the
    model's `attn_implementation`) are the model's own."""

    original: Any  # the transformers attention: projections, norms, config, layer_idx

    def __init__(self, original: nn.Module, qk_norm: QKNorm | None):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        super().__init__()
        self.original = original
        self.qk_norm = qk_norm  # the norms' weights (read in place) and eps
        self.rope_pair = kernel_ops().rope_pair
        self.attention_functions = ALL_ATTENTION_FUNCTIONS  # by attn_implementation, at call

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor | None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        attn = self.original
        batch, length = hidden_states.shape[:2]
        heads = (batch * length, -1, attn.head_dim)
        cos, sin = position_embeddings
        q, k = self.rope_pair(
            attn.q_proj(hidden_states).view(heads), attn.k_proj(hidden_states).view(heads),
            cos, sin, self.qk_norm,
        )  # fmt: skip
        q, k, v = (
            x.view(batch, length, -1, attn.head_dim).transpose(1, 2)
            for x in (q, k, attn.v_proj(hidden_states))
        )
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attn.layer_idx)
        if hasattr(attn, "sliding_window"):
            kwargs["sliding_window"] = attn.sliding_window
        attend = self.attention_functions[attn.config._attn_implementation]
        out, weights = attend(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                              **kwargs)  # fmt: skip
        return attn.o_proj(out.reshape(batch, length, -1).contiguous()), weights


@functools.cache
def kernel_ops() -> SimpleNamespace:
    """The fused kernels as PyTorch operators (`graphguard::rms_norm`, `silu_mul_pair`,
    `rope_pair`), registered on first use: the dispatcher sees each launch, so a capture's
    record run sees what it writes and the CPU stand-in records it like any op.

    NOTE: the kernels are imported here, not by this file: Triton is not there on every machine
    that imports graphguard.hf."""
    from graphguard.kernels import triton_mlp, triton_norm, triton_rope

    @torch.library.custom_op("graphguard::rms_norm", mutates_args=())
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return triton_norm.rms_norm(x, weight, eps)

    @torch.library.custom_op("graphguard::silu_mul_pair", mutates_args=())
    def silu_mul_pair(gate: Tensor, up: Tensor) -> Tensor:
        return triton_mlp.silu_mul_pair(gate, up)

    @torch.library.custom_op("graphguard::rope_pair", mutates_args=())
    def rope_normed(
        q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
        k_weight: Tensor | None, eps: float,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        norm = None if q_weight is None or k_weight is None else QKNorm(q_weight, k_weight, eps)
        return triton_rope.rope_pair(q, k, cos, sin, norm)

    def rope_pair(
        q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, norm: QKNorm | None
    ) -> tuple[Tensor, Tensor]:
        if norm is None:
            return rope_normed(q, k, cos, sin, None, None, 0.0)
        return rope_normed(q, k, cos, sin, norm.q_weight, norm.k_weight, norm.eps)

    return SimpleNamespace(rms_norm=rms_norm, silu_mul_pair=silu_mul_pair, rope_pair=rope_pair)


@dataclass
class Fusion:
    """What `fuse_kernels` swapped (parent module, attribute, original) and what it left, by
    class name with the reason."""

    swapped: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def restore(self) -> None:
        """Put every original module back."""
        for parent, name, original in reversed(self.swapped):
            setattr(parent, name, original)
        self.swapped.clear()


def fuse_kernels(model: nn.Module) -> Fusion:
    """Swap `model`'s RMSNorms and SwiGLU MLPs for graphguard's fused kernels, in place (see the
    module docstring). Needs a CUDA model (or Triton's CPU interpreter, TRITON_INTERPRET=1).

    NOTE: each module is checked on its own: modules of one class may compute different things
    (a layer without RoPE among layers with it)."""
    device = next(model.parameters()).device
    _check_device(device)
    fusion = Fusion()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            fused = _fused(child)
            if fused is None:
                continue
            why = fused if isinstance(fused, str) else _disagreement(child, fused, device)
            if why is not None:
                fusion.skipped.setdefault(type(child).__name__, why)
                continue
            assert isinstance(fused, nn.Module)
            setattr(parent, name, fused)
            fusion.swapped.append((parent, name, child))
    return fusion


def _check_device(device: torch.device) -> None:
    from graphguard.kernels import triton_missing

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ValueError(
            f"fused kernels run on a CUDA device; this model is on {device} "
            "(keep transformers' kernels there)"
        )
    missing = triton_missing(device) if device.type == "cuda" else None
    if missing:
        raise ValueError(f"fused kernels need Triton: {missing}")


def _fused(module: nn.Module) -> nn.Module | str | None:
    """The fused stand-in for a module this file knows the shape of, why it has none (a
    feature the kernels do not compute), or None for a module of another shape."""
    name = type(module).__name__
    if name.endswith("Attention"):
        return _fused_attention(module)
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if name.endswith("RMSNorm") and isinstance(weight, Tensor) and weight.dim() == 1:
        if isinstance(eps, float) and getattr(module, "bias", None) is None:
            return FusedRMSNorm(module, eps)
    parts = ("gate_proj", "up_proj", "down_proj", "act_fn")
    if name.endswith("MLP") and all(hasattr(module, part) for part in parts):
        if type(module.act_fn).__name__ in SILU_NAMES:
            return FusedSwiGLU(module)
    return None


# What an attention may do that FusedAttention does not, by the attribute that says it does.
_ATTENTION_EXTRAS = {
    "attn_logit_softcapping": "soft-caps its attention logits",
    "logit_softcapping": "soft-caps its attention logits",
}


def _fused_attention(module: Any) -> nn.Module | str | None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    parts = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config")
    if not all(hasattr(module, part) for part in parts):
        return None
    for attribute, what in _ATTENTION_EXTRAS.items():
        if getattr(module, attribute, None):
            return f"{what} ({attribute}), which the fused attention does not"
    if not getattr(module, "use_rope", True):
        return "a layer without RoPE, which the fused attention rotates"
    head_dim = module.head_dim
    if (
        head_dim & (head_dim - 1)
        or module.config._attn_implementation not in ALL_ATTENTION_FUNCTIONS
    ):
        return None  # the kernel takes power-of-two heads; "eager" is each model's own function
    q_norm: Any = getattr(module, "q_norm", None)
    k_norm: Any = getattr(module, "k_norm", None)
    if q_norm is None and k_norm is None:
        return FusedAttention(module, None)
    if any(not isinstance(_fused(n), FusedRMSNorm) for n in (q_norm, k_norm)):
        return None
    eps: set[Any] = {
        getattr(n, "variance_epsilon", getattr(n, "eps", None)) for n in (q_norm, k_norm)
    }
    if len(eps) != 1:
        return None
    return FusedAttention(module, QKNorm(q_norm.weight, k_norm.weight, float(eps.pop())))


@torch.no_grad()
def _disagreement(original: nn.Module, fused: nn.Module, device: torch.device) -> str | None:
    """Why `fused` may not stand in for `original` (None: it agrees on random rows)."""
    args = _sample_inputs(original, device)
    try:
        expected, got = original(*args), fused(*args)
    except Exception as exc:  # noqa: BLE001 - a module the kernels cannot take is left alone
        return f"the fused forward failed: {type(exc).__name__}: {exc}"
    if isinstance(expected, tuple):  # an attention's (output, weights)
        expected, got = expected[0], got[0]
    error = (got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)
    if got.shape != expected.shape or error > MAX_REL_ERROR.get(expected.dtype, 2e-2):
        return f"computes something else (relative error {float(error):.3g})"
    return None


def _sample_inputs(module: Any, device: torch.device) -> tuple[Any, ...]:
    """Random arguments of a module's forward: rows of its width (an attention: 3 tokens with
    random cos/sin tables, no mask, no cache)."""
    dtype = next(module.parameters()).dtype
    generator = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    if hasattr(module, "q_proj"):
        angles = rand(1, 3, module.head_dim)
        rows = rand(1, 3, module.q_proj.in_features)
        return rows, (angles.cos(), angles.sin()), None
    weight: Any = getattr(module, "weight", None)
    width = weight.shape[0] if isinstance(weight, Tensor) else module.gate_proj.in_features
    return (rand(3, int(width)),)


__all__ = ["Fusion", "FusedAttention", "FusedRMSNorm", "FusedSwiGLU", "fuse_kernels"]
