"""Segmented decode steps of a transformers decoder: graphed segments, each attention eager.

Where the whole decode step cannot be one graph (an attention that keeps Python-side state,
writes host tensors, or more than `max_state_bytes`), its dense parts still can. The step is cut
along the model's public structure (`model.model.embed_tokens`, `.rotary_emb`, `.layers[i]`'s
`input_layernorm` / `self_attn` / `post_attention_layernorm` / `mlp`, `.norm`, `lm_head`) into
a SegmentedRunner's pipeline (docs/segmented.md):

    embed + mask (eager)  [rope + norm0]  attn0  [mlp0 + norm1]  attn1 ... [mlpL-1 + norm + head]

A model of L layers has L + 1 segment graphs per key and L eager attention holes. The ops are
those of the model's own decoder layers, in the same order, and each hole calls `self_attn`
with exactly the arguments transformers' decoder layer passes it for a StaticCache decode step
(the causal mask `create_causal_mask` builds, position ids, the cache, `use_cache`, the rotary
cos/sin), so the step's logits are the model's own.

The attention holes are the only part that writes state: each writes its layer of the cache.
A capture runs the pipeline twice (its graphs, then the eager reference it is checked by), so a
hole must be idempotent: it sets its cache layer's counter to the step's position before the
attention writes there, and a second run writes the same slots with the same values and leaves
the counter where one run leaves it.

A key is the shapes of the step's carry and the active PEFT adapters (they choose the segments'
Python path, as they choose the whole step's).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from graphguard.core.admission import AdmissionConfig
from graphguard.core.backends import Backend
from graphguard.core.graph_runner import GraphRunner
from graphguard.core.metrics import GraphMetrics
from graphguard.core.options import CaptureConfig
from graphguard.core.reasons import FallbackReason
from graphguard.core.verify import VerifyConfig
from graphguard.segmented import Carry, SegmentedRunner, Stage


class DecodeMode(enum.StrEnum):
    """How GraphedCausalLM graphs its decode steps."""

    WHOLE = "whole"  # the whole step, one graph per key
    SEGMENTED = "segmented"  # graphed segments, every layer's attention eager
    AUTO = "auto"  # whole-step graphs; segments for a key whose whole step is refused for good


# The refusals of a whole step that segments avoid: what the step writes, the attention's cache
# and its bookkeeping, runs eagerly in the holes (the segments write nothing).
SEGMENTS_AVOID = frozenset(
    {FallbackReason.PYTHON_STATE, FallbackReason.UNOWNABLE_STATE, FallbackReason.STATE_TOO_LARGE}
)


@dataclass(frozen=True)
class StepContext:
    """What the attention holes read besides the carry; only `adapters` is keyed."""

    mask: Any  # the causal mask transformers builds for the step (a tensor, or None)
    position_ids: Tensor  # [1, 1] on the device
    position: Tensor  # [] on the device: the slot every layer's cache writes this step
    adapters: Hashable
    cache: Any  # the StaticCache of the call's rows (one per batch size: GraphedCausalLM)


def _adapters(context: StepContext) -> Hashable:
    """The segments' key beyond the carry: the active adapters (a LoRA layer in a segment adds
    its update or not by them, so a stale group must never answer another set)."""
    return context.adapters


def base_model(model: Any) -> Any:
    """The transformers causal LM itself: a PEFT model's base model (its LoRA layers in it)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def check_segmentable(base: Any, cache: Any) -> None:
    """ValueError unless `base` is a decoder of the structure cut here over a StaticCache of
    full-attention layers."""
    from transformers.cache_utils import StaticLayer

    decoder = getattr(base, "model", None)
    parts = ("embed_tokens", "rotary_emb", "layers", "norm")
    is_cut = decoder is not None and all(hasattr(decoder, p) for p in parts)
    if not (is_cut and hasattr(base, "lm_head")):
        raise ValueError(
            f"{type(base).__name__} is not a decoder of model.{{{', '.join(parts)}}} and lm_head"
        )
    for layer in cache.layers:
        if not isinstance(layer, StaticLayer) or layer.is_sliding:
            raise ValueError("segmented decode steps need a StaticCache of full-attention layers")


def step_inputs(
    base: Any, ids: Tensor, position: Tensor, adapters: Hashable, cache: Any, mask: Any = None
) -> tuple[Carry, StepContext]:
    """A segmented step's input carry and context: the embedding, and the mask as the model
    builds it where none is given."""
    from transformers.masking_utils import create_causal_mask

    decoder = base.model
    hidden = decoder.embed_tokens(ids)
    position_ids = position.view(1, 1)
    if mask is None:
        mask = create_causal_mask(
            config=decoder.config, inputs_embeds=hidden, attention_mask=None,
            past_key_values=cache, position_ids=position_ids,
        )  # fmt: skip
    context = StepContext(mask, position_ids, position.view(()), adapters, cache)
    return (hidden, position_ids), context


@torch.no_grad()
def check_same_step(base: Any, stages: list[Stage]) -> None:
    """ValueError unless a decode step cut into `stages` and run eagerly gives the model's own
    logits: the cut follows a Llama-style decoder layer (norm, attention, residual, norm, MLP,
    residual), which other families change (post-norms, multipliers, soft-capping). Probed on
    two small caches prefilled alike, one for the model's own step, one for the stages'."""
    from transformers import StaticCache

    device = base.lm_head.weight.device
    ids = torch.arange(5, device=device).remainder(base.config.vocab_size)[None]
    caches = [StaticCache(config=base.config, max_cache_len=8) for _ in range(2)]
    layer = type(base.model.layers[0]).__name__
    try:
        for cache in caches:
            base(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
        token, position = ids[:, 4:], torch.tensor([4], device=device)
        expected = base(input_ids=token, past_key_values=caches[0], use_cache=True).logits[:, -1]
        carry, context = step_inputs(base, token, position, None, caches[1])
        for stage in stages:
            carry = stage.fn(context, *carry) if stage.eager else stage.fn(*carry)
    except Exception as exc:  # noqa: BLE001 - a layer the cut does not fit is refused
        raise ValueError(
            f"{layer} cannot be cut into segments: {type(exc).__name__}: {exc}"
        ) from exc
    if not torch.allclose(carry[0].float(), expected.float(), rtol=1e-3, atol=1e-3):
        error = float((carry[0].float() - expected.float()).abs().max())
        raise ValueError(
            f"{layer} is not cut like a Llama decoder layer: the segmented step's logits "
            f"differ from the model's (max |diff| {error:.3g})"
        )


def decoder_stages(base: Any) -> list[Stage]:
    """The decode step after its embedding, as a pipeline (see module docstring).

    NOTE: each stage looks its modules up on the model when it runs, so a module swapped in
    afterwards (fused kernels, graphguard/hf_kernels.py) is the one a capture records."""
    decoder = base.model
    stages = [Stage("rope", partial(_rope, decoder))]
    for index, layer in enumerate(decoder.layers[: decoder.config.num_hidden_layers]):
        stages += [
            Stage(f"norm{index}", partial(_norm, layer)),
            Stage(f"attn{index}", partial(_attend, layer, index), eager=True),
            Stage(f"mlp{index}", partial(_mlp, layer)),
        ]
    stages.append(Stage("head", partial(_head, base)))
    return stages


def _rope(decoder: Any, hidden: Tensor, position_ids: Tensor) -> Carry:
    cos, sin = decoder.rotary_emb(hidden, position_ids)
    return hidden, cos, sin


def _norm(layer: Any, residual: Tensor, cos: Tensor, sin: Tensor) -> Carry:
    return residual, layer.input_layernorm(residual), cos, sin


def _attend(
    layer: Any,
    index: int,
    context: StepContext,
    residual: Tensor,
    normed: Tensor,
    cos: Tensor,
    sin: Tensor,
) -> Carry:
    """One layer's attention, called as its decoder layer calls it; idempotent: its cache
    layer's counter is set to the step's position first (module docstring)."""
    cache = context.cache
    cache.layers[index].cumulative_length.copy_(context.position)
    attended, _ = layer.self_attn(
        hidden_states=normed,
        attention_mask=context.mask,
        position_ids=context.position_ids,
        past_key_values=cache,
        use_cache=True,
        position_embeddings=(cos, sin),
    )
    return residual, attended, cos, sin


def _mlp(layer: Any, residual: Tensor, attended: Tensor, cos: Tensor, sin: Tensor) -> Carry:
    hidden = residual + attended
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), cos, sin


def _head(base: Any, hidden: Tensor, *_: Tensor) -> Carry:
    return (base.lm_head(base.model.norm(hidden))[:, -1, :],)


class DecoderSegments:
    """A GraphedCausalLM's decode step as segments (`mode` SEGMENTED), or the whole step's
    graphs with segments for the keys whose whole step is refused for good (`mode` AUTO).

    Args:
        model: the transformers causal LM (a PEFT model too), as GraphedCausalLM takes it.
        cache_of: the StaticCache of the current call's rows, prefilled before its first step
            (called at each step: GraphedCausalLM keeps one cache per batch size).
        mode: SEGMENTED or AUTO.
        whole: the whole step's GraphRunner, called as `whole(ids, position, adapters)` (AUTO).
        max_bytes, verify, admission, capture, backend, metrics: the SegmentedRunner's; its
            graphs keep the model and `capture.retain` (GraphedCausalLM's caches) alive.
    """

    def __init__(
        self,
        model: Any,
        cache_of: Callable[[], Any],
        mode: DecodeMode,
        whole: GraphRunner,
        *,
        max_bytes: int,
        verify: str | VerifyConfig,
        admission: AdmissionConfig | None,
        capture: CaptureConfig,
        backend: str | Backend,
        metrics: GraphMetrics | None,
    ):
        if mode is DecodeMode.WHOLE:
            raise ValueError("DecoderSegments runs the segmented and auto modes")
        self.base = base_model(model)
        check_segmentable(self.base, cache_of())
        stages = decoder_stages(self.base)
        check_same_step(self.base, stages)
        self.cache_of = cache_of
        self.mode = mode
        self.whole = whole
        self.runner = SegmentedRunner(
            stages,
            max_bytes=max_bytes,
            verify=verify,
            admission=admission,
            # NOTE: every group keeps the weights alive (and the caches, in capture.retain)
            capture=replace(capture, retain=(*capture.retain, model)),
            backend=backend,
            metrics=metrics,
            name="hf_segments",
            context_key=_adapters,
        )

    def __call__(
        self,
        ids: Tensor,
        positions: Tensor,
        adapters: Hashable,
        mask_names: tuple[str, ...] | None,
        *masks: Tensor | None,
    ) -> Tensor:
        """Logits [B, vocab] of one token per row at `positions` [B, 1] (one position for
        every row), under the step's attention mask: GraphedCausalLM's decode step."""
        if self.mode is DecodeMode.AUTO and not self.is_refused(
            ids, positions, adapters, mask_names, *masks
        ):
            return self.whole(ids, positions, adapters, mask_names, *masks)
        # NOTE: the segments cut full-attention layers only (check_segmentable): their mask
        mask = masks[0] if mask_names is None else masks[mask_names.index("full_attention")]
        return self.step(ids, positions[:1, 0], adapters, mask)

    def is_refused(self, *args: Any) -> bool:
        """Whether the whole step's key of this call was refused for a reason segments avoid."""
        plan = self.whole.plan(args)
        if isinstance(plan, FallbackReason):
            return False
        return self.whole.policy.refusals.get(plan.key) in SEGMENTS_AVOID

    def step(self, ids: Tensor, position: Tensor, adapters: Hashable, mask: Any = None) -> Tensor:
        """The segmented step at `position` (a [1] tensor): the embedding (and the mask, where
        none is given, as the model builds it) eagerly, then the pipeline."""
        inputs, context = step_inputs(self.base, ids, position, adapters, self.cache_of(), mask)
        (logits,) = self.runner(inputs, context)
        return logits

    def close(self) -> None:
        self.runner.close()
