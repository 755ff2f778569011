"""4-bit GEMMs on the CPU for weights that are 4-bit already (a Q4_1 GGUF, the embedded model).

A Q4_1 checkpoint stores each run of 32 weights as 16 levels: ``w = d * q + m`` with ``q`` in
0..15 and one scale ``d`` and minimum ``m`` per block. Dequantized to float, the block still
holds those levels exactly: its minimum is ``m`` and its maximum ``m + 15 d``. `pack_q4` reads
them back from the float weight (no GGUF parsing, and the loader's row order is kept) and packs
them for PyTorch's int4 CPU matmul, whose scale and zero per block give
``(q - 8) * scale + zero``: ``scale = d`` and ``zero = m + 8 d``. A weight whose blocks are not
such levels (it was not 4-bit, or not in blocks of 32) is refused and stays a plain GEMM.

The levels are read from the float32 weights, where they are exact: a bfloat16 copy has lost
them (its rounding moves a block's minimum and maximum, and levels read back from it missed
the checkpoint's by up to four times bfloat16's own error, enough to change the embedded
model's chat answer). So `Q4Kernels.prepare` packs a float32 model and then turns it to
bfloat16, the dtype the int4 matmul takes its activations in. A token then reads about a
quarter of the bytes of bfloat16 weights; the scale and zero are stored in bfloat16 (the
checkpoint's are float16), so the result is close to, not bitwise, the float32 reference's.

The LM head (the embedded model's is its tied embedding, Q8_0: 8 bits with a scale per block
of 32) goes through PyTorch's int8 CPU matmul, which takes one scale per row: rounded to 8 bits
per row it loses a little, and on the documented prompts (bench/cpu_decode.py, and 48 greedy
tokens of three more in a probe) the answers stayed the same while a token took 2 ms less.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from graphguard.kernels.reference import TorchKernels

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
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low = blocks.amin(dim=-1, keepdim=True)
    step = (blocks.amax(dim=-1, keepdim=True) - low) / LEVELS
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((blocks - low) / safe_step)
    error = (q * step + low - blocks).abs()
    if bool((error > TOLERANCE * safe_step).any()):
        return None
    levels = q.clamp(0, LEVELS).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    scale, zero = step.squeeze(-1), (low + 8 * step).squeeze(-1)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return Q4Weight(packed, scale_zero.to(torch.bfloat16), (n, k))


def q4_matmul(x: Tensor, weight: Q4Weight) -> Tensor:
    """``x [M, K] @ W.T`` in bfloat16 for a packed weight W ``[N, K]``."""
    rows = x.reshape(-1, weight.shape[1]).to(torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight.packed, GROUP, weight.scale_zero)
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


class Q4Kernels(TorchKernels):
    """The reference ops in bfloat16, with 4-bit GEMMs for the model's weights that are 4-bit
    blocks; a GEMM with any other weight (the tied embedding of the embedded model, which is
    Q8_0) is the plain one."""

    name = "torch-q4"
    load_dtype = torch.float32  # the 4-bit levels are read back from float32 weights
    run_dtype = torch.bfloat16  # prepare() turns the model to it
    no_reload = "the 4-bit weights are packed from float32 ones at start; restart with the new ones"

    def __init__(self) -> None:
        self._packed: dict[tuple[int, tuple[int, ...]], Q4Weight] = {}
        self._head: tuple[Tensor, Tensor, Tensor] | None = None  # weight, int8 rows, scales

    def prepare(self, model: nn.Module) -> None:
        """Pack the float32 model's 4-bit weights, then turn the model to bfloat16. ValueError
        when none is 4-bit (the packs would be lossy or there is nothing to gain)."""
        weights = _gemm_weights(model)
        if any(weight.dtype != torch.float32 for weight in weights):
            raise ValueError("--kernels q4 packs a float32 model's weights (see kernels/q4.py)")
        packs = [pack_q4(weight) for weight in weights]
        head = _head_weight(model)
        rows = scales = None
        if head is not None:
            scales = head.detach().abs().amax(dim=1).clamp(min=1e-12) / 127
            rows = torch.round(head.detach() / scales[:, None]).clamp(-127, 127).to(torch.int8)
        if not any(packs):
            raise ValueError(
                "--kernels q4 found no weight in 4-bit blocks of 32 (a Q4_1 checkpoint such as "
                "the embedded model's); use --kernels torch"
            )
        model.to(torch.bfloat16)
        # NOTE: the fused q/k/v and gate/up weights are plain attributes, which to() leaves
        # behind (and the linears' rows stop being views of them): fuse again in bfloat16.
        fuse = getattr(model, "fuse_projections", None)
        if fuse is not None:
            fuse()
        self._packed = {
            (weight.data_ptr(), tuple(weight.shape)): packed
            for weight, packed in zip(_gemm_weights(model), packs, strict=True)
            if packed is not None
        }
        new_head = _head_weight(model)
        if new_head is not None and rows is not None and scales is not None:
            self._head = (new_head, rows, scales.to(torch.bfloat16))

    @property
    def num_packed(self) -> int:
        return len(self._packed)

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        packed = self._packed.get((weight.data_ptr(), tuple(weight.shape)))
        if packed is None:
            return F.linear(x, weight)
        return q4_matmul(x, packed)

    def head(self, x: Tensor, weight: Tensor) -> Tensor:
        if self._head is None or weight is not self._head[0]:
            return F.linear(x, weight)
        _, rows, scales = self._head
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), rows, scales)


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
