"""4-bit GEMMs on the CPU for weights that are 4-bit already (a Q4_1 GGUF, the embedded model).

A Q4_1 checkpoint stores each run of 32 weights as 16 levels: ``w = d * q + m`` with ``q`` in
0..15 and one scale ``d`` and minimum ``m`` per block. Dequantized to float, the block still
holds those levels exactly: its minimum is ``m`` and its maximum ``m + 15 d``. `pack_q4` reads
them back from the float weight (no GGUF parsing, and the loader's row order is kept) and packs
them for PyTorch's int4 CPU matmul, whose scale and zero per block give
``(q - 8) * scale + zero``: ``scale = d`` and ``zero = m + 8 d``. A weight whose blocks are not
such levels (it was not 4-bit, or not in blocks of 32) is refused and stays a plain GEMM.

The levels are read from the float32 weights, where they are exact: a bfloat16 copy has lost
them (its rounding moves a block's minimum and maximum). The int4 matmul takes bfloat16
activations and stores each block's scale and zero in bfloat16 (the checkpoint's are float16),
so a GEMM's result is close to, not bitwise, the float32 reference's; everything between the
GEMMs stays float32 (graphguard/kernels/cpu_fused.py), and the LM head is rescored exactly on
its best candidates (`RescoredHead`). docs/kernels.md says where the accuracy and the time of
the first 4-bit path went and what each choice measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from graphguard.kernels import cpu_fused as fused
from graphguard.kernels.reference import HeadShape, QKNorm, TorchKernels

GROUP = 32  # weights per Q4_1 block
LEVELS = 15  # q in 0..LEVELS
# A block is 4-bit when every float32 weight is within this share of a level step of its
# level (float16 scales times small integers are exact in float32; weights that were never
# 4-bit miss by up to half a step).
TOLERANCE = 1e-3


@dataclass(frozen=True)
class Q4Weight:
    """One weight ``[N, K]`` packed for the int4 CPU matmul."""

    packed: Tensor  # uint8 [N, K / 2], the int4 CPU layout
    scale_zero: Tensor  # bfloat16 [K / GROUP, N, 2]
    shape: tuple[int, int]


def pack_q4(weight: Tensor) -> Q4Weight | None:
    """`weight` as 4-bit blocks, or None when its blocks are not 16 levels each (see module)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP or weight.device.type != "cpu":
        return None
    low, step, q = _levels(weight)
    error = (q * step + low - weight.detach().float().reshape(q.shape)).abs()
    if bool((error > TOLERANCE * torch.where(step > 0, step, 1.0)).any()):
        return None
    return _pack(low, step, q)


def _levels(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per block of 32: its minimum, its level step and each weight's nearest level (float32,
    ``[N, K / 32, 1]``, ``[N, K / 32, 1]``, ``[N, K / 32, 32]``)."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low = blocks.amin(dim=-1, keepdim=True)
    step = (blocks.amax(dim=-1, keepdim=True) - low) / LEVELS
    q = torch.round((blocks - low) / torch.where(step > 0, step, 1.0)).clamp(0, LEVELS)
    return low, step, q


def _pack(low: Tensor, step: Tensor, q: Tensor) -> Q4Weight:
    n, k = q.shape[0], q.shape[1] * GROUP
    levels = q.to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    scale, zero = step.squeeze(-1), (low + 8 * step).squeeze(-1)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return Q4Weight(packed, scale_zero.to(torch.bfloat16), (n, k))


def q4_matmul(x: Tensor, weight: Q4Weight) -> Tensor:
    """``x [M, K] @ W.T`` for a packed weight W ``[N, K]``, in bfloat16 (x is cast to it)."""
    if x.dim() != 2:
        return q4_matmul(x.reshape(-1, weight.shape[1]), weight).view(*x.shape[:-1], -1)
    return _mm(_bf16(x), weight)


class Q4Kernels(TorchKernels):
    """4-bit GEMMs for the model's weights that are 4-bit blocks, an 8-bit LM head rescored
    exactly on its best candidates, and a decode layer's other ops fused (kernels/cpu_fused.py).

    Activations, the residual stream, attention and the KV cache stay float32; what a GEMM
    reads and writes is bfloat16 (the int4 matmul's dtype), so the norms and SiLU-and-multiply
    write bfloat16 and the ops after a GEMM take its bfloat16 output."""

    name = "torch-q4"
    load_dtype = torch.float32  # the 4-bit levels are read back from float32 weights
    run_dtype = torch.float32
    no_reload = "the 4-bit weights are packed from float32 ones at start; restart with the new ones"

    def __init__(self) -> None:
        self._packed: dict[int, tuple[Tensor, Q4Weight]] = {}  # the GEMMs' weights by id
        self._head: RescoredHead | None = None
        self._arrays = fused.Arrays()  # numpy views of the norm weights
        self._step: tuple[tuple[Tensor, ...], tuple[np.ndarray, ...]] | None = None
        self._plan: DecodePlan | None = None

    def prepare(self, model: nn.Module) -> None:
        """Pack the float32 model's 4-bit weights and its 8-bit head. ValueError when the model
        is not float32 or no weight is 4-bit (the packs would be lossy or there is nothing to
        gain)."""
        weights = _gemm_weights(model)
        if any(weight.dtype != torch.float32 for weight in weights):
            raise ValueError("--kernels q4 packs a float32 model's weights (see kernels/q4.py)")
        packs = [pack_q4(weight) for weight in weights]
        if not any(packs):
            raise ValueError(
                "--kernels q4 found no weight in 4-bit blocks of 32 (a Q4_1 checkpoint such as "
                "the embedded model's); use --kernels torch"
            )
        # NOTE: keyed by id(): each value holds its weight, so no other tensor takes the id
        self._packed = {
            id(weight): (weight, packed)
            for weight, packed in zip(weights, packs, strict=True)
            if packed is not None
        }
        head = _head_weight(model)
        self._head = None if head is None else RescoredHead.pack(head)
        layers = getattr(model, "layers", None)
        self._plan = self._decode_plan(layers) if isinstance(layers, nn.ModuleList) else None
        _drop_dense(model, [weight for weight, _ in self._packed.values()])

    @property
    def num_packed(self) -> int:
        return len(self._packed)

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """bfloat16 ``x @ weight.T``: 4-bit where the weight is packed."""
        packed = self._packed.get(id(weight))
        if packed is None:
            return F.linear(x.to(weight.dtype), weight).to(torch.bfloat16)
        return q4_matmul(x, packed[1])

    def head(self, x: Tensor, weight: Tensor) -> Tensor:
        if self._head is None or weight is not self._head.weight:
            return F.linear(x.to(weight.dtype), weight)
        return self._head(x)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dim() != 2:
            return self.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        return fused.rms_norm(x.float(), self._arrays(weight), eps)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        if residual.dim() != 2:
            rows = (-1, residual.shape[-1])
            normed, h = self.add_rms_norm(x.reshape(rows), residual.reshape(rows), weight, eps)
            return normed.view(residual.shape), h.view(residual.shape)
        return fused.add_rms_norm(_bf16(x), residual, self._arrays(weight), eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return fused.silu_mul(_bf16(gate_up))

    def rope_qkv(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, heads: HeadShape, qk_norm: QKNorm | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """A prefill's q, k and v: the reference's, in float32."""
        return super().rope_qkv(qkv.float(), cos, sin, heads, qk_norm)

    def attend_decode(
        self,
        qkv: Tensor,
        rope: tuple[Tensor, Tensor],
        heads: HeadShape,
        qk_norm: QKNorm | None,
        kv_cache: tuple[Tensor, Tensor],
        slot_mapping: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        scale: float,
    ) -> Tensor:
        step = (*rope, slot_mapping, block_tables, seq_lens)
        return fused.rope_write_attend(
            _bf16(qkv), heads, self._qk_arrays(qk_norm), kv_cache, self._step_arrays(step), scale
        )

    def _qk_arrays(self, norm: QKNorm | None) -> tuple[np.ndarray, np.ndarray, float] | None:
        """A q/k norm as the fused attention takes it."""
        if norm is None:
            return None
        return self._arrays(norm.q_weight), self._arrays(norm.k_weight), norm.eps

    def decode_layers(
        self,
        layers: nn.ModuleList,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        meta: Any,
        kv: Any,
    ) -> tuple[Tensor, Tensor] | None:
        """The decode step's layers from the plan made at `prepare` (see `DecodePlan`)."""
        plan = self._plan
        if plan is None or layers is not plan.layers:
            return None
        step = self._step_arrays((*rope, meta.slot_mapping, meta.block_tables, meta.seq_lens))
        residual = h
        x = self.rms_norm(h, plan.first_norm, plan.eps)
        for layer, k_cache, v_cache in zip(plan.steps, kv.k_cache, kv.v_cache, strict=True):
            qkv = _mm(x, layer.qkv)
            attn = fused.rope_write_attend(
                qkv, layer.heads, layer.qk_norm, (k_cache, v_cache), step, layer.scale
            )
            x, residual = fused.add_rms_norm(_mm(attn, layer.o), residual, *layer.post_norm)
            h = _mm(fused.silu_mul(_mm(x, layer.gate_up)), layer.down)
            if layer.next_norm is not None:
                x, residual = fused.add_rms_norm(h, residual, *layer.next_norm)
        return h, residual

    def _decode_plan(self, layers: Any) -> DecodePlan | None:
        """What each layer's decode reads, gathered once; None unless every GEMM is packed."""
        packed = {key: weight for key, (_, weight) in self._packed.items()}
        steps: list[LayerPlan] = []
        for index, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            weights = [attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight]
            weights.append(mlp.down_proj.weight)
            if any(id(weight) not in packed for weight in weights):
                return None
            norm = attn.qk_norm()
            after = layers[index + 1].input_layernorm if index + 1 < len(layers) else None
            post = layer.post_attention_layernorm
            qkv, o, gate_up, down = (packed[id(weight)] for weight in weights)
            qk_norm = self._qk_arrays(norm)
            next_norm = None if after is None else (self._arrays(after.weight), after.eps)
            post_norm = (self._arrays(post.weight), post.eps)
            steps.append(
                LayerPlan(
                    qkv, o, gate_up, down, attn.heads, attn.scale, qk_norm, post_norm, next_norm
                )
            )
        if not steps:
            return None
        first = layers[0].input_layernorm
        return DecodePlan(layers, first.weight, first.eps, steps)

    def _step_arrays(self, step: tuple[Tensor, ...]) -> tuple[np.ndarray, ...]:
        """A decode step's cos, sin, slots, block tables and lengths as arrays, made once
        for all its layers (each layer is handed the same tensors; kept until the next
        step's)."""
        held = self._step
        if held is None or any(a is not b for a, b in zip(held[0], step, strict=True)):
            arrays = tuple(t.float().numpy() if t.is_floating_point() else t.numpy() for t in step)
            self._step = held = (step, arrays)
        return held[1]


@dataclass(frozen=True)
class LayerPlan:
    """One layer's decode: its packed GEMMs, attention shape, and the norms after it."""

    qkv: Q4Weight
    o: Q4Weight
    gate_up: Q4Weight
    down: Q4Weight
    heads: HeadShape
    scale: float
    qk_norm: tuple[np.ndarray, np.ndarray, float] | None
    post_norm: tuple[np.ndarray, float]  # post-attention norm: weight, eps
    next_norm: tuple[np.ndarray, float] | None  # the next layer's input norm (None: the last)


@dataclass(frozen=True)
class DecodePlan:
    """A decode step's layers as the 4-bit set runs them: the same ops as the model's layers
    (graphguard/engine/models/layers.py) in the same order, called from one loop.

    NOTE: on a CPU a 4-bit decode step is bound by Python calls, not math: run through the
    layers' modules and the set's methods it made about 25 more calls a layer (1 ms of a 10
    ms token). The plan is a second spelling of the layer, so a test holds its logits
    bitwise equal to the layer-by-layer path's (tests/unit/kernels/test_q4.py)."""

    layers: nn.ModuleList  # the model's layers it was made from (identity checked)
    first_norm: Tensor
    eps: float
    steps: list[LayerPlan]


def _mm(x: Tensor, weight: Q4Weight) -> Tensor:
    """bfloat16 rows ``[M, K]`` times a packed weight."""
    # NOTE: torch's binding, not torch.ops.aten's packet: 1 us less a call, 120 calls a token
    return torch._weight_int4pack_mm_for_cpu(x, weight.packed, GROUP, weight.scale_zero)


@dataclass(frozen=True)
class RescoredHead:
    """The LM head in two passes: 8-bit logits for the whole vocabulary choose `EXACT_TOKENS`
    candidates per row, whose logits are then computed again from the float32 rows.

    The head is the largest GEMM of a small model's token (the embedded model's is its tied
    Q8_0 embedding, 49,152 x 576, 1.8 ms of a 10 ms token at 8 bits). PyTorch's int8 CPU
    matmul takes one scale per row where Q8_0 has one per block of 32, so its logits move
    near-ties: over the corpus that alone took the KL from float32 from 0.0015 to 0.0037
    (graphguard/engine/fidelity.py). Rescored, the tokens that greedy choice, sampling and log
    probabilities look at are exact (a 2.3 KiB read per candidate), and the rest of the
    vocabulary only shares the softmax's normalizer at 8 bits. (A 4-bit first pass took 0.8
    ms instead of 1.8, but its tail moved the normalizer: KL 0.0058 with 64 candidates, 0.0013
    with 1,024.)
    """

    weight: Tensor  # the model's head weight, float32 [vocab, hidden] (identity is the key)
    rows: Tensor  # int8 [vocab, hidden]
    scales: Tensor  # bfloat16 [vocab]

    EXACT_TOKENS = 64

    @classmethod
    def pack(cls, weight: Tensor) -> RescoredHead:
        w = weight.detach()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        rows = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(weight, rows, scales.to(torch.bfloat16))

    def __call__(self, x: Tensor) -> Tensor:
        """``x [M, hidden]`` -> float32 logits ``[M, vocab]``."""
        rows = x.reshape(-1, x.shape[-1])
        logits = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.rows, self.scales)
        logits = logits.float()
        best = logits.topk(min(self.EXACT_TOKENS, logits.shape[-1]), dim=-1).indices
        # NOTE: vecdot, not bmm: a row's dot products then do not depend on the batch around
        # it (the 8-bit and 4-bit GEMMs' do not either), so a seeded request samples alike
        # alone or batched.
        exact = torch.linalg.vecdot(self.weight[best], rows.float()[:, None, :])  # [M, k]
        return logits.scatter_(-1, best, exact).reshape(*x.shape[:-1], -1)


def _bf16(x: Tensor) -> Tensor:
    """x in bfloat16 (most already are: the GEMMs' outputs and the norms')."""
    return x if x.dtype is torch.bfloat16 else x.to(torch.bfloat16)


def _drop_dense(model: nn.Module, packed: list[Tensor]) -> None:
    """Free the float32 copies of the packed weights (and the linears' rows that are views of
    them): nothing reads them once packed (weights do not reload under this set), and they
    are most of a small model's memory. Each keeps its identity, the packs' key, with no
    elements."""
    storages = {weight.untyped_storage().data_ptr() for weight in packed}
    views = [
        param for param in model.parameters() if param.untyped_storage().data_ptr() in storages
    ]
    for tensor in (*packed, *views):
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _head_weight(model: nn.Module) -> Tensor | None:
    """The LM head's weight (the embedding's when tied), as compute_logits reads it."""
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, nn.Linear):
        return lm_head.weight
    embed = getattr(model, "embed_tokens", None)
    return embed.weight if isinstance(embed, nn.Embedding) else None


def _gemm_weights(model: nn.Module) -> list[Tensor]:
    """The weights the decoder's GEMMs read through its kernel set: the fused q/k/v and
    gate/up weights, and every other linear's (not the rows of a fused one, which are views of
    it)."""
    fused = [
        weight
        for module in model.modules()
        for name in ("qkv_weight", "gate_up_weight")
        if isinstance(weight := getattr(module, name, None), Tensor)
    ]
    storages = {weight.untyped_storage().data_ptr() for weight in fused}
    linears = [
        module.weight
        for module in model.modules()
        if isinstance(module, nn.Linear)
        and module.weight.untyped_storage().data_ptr() not in storages
    ]
    return fused + linears
