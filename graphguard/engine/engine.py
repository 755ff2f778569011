"""LLMEngine: requests in, one scheduler iteration per step(), RequestOutputs out.

Lock order: ``lifecycle_lock`` (here) is taken before the graph cache's lock. Every entry point
that touches requests, KV or weights holds it, so a step never overlaps a reload or shutdown.

NOTE: over 300 lines on purpose: every method here holds or assumes that one lock, so they stay
in one class; what a step runs is in the sub-packages (scheduling, step, graphs, tokens).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from graphguard.core.export import model_identity
from graphguard.engine.config import EngineConfig, ModelConfig, model_len, step_token_budget
from graphguard.engine.graphs.component import EngineGraphs, GraphCapability, build_graphs
from graphguard.engine.intake import RequestLimits, check_request
from graphguard.engine.models.forward import EagerForward
from graphguard.engine.models.loader import LoadedModel, load_model, resolve_dtype
from graphguard.engine.models.vision import engine_vision_encoder, request_image_embeds
from graphguard.engine.outputs import RequestOutput, build_output, finish_reason, sample_rows
from graphguard.engine.parallel.ranks import LeaderLink
from graphguard.engine.scheduling.batch import ScheduledBatch
from graphguard.engine.scheduling.kv_sizing import build_kv
from graphguard.engine.scheduling.prefix_cache import PrefixCache
from graphguard.engine.scheduling.scheduler import Scheduler
from graphguard.engine.scheduling.sequence import Sequence
from graphguard.engine.shapes import warmup_prefill_tokens, warmup_shapes
from graphguard.engine.step.model_runner import ModelRunner
from graphguard.engine.step.overlap import (
    HostTokens,
    StepAhead,
    decodes_ahead,
    greedy_tokens,
    resolve_overlap,
)
from graphguard.engine.step.step_trace import StepTrace
from graphguard.engine.tokens.detokenize import IncrementalDetokenizer
from graphguard.engine.tokens.logits import RequestLogits
from graphguard.engine.tokens.sampling import SamplingParams, TokenLogprob, make_generator
from graphguard.engine.tokens.structured import GrammarCompiler
from graphguard.kernels import kernel_set_class, select_kernels

log = logging.getLogger("graphguard")


def _load(config: EngineConfig) -> LoadedModel:
    """The model `config` names, on its device and in its dtype."""
    device = resolve_device(config.device)
    dtype = kernel_set_class(config.kernels).load_dtype or resolve_dtype(config.dtype, device)
    return load_model(config.model, dtype=dtype, device=str(device))


def resolve_device(name: str) -> torch.device:
    """Resolve a device name; "auto" is cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    """Continuous-batching engine over one loaded model and one paged KV pool."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        link: LeaderLink | None = None,
    ) -> None:
        self.config = config
        self.lifecycle_lock = threading.RLock()
        # rank 0 of tensor-parallel ranks (graphguard/engine/parallel): `loaded` is its shard
        self.link = link
        loaded = loaded if loaded is not None else _load(config)
        # A model loaded elsewhere keeps its own placement; KV follows it.
        weight = next(loaded.model.parameters())
        self.device = weight.device
        # the kernels' prepare() may turn the model to another dtype (kernels/q4.py)
        self.dtype = kernel_set_class(config.kernels).run_dtype or weight.dtype
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.model_config: ModelConfig = loaded.config
        self.max_model_len = model_len(config, self.model_config.max_position_embeddings)
        # tokens one step may run (config.max_num_batched_tokens, or by the device's memory)
        memory = (
            torch.cuda.get_device_properties(self.device).total_memory
            if self.device.type == "cuda"
            else None
        )
        self.step_tokens = step_token_budget(config, memory)
        self._build_model_path()
        # decode steps launched before the host reads the last one's tokens (overlap.py)
        self.overlap = resolve_overlap(config.overlap_decode, self.device, link is not None)
        self._ahead: StepAhead | None = None  # the step in flight, when one was launched ahead
        self._seqs: dict[str, Sequence] = {}  # unfinished requests by id
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # same keys as _seqs
        self._pending: list[RequestOutput] = []  # abort outputs for the next step
        self._seed_rng = random.Random(config.seed)
        # response_format grammars; llguidance is loaded by the first request that has one
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self._is_shut_down = False
        self._num_steps = 0
        self._num_generated_tokens = 0
        self._num_steps_ahead = 0  # decode steps launched before the last one's tokens were read
        self._trace = StepTrace.from_env()  # the step timeline, when asked for
        self._capture_work = (0, 0.0)  # units of a capture in flight before the last step, s
        # Image input (random-weight tower; see graphguard/engine/models/vision.py).
        self.vision = engine_vision_encoder(
            self.tokenizer, self.model_config.hidden_size, dtype=self.dtype, device=self.device
        )

    def _build_model_path(self) -> None:
        """Kernels, KV pool, scheduler, eager forward, graphs and model runner, in that order."""
        config = self.config
        # NOTE: chosen before any graph is built: graphs capture the kernels the model runs.
        self.kernels = select_kernels(config.kernels, self.device, self.dtype)
        self.model.use_kernels(self.kernels.kernels)
        self.kernels.kernels.prepare(self.model)
        log.info("graphguard: allocating the KV cache (%s, %s)", self.device, self.dtype)
        self.kv = build_kv(config, self.model_config, self.max_model_len, self.device, self.dtype)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.step_tokens,
            prefix_cache=PrefixCache(self.kv) if config.prefix_caching else None,
        )
        log.info("graphguard prefix caching %s", "on" if config.prefix_caching else "off")
        self.forward = EagerForward(self.model, self.kv)
        # NOTE: kernel compiles at start, not in the first requests. Not under tensor
        # parallelism: the warm-up's collectives would have no partner on the followers.
        if self.device.type == "cuda" and self.link is None:
            log.info("graphguard: compiling the kernels (one warm-up step)")
            self.forward.warm_up()
        built = self._build_graphs()
        # when the capability proof passes; else why decode runs eagerly
        self.graphs: EngineGraphs | None = built if isinstance(built, EngineGraphs) else None
        self._graphs_off = None if self.graphs else str(built)  # see graphs_off_reason
        self.runner = self._build_runner()

    def _build_graphs(self) -> EngineGraphs | GraphCapability:
        """The decode and prefill graphs, or the reason they are off."""
        config = self.config
        return build_graphs(
            config.graphs,
            self.forward,
            scheduler_kv=self.scheduler.kv,
            device=self.device,
            model_identity=model_identity(
                self.loaded.name, self.model_config, dtype=self.dtype, block_size=config.block_size
            ),
            warmup_keys=warmup_shapes(config, self.max_model_len),
            prefill_tokens=warmup_prefill_tokens(self.step_tokens),
            role=self.link.role if self.link is not None else None,
            max_num_seqs=config.max_num_seqs,
        )

    def _build_runner(self) -> ModelRunner:
        return ModelRunner(
            self.forward,
            self.device,
            graphs=self.graphs,
            pad_prefills=self.config.graphs.prefill,
        )

    @property
    def num_usable_blocks(self) -> int:
        return self.kv.num_free_blocks + self.kv.num_used_blocks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: list[torch.Tensor] | None = None,
        *,
        fork_of: str | None = None,
    ) -> None:
        """Queue a request; ValueError with the reason if it can never be served.

        ``images`` are pixel tensors ``[3, S, S]`` (graphguard.engine.models.images.load_image); the
        prompt must hold ``vision.num_tokens_per_image`` placeholder tokens for each.
        ``fork_of`` names a request added before it, with the same prompt and not started
        yet: this one shares its prefill and its images (another choice of an n > 1 request).
        """
        if params.truncate_prompt_tokens is not None:  # the prompt's last tokens only
            prompt_token_ids = list(prompt_token_ids)[-params.truncate_prompt_tokens :]
        with self.lifecycle_lock:
            self._check_open()
            prompt_bytes = self._validate_request(request_id, prompt_token_ids, params)
            parent = self._fork_parent(fork_of, prompt_token_ids, images)
            image_input = self._embed_images(prompt_token_ids, images) if images else None
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            generator = make_generator(seed, self.device)
            seq = Sequence(request_id, prompt_token_ids, params, generator)
            seq.prompt_bytes = prompt_bytes
            if params.response_format is not None:
                seq.grammar = self.grammars.matcher(params.response_format)
            seq.logit_changes = RequestLogits.build(
                params, prompt_token_ids, self.model_config.vocab_size,
                self.tokenizer.eos_token_ids, self.device, self._encode_words,
            )  # fmt: skip
            if image_input is not None:
                seq.image_embeds, seq.image_positions = image_input
            if parent is not None:
                seq.image_embeds, seq.image_positions = parent.image_embeds, parent.image_positions
                self.scheduler.add_fork(parent, seq)
            else:
                self.scheduler.add(seq)
            self._seqs[request_id] = seq
            if self._trace is not None:
                self._trace.added(request_id, len(prompt_token_ids))
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop,
                include_stop=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )  # fmt: skip

    def _encode_words(self, text: str) -> list[int]:
        """A bad word's tokens (graphguard.engine.tokens.logits)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _fork_parent(
        self, fork_of: str | None, prompt_token_ids: list[int], images: list[torch.Tensor] | None
    ) -> Sequence | None:
        if fork_of is None:
            return None
        parent = self._seqs.get(fork_of)
        if parent is None or parent.prompt_token_ids != list(prompt_token_ids) or images:
            raise ValueError(
                f"fork_of {fork_of!r}: a fork needs a queued request with the same prompt "
                "(and brings no images of its own)"
            )
        return parent

    def _validate_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> bytes:
        """check_request's prompt bytes, or ValueError."""
        if request_id in self._seqs or any(o.request_id == request_id for o in self._pending):
            raise ValueError(f"request id {request_id!r} is already in use")
        limits = RequestLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_usable_blocks=self.num_usable_blocks,
        )
        return check_request(prompt_token_ids, params, limits)

    def _embed_images(
        self, prompt_token_ids: list[int], images: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[int]]:
        if self.link is not None:
            raise ValueError("images are not accepted with tensor parallelism (ranks > 1)")
        if self.vision is None:
            raise ValueError("this engine has no vision encoder; images are not accepted")
        return request_image_embeds(self.vision, prompt_token_ids, images)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown ids are ignored."""
        with self.lifecycle_lock:
            seq = self.scheduler.abort(request_id)
            if seq is None:
                return
            self._pending.append(build_output(seq, self._detokenizers[request_id], []))
            self._forget(request_id)

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: decode one token for the running requests, prefill the next
        chunk of the others (graphguard.engine.scheduling.scheduler); only requests that decoded or
        finished their prompt get a token. A graph capture in flight between steps advances
        first, by bounded units, as its pacing allows (graphguard/engine/graphs/pacing.py).
        With GRAPHGUARD_STEP_TRACE set, each step is a line of the trace (step_trace.py)."""
        started = time.perf_counter()
        outputs = self._step()
        if self._trace is not None:
            units, seconds = self._capture_work
            self._trace.step(
                started, waiting=len(self.scheduler.waiting),
                running=len(self.scheduler.running), outputs=len(outputs),
                capture_units=units, capture_ms=seconds * 1e3, steps_ahead=self._num_steps_ahead,
            )  # fmt: skip
        return outputs

    def _step(self) -> list[RequestOutput]:
        with self.lifecycle_lock:
            self._check_open()
            if self.graphs is not None:
                # NOTE: on this thread, before the step: a capture never overlaps a step on the
                # host (its cuBLAS workspace clears must not race the step's matmuls); a step
                # launched ahead may still run on the device, and the units' work on the entry's
                # stream waits for it. None while requests wait for their first token, within a
                # bound (capture_pacing.py).
                started = time.perf_counter()
                units = self.graphs.before_step(self.scheduler.has_pending_prefills())
                self._capture_work = (units, time.perf_counter() - started)
            outputs, self._pending = self._pending, []
            ahead, self._ahead = self._ahead, None
            if ahead is not None and any(seq.is_running for seq in ahead.seqs):
                go_ahead = self._may_step_ahead(ahead.seqs)
                return outputs + self._finish_decode(ahead.seqs, ahead.tokens, outputs, go_ahead)
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return outputs
            return outputs + self._run(batch, outputs)

    def _run(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Run one scheduled batch: its logits, then its sampled tokens as outputs (`outputs`:
        those already owed this step, kept for the next one if the batch fails)."""
        if self.link is not None:
            self.link.send_batch(batch)  # the followers run the same batch on their shards
        try:
            logits = self.runner.run(batch)
        except BaseException:
            # NOTE: the batch's KV is not trustworthy now: abort its requests (their blocks
            # go back) and keep every output owed for the next step, then re-raise.
            self._pending = outputs
            for seq in batch.seqs:
                self.abort_request(seq.request_id)
            raise
        if self.overlap and not batch.prefills and self._may_step_ahead(batch.decodes):
            tokens = HostTokens(greedy_tokens(logits))
            return self._finish_decode(batch.decodes, tokens, outputs, True)
        forks = self.scheduler.advance(batch)
        # Prefills that stop mid-prompt (chunked) get no token this step; forks that start
        # from a completed prefill sample from their parent's row.
        rows = [i for i, done in enumerate(batch.completes) if done]
        seqs = [batch.seqs[i] for i in rows] + [fork for _, fork in forks]
        rows += [row for row, _ in forks]
        picked = sample_rows(logits if rows == list(range(len(batch.seqs))) else logits[rows], seqs)
        new = [
            self._fail(seq, choice) if isinstance(choice, Exception) else self._append(seq, *choice)
            for seq, choice in zip(seqs, picked, strict=True)
        ]
        self._num_steps += 1
        self._num_generated_tokens += sum(len(out.new_token_ids) for out in outputs + new)
        return new

    def _may_step_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the step after this one may be launched before its tokens are read: the
        same rows would run, each sampling greedily (graphguard/engine/step/overlap.py)."""
        return self.scheduler.may_step_ahead(seqs) and all(
            decodes_ahead(seq, self.max_model_len) for seq in seqs
        )

    def _finish_decode(
        self, seqs: list[Sequence], tokens: HostTokens, owed: list[RequestOutput], go_ahead: bool
    ) -> list[RequestOutput]:
        """A greedy decode step over `seqs` whose tokens are on their way to the host: launch
        the next step from them first when it may go ahead (`go_ahead`: `_may_step_ahead`, as
        the caller found it), then read them and append them to the requests still running
        (an abort meanwhile drops its row)."""
        if go_ahead and self.scheduler.reserve_ahead(seqs):
            try:
                logits = self.runner.decode(seqs, ahead_ids=tokens.device_ids)
            except BaseException:
                self._pending = owed
                for seq in seqs:
                    self.abort_request(seq.request_id)
                raise
            self._ahead = StepAhead(seqs, HostTokens(greedy_tokens(logits)))
            self._num_steps_ahead += 1
        outputs = [
            self._append(seq, token_id)
            for seq, token_id in zip(seqs, tokens.wait(), strict=True)
            if seq.is_running
        ]
        self._num_steps += 1
        self._num_generated_tokens += len(outputs)
        return outputs

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a request whose own sampling raised; its neighbours go on."""
        log.error(
            "request %s failed in sampling: %s: %s", seq.request_id, type(error).__name__, error
        )
        self.scheduler.finish(seq, "abort")
        output = build_output(seq, self._detokenizers[seq.request_id], [])
        output.error = f"{type(error).__name__}: {error}"
        self._forget(seq.request_id)
        return output

    def _append(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        detokenizer = self._detokenizers[seq.request_id]
        if seq.params.max_tokens == 0:  # prompt scoring: the prefill ran, no token is kept
            self.scheduler.finish(seq, "length")
            self._forget(seq.request_id)
            return build_output(seq, detokenizer, [])
        seq.append_token(token_id)
        eos = self.tokenizer.eos_token_ids
        reason = finish_reason(seq, token_id, detokenizer, eos, self.max_model_len)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget(seq.request_id)
        return build_output(seq, detokenizer, [token_id], None if logprob is None else [logprob])

    def _forget(self, request_id: str) -> None:
        del self._seqs[request_id]
        del self._detokenizers[request_id]

    def has_unfinished_requests(self) -> bool:
        with self.lifecycle_lock:
            return bool(self._seqs or self._pending)

    def has_capture_in_flight(self) -> bool:
        """Whether a graph capture waits for more steps: a loop with no request to step for
        keeps calling step() while this holds, so that idle time finishes the capture."""
        with self.lifecycle_lock:
            return self.graphs is not None and self.graphs.has_capture_in_flight

    # -- what the server shows of the graphs (safe from any thread) --------------------------
    @property
    def graphs_off_reason(self) -> str | None:
        """Why decode runs eagerly (None while graphs are on)."""
        if self.graphs is not None:
            return None
        # NOTE: the engine sets one of graphs and _graphs_off when it starts; neither is left
        # once it has shut down.
        return self._graphs_off or "the engine is shut down"

    @property
    def graph_registry(self) -> Any:
        """The Prometheus registry of the decode and prefill graphs, or None when graphs are off."""
        graphs = self.graphs
        return graphs.registry if graphs is not None else None

    def graphs_report(self) -> dict[str, Any]:
        """The resident graphs as /v1/graphs shows them: decode stats with the prefill graphs'
        under "prefill", or {"enabled": False, "reason": ...}. Takes the graph runners' locks,
        not the engine's: call it off the event loop."""
        graphs, kernels = self.graphs, self.kernels.describe()
        if graphs is None:
            return {"enabled": False, "reason": self.graphs_off_reason, "kernels": kernels}
        return {**graphs.stats(), "kernels": kernels}

    def stats(self) -> dict:
        """A snapshot of queue lengths, KV use and counters."""
        with self.lifecycle_lock:
            is_open = not self._is_shut_down
            return {
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_used": self.kv.num_used_blocks if is_open else 0,
                "kv_blocks_free": self.kv.num_free_blocks if is_open else 0,
                "kv_blocks_total": self.num_usable_blocks if is_open else 0,
                "kv_bytes": self.kv.kv_bytes if is_open else 0,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_prefilled_tokens": self.scheduler.num_prefilled_tokens,
                "num_steps": self._num_steps,
                "num_generated_tokens": self._num_generated_tokens,
                "num_steps_ahead": self._num_steps_ahead,
                "is_shut_down": self._is_shut_down,
                # hit rate (prompt tokens whose KV came from the cache) and cached blocks
                "prefix_cache": cache.stats() if (cache := self.scheduler.prefix_cache) else None,
            }

    def reload_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Swap in new weights in place; every graph is retired first (it read the old ones).

        Running requests continue; their cached KV was computed with the old weights.
        """
        if self.link is not None:
            raise RuntimeError(
                "reload_weights is not supported with tensor parallelism: each rank holds a "
                "shard of the weights; restart with the new ones"
            )
        if (why := self.kernels.kernels.no_reload) is not None:
            raise RuntimeError(
                f"reload_weights is not supported with the {self.kernels.name} kernels: {why}"
            )
        with self.lifecycle_lock:
            self._check_open()
            if self.graphs is not None:
                self.graphs.invalidate()
            self._ahead = None  # read with the old weights: the next step runs it again
            with torch.no_grad():
                self.model.load_state_dict(state_dict, strict=True)
            self.kv.clear_prefix_cache()  # computed with the old weights

    def shutdown(self) -> None:
        """Abort every request, release graphs and the KV pool. Safe to call twice."""
        with self.lifecycle_lock:
            if self._is_shut_down:
                return
            self._is_shut_down = True
            self.scheduler.abort_all()
            self._seqs.clear()
            self._detokenizers.clear()
            self._pending.clear()
            self._ahead = None
            if self.link is not None:
                self.link.send_shutdown()
            graphs, self.graphs = self.graphs, None
            if graphs is not None:
                graphs.close()  # closed runners run eagerly if called; no step runs from here
            self.kv.release()
            if self._trace is not None:
                self._trace.close()

    def _check_open(self) -> None:
        if self._is_shut_down:
            raise RuntimeError("the engine has been shut down")
