"""Offline API: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(messages)``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tqdm import tqdm

from graphguard.engine.config import engine_config
from graphguard.engine.engine import LLMEngine
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams, TokenLogprob


@dataclass
class CompletionOutput:
    """The finished result of one prompt."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs
    # One per prompt token (None for the first), when SamplingParams.prompt_logprobs.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Batch generation over an LLMEngine.

    ``model`` is a load_model source (None = the embedded model) or an already LoadedModel;
    ``engine_kwargs`` are EngineConfig fields or the flat graph settings (``enforce_eager``,
    ``max_graph_bytes``, ...; see graphguard.engine.config.engine_config).
    """

    def __init__(self, model: str | LoadedModel | None = None, **engine_kwargs: object) -> None:
        loaded = model if isinstance(model, LoadedModel) else None
        source = None if loaded is not None else model
        config = engine_config(model=source, **engine_kwargs)
        self.engine = LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Complete every prompt; results come back in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        token_ids = [self.tokenizer.encode(prompt) for prompt in prompts]
        return self.generate_from_token_ids(token_ids, params, use_tqdm)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> CompletionOutput:
        """Answer one conversation, formatted with the model's chat template."""
        prompt_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate_from_token_ids([prompt_ids], params, use_tqdm=False)[0]

    def generate_from_token_ids(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Like generate(), from token ids; ValueError on any bad request before one runs."""
        all_params = _per_prompt(params, len(prompts))
        ids = [f"llm-{next(self._request_ids)}" for _ in prompts]
        results: dict[str, CompletionOutput] = {}
        try:
            for request_id, prompt_ids, p in zip(ids, prompts, all_params, strict=True):
                self.engine.add_request(request_id, prompt_ids, p)
            self._run_until_done(results, len(ids), use_tqdm)
        finally:
            self._abort_unfinished(ids, results)
        return [results[request_id] for request_id in ids]

    def _run_until_done(
        self, results: dict[str, CompletionOutput], num_requests: int, use_tqdm: bool
    ) -> None:
        token_ids: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        with tqdm(total=num_requests, desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(results) < num_requests and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    token_ids.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.logprobs is not None:
                        logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.finished:
                        results[out.request_id] = CompletionOutput(
                            text=out.text,
                            token_ids=token_ids.pop(out.request_id),
                            finish_reason=out.finish_reason,
                            num_prompt_tokens=out.num_prompt_tokens,
                            logprobs=logprobs.pop(out.request_id, None),
                            prompt_logprobs=prompt_logprobs.pop(out.request_id, None),
                        )
                        bar.update(1)

    def _abort_unfinished(self, ids: list[str], results: dict[str, CompletionOutput]) -> None:
        """After a failed call: abort what is left and drain the abort outputs."""
        unfinished = [request_id for request_id in ids if request_id not in results]
        for request_id in unfinished:
            self.engine.abort_request(request_id)
        # Only this call's requests live in this private engine, so draining runs no model.
        while unfinished and self.engine.has_unfinished_requests():
            self.engine.step()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _per_prompt(
    params: SamplingParams | list[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    return list(params)
