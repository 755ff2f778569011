"""Hugging Face transformers causal LMs with their decode steps through graphguard's graphs.

`GraphedCausalLM(model)` holds a `transformers.StaticCache` and a GraphRunner of the model's
decode step (one token per row over the static cache), and generates as `model.generate` does
(greedy, or sampled with temperature, top-k and top-p): the prompt is prefilled eagerly, then
every decode step replays a graph, or runs eagerly with one named reason. The step writes its
cache in place and advances the cache's counter on the device: the runner finds that state on
its own and puts it back around a capture (graphguard/core/state.py), so no capture changes a
token of the output.

A PEFT adapter loaded unmerged is part of the model: its weights are read by the graphs like any
other. Which adapters are active (and whether adapters are disabled) changes the Python path the
step takes, so it is part of each graph's key: switching adapters replays another graph, never a
stale one.

    from graphguard.hf import GraphedCausalLM
    graphed = GraphedCausalLM(model, max_cache_len=2048)
    tokens = graphed.generate(input_ids, max_new_tokens=128)
    graphed.runner.stats()   # replays, fallbacks by reason, bytes, ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from graphguard.core.admission import AdmissionConfig
from graphguard.core.backends import Backend
from graphguard.core.graph_runner import GraphRunner
from graphguard.core.keys import Buckets
from graphguard.core.metrics import GraphMetrics
from graphguard.core.options import CaptureConfig
from graphguard.core.verify import VerifyConfig
from graphguard.hf_kernels import Fusion, fuse_kernels
from graphguard.hf_segments import DecodeMode, DecoderSegments

log = logging.getLogger("graphguard")


class GraphedCausalLM:
    """A transformers causal LM whose decode steps replay bounded, verified graphs.

    Args:
        model: a `transformers` causal LM (Llama, Qwen3, ...; a PEFT model too), in eval mode.
        max_cache_len: the static cache's length: prompt plus generated tokens.
        max_bytes, verify, admission, capture, backend, metrics: the GraphRunner's
            (docs/runtime.md). Admission defaults to capturing a step's shape once seen twice.
        kernels: "model" (transformers' own) or "fused": graphguard's Triton kernels swapped
            into the model's RMSNorms and SwiGLU MLPs (graphguard/hf_kernels.py; CUDA), about
            half the launches a step replays; `close()` puts the model's own back.
        mode: "whole" (one graph per step), "segmented" (graphed norms, MLPs and head, each
            layer's attention eager between them: graphguard/hf_segments.py) or "auto" (whole
            steps, and segments for a key whose whole step is refused for a reason segments
            avoid); segments are in `self.segments` (None for "whole").
        batch_buckets: batch sizes a prompt's rows are padded up to (repeats of its last row,
            dropped from the output), so fewer graphs serve more batch sizes; none by default.
            Each batch size gets a cache of its own (`self.caches`). Padded greedy rows are the
            model's; sampled rows with a `generator` draw as a batch of the bucket's size.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_cache_len: int,
        max_bytes: int = 4 << 30,
        verify: str | VerifyConfig = "exact",
        admission: AdmissionConfig | None = None,
        capture: CaptureConfig | None = None,
        backend: str | Backend = "auto",
        metrics: GraphMetrics | None = None,
        kernels: str = "model",
        mode: str = "whole",
        batch_buckets: Sequence[int] = (),
    ):
        self.model = model
        self.fusion = _fusion(model, kernels)
        self._forward_options = _forward_options(model)
        self.max_cache_len = max_cache_len
        self.batch_buckets = Buckets(batch=batch_buckets) if batch_buckets else None
        # One StaticCache per batch size (a cache's rows are fixed at its first write); the
        # current call's is `self.cache`, the first batch size's the one made here.
        self.cache = self._new_cache()
        self.caches: dict[int, Any] = {}
        capture = capture or CaptureConfig()
        # NOTE: every graph keeps the weights and the caches it reads alive
        capture = replace(capture, retain=(*capture.retain, model, self.caches))
        self.runner = GraphRunner(
            self._decode,
            max_bytes=max_bytes,
            verify=verify,
            admission=admission,
            capture=capture,
            backend=backend,
            metrics=metrics,
            name="hf_decode",
        )
        self.segments: DecoderSegments | None = None
        self.segments_refused: str | None = None  # why "auto" runs without segments
        if DecodeMode(mode) is not DecodeMode.WHOLE:
            try:
                self.segments = DecoderSegments(
                    model, lambda: self.cache, DecodeMode(mode), self.runner,
                    max_bytes=max_bytes, verify=verify, admission=admission, capture=capture,
                    backend=backend, metrics=metrics,
                )  # fmt: skip
            except ValueError as exc:
                if DecodeMode(mode) is DecodeMode.SEGMENTED:
                    raise
                # NOTE: "auto" still graphs whole steps; a key refused for good runs eagerly
                self.segments_refused = str(exc)
                log.warning("graphguard: decode steps without segments: %s", exc)

    def _decode(
        self,
        ids: Tensor,
        positions: Tensor,
        adapters: Hashable,
        mask_names: tuple[str, ...] | None,
        *masks: Tensor | None,
    ) -> Tensor:
        """Logits [B, vocab] of one token per row, as `generate`'s decode step computes them:
        at `positions` [B, 1], under the attention masks `generate` builds for the step (one,
        or one per layer type named by `mask_names`), over the cache. `adapters` keys the graph
        by the active adapters (the step's Python path)."""
        del adapters
        mask = masks[0] if mask_names is None else dict(zip(mask_names, masks, strict=True))
        out = self.model(
            input_ids=ids, position_ids=positions, attention_mask=mask,
            past_key_values=self.cache, use_cache=True, return_dict=True, **self._forward_options,
        )  # fmt: skip
        return out.logits[:, -1, :]

    def adapters(self) -> Hashable:
        """What selects the step's Python path besides its tensors: the active PEFT adapters
        and whether they are disabled (None for a model without adapters)."""
        model = self.model
        if getattr(model, "peft_config", None) is None and not getattr(
            model, "_hf_peft_config_loaded", False
        ):
            return None
        from peft.tuners.tuners_utils import BaseTunerLayer

        active = model.active_adapters
        names = tuple(active() if callable(active) else active)
        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        return names, any(layer.disable_adapters for layer in layers)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """The prompt `input_ids` [B, T] followed by `max_new_tokens` new tokens of each row,
        chosen as `model.generate` chooses them (greedy unless `do_sample`). Each step's inputs
        (positions, attention masks) are the ones `generate` gives the model, built by the
        model's own `prepare_inputs_for_generation` outside the graphs."""
        length = input_ids.shape[1]
        if length + max_new_tokens > self.max_cache_len:
            raise ValueError(
                f"{length} prompt tokens + {max_new_tokens} new exceed max_cache_len "
                f"{self.max_cache_len}"
            )
        decode: Callable[..., Tensor] = self.runner if self.segments is None else self.segments
        pick = partial(_sample, do_sample=do_sample, temperature=temperature, top_k=top_k,
                       top_p=top_p, generator=generator)  # fmt: skip
        return self.decode_loop(decode, input_ids, max_new_tokens, pick)

    @torch.no_grad()
    def decode_loop(
        self,
        decode: Callable[..., Tensor],
        input_ids: Tensor,
        max_new_tokens: int,
        pick: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """generate's loop with another decode step (a benchmark's compiled `_decode`): the
        prompt eagerly, then `decode(ids, positions, adapters, mask_names, *masks)` per token,
        each token chosen from the logits by `pick`."""
        batch = input_ids.shape[0]
        ids = self._padded(input_ids)
        self.cache = self._cache_of(ids.shape[0])
        self.cache.reset()
        context = _Context(ids, self.cache, self._forward_options)
        prompt = context.inputs(self.model, first=True)
        logits = self.model(**prompt, return_dict=True).logits[:, -1, :]
        adapters = self.adapters()
        for step in range(max_new_tokens):
            context.append(pick(logits)[:, None])
            if step + 1 == max_new_tokens:
                break
            inputs = context.inputs(self.model, first=False)
            names, masks = _masks(inputs["attention_mask"])
            logits = decode(inputs["input_ids"], inputs["position_ids"], adapters, names, *masks)
        return context.ids[:batch]

    def _padded(self, input_ids: Tensor) -> Tensor:
        """The prompt rows padded up to the smallest batch bucket that holds them (repeats of
        the last row, dropped from the output), or as they are past the largest bucket."""
        batch = input_ids.shape[0]
        rows = (self.batch_buckets and self.batch_buckets.bucket_for(batch)) or batch
        if rows == batch:
            return input_ids
        return torch.cat([input_ids, input_ids[-1:].expand(rows - batch, -1)])

    def _cache_of(self, rows: int) -> Any:
        """The StaticCache of `rows` rows: the first batch size takes the cache made at
        construction, each new one a new cache (its graphs read that cache's tensors)."""
        if rows not in self.caches:
            self.caches[rows] = self._new_cache() if self.caches else self.cache
        return self.caches[rows]

    def _new_cache(self) -> Any:
        from graphguard.hf_cache import HoledStaticCache

        return HoledStaticCache(config=self.model.config, max_cache_len=self.max_cache_len)

    def close(self) -> None:
        self.runner.close()
        if self.segments is not None:
            self.segments.close()
        if self.fusion is not None:
            self.fusion.restore()


class _Context:
    """A generation's tokens, 2-D attention mask and positions so far, kept as `generate`
    keeps them, and the model inputs of its next step."""

    def __init__(self, ids: Tensor, cache: Any, options: dict[str, Any]) -> None:
        self.ids = ids
        self.mask = torch.ones_like(ids)
        positions = self.mask.cumsum(-1) - 1
        self.positions = positions.masked_fill(self.mask == 0, 0)
        self.cache = cache
        self.options = options

    def append(self, tokens: Tensor) -> None:
        """One new token per row."""
        self.ids = torch.cat([self.ids, tokens], dim=-1)
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=-1)
        self.positions = torch.cat([self.positions, self.positions[:, -1:] + 1], dim=-1)

    def inputs(self, model: Any, first: bool) -> dict[str, Any]:
        """The model's inputs for the prompt (`first`) or the last token, from the model's
        own prepare_inputs_for_generation."""
        return model.prepare_inputs_for_generation(
            self.ids, next_sequence_length=None if first else 1, past_key_values=self.cache,
            attention_mask=self.mask, position_ids=self.positions, use_cache=True,
            is_first_iteration=first, **self.options,
        )  # fmt: skip


def _masks(mask: Any) -> tuple[tuple[str, ...] | None, tuple[Tensor | None, ...]]:
    """A step's attention mask as graph inputs: (None, (mask,)), or per layer type (its names,
    its masks in their order)."""
    if isinstance(mask, dict):
        return tuple(mask), tuple(mask.values())
    return None, (mask,)


def _forward_options(model: Any) -> dict[str, Any]:
    """What `generate` adds to every forward: logits of the last position only, where the
    model takes `logits_to_keep`."""
    supports = getattr(model, "_supports_logits_to_keep", None)
    return {"logits_to_keep": 1} if callable(supports) and supports() else {}


def _fusion(model: Any, kernels: str) -> Fusion | None:
    if kernels == "model":
        return None
    if kernels != "fused":
        raise ValueError(f"kernels must be 'model' or 'fused', got {kernels!r}")
    return fuse_kernels(model)


def _sample(
    logits: Tensor,
    *,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """The next token of each row: argmax, or a draw from the tempered, top-k and top-p
    filtered distribution (the order transformers' logits processors apply them in)."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)
        drop[:, -1:] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


__all__ = ["GraphedCausalLM"]
