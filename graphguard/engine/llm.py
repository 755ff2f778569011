"""Offline API in vLLM's shape: ``LLM(model).generate(prompts, sampling_params)`` and
``LLM.chat(messages)``, returning vLLM's RequestOutputs (graphguard/engine/llm_outputs.py).

vLLM's keywords are taken where graphguard has the setting (graphguard/engine/llm_args.py), and
refused with the reason where it has not; the model's generation config gives the defaults of
a call without sampling parameters, as vLLM's `generation_config="auto"` does.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from graphguard.engine.config import engine_config
from graphguard.engine.engine import LLMEngine
from graphguard.engine.generation_config import generation_defaults
from graphguard.engine.llm_args import Prompt, engine_settings, prompts_of
from graphguard.engine.llm_outputs import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    logprob_dicts,
    prompt_logprob_dicts,
)
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.outputs import RequestOutput as StepOutput
from graphguard.engine.tokens.sampling import SamplingParams, TokenLogprob, fork_seed

Params = SamplingParams | list[SamplingParams] | None


class LLM:
    """Batch generation over an LLMEngine.

    ``model`` is a load_model source (None = the embedded model) or an already LoadedModel;
    the keywords are vLLM's (``dtype``, ``max_model_len``, ``gpu_memory_utilization``,
    ``tensor_parallel_size``, ``enable_prefix_caching``, ``enforce_eager``, ``seed``, ...) or
    graphguard's own (EngineConfig fields and the graph settings of
    graphguard.engine.config.engine_config). ``generation_config`` is vLLM's: "auto" (the
    model's generation_config.json gives the default sampling parameters), "vllm" (none), or a
    folder.
    """

    def __init__(
        self,
        model: str | LoadedModel | None = None,
        *,
        generation_config: str = "auto",
        **engine_kwargs: Any,
    ) -> None:
        loaded = model if isinstance(model, LoadedModel) else None
        source = None if loaded is not None else model
        config = engine_config(model=source, **engine_settings(engine_kwargs))
        self.engine = LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._defaults = generation_defaults(generation_config, self.engine.loaded.folder)
        self._request_ids = itertools.count()
        self._partial: dict[str, StepOutput] = {}  # unfinished requests' outputs so far

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a call that gives none: vLLM's defaults, with the
        model's generation config over them."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self) -> Any:
        """The tokenizer as a transformers tokenizer (encode, decode, apply_chat_template)."""
        from transformers import PreTrainedTokenizerFast

        special = self.tokenizer.special_tokens
        return PreTrainedTokenizerFast(
            tokenizer_object=self.tokenizer.backend, chat_template=self.tokenizer.chat_template,
            **special,
        )  # fmt: skip

    def generate(
        self,
        prompts: Any,
        sampling_params: Params = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (a string, ``{"prompt": text}``, ``{"prompt_token_ids":
        ids}``, or a list of them); one RequestOutput each, in prompt order."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: LoRA adapters are not served")
        return self._run(prompts_of(prompts), sampling_params, use_tqdm)

    def generate_from_token_ids(
        self, prompts: list[list[int]], sampling_params: Params = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Like generate(), from token ids."""
        return self._run([Prompt(None, list(ids)) for ids in prompts], sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: Params = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation, or a list of them, each rendered with the chat template
        (the model's, or `chat_template`) as vLLM renders it."""
        conversations = _conversations(messages)
        options: dict[str, Any] = dict(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            chat_template=chat_template, template_kwargs=chat_template_kwargs,
        )  # fmt: skip
        render = self.tokenizer.render_chat
        prompts = [Prompt(render(c, **options), None) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def _run(
        self,
        prompts: list[Prompt],
        params: Params,
        use_tqdm: bool,
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Every prompt's n choices as engine requests; ValueError on any bad request before
        one runs."""
        all_params = self._per_prompt(params, len(prompts))
        token_ids = [
            p.token_ids if p.token_ids is not None
            else self.tokenizer.encode(p.text or "", add_special_tokens=add_special_tokens)
            for p in prompts
        ]  # fmt: skip
        groups = [[f"llm-{next(self._request_ids)}"] for _ in prompts]
        outputs: dict[str, StepOutput] = {}
        added: list[str] = []
        try:
            for group, ids, sampling in zip(groups, token_ids, all_params, strict=True):
                self._add(group, ids, sampling, added)
            self._run_until_done(outputs, added, use_tqdm)
        finally:
            self._abort_unfinished(added, outputs)
        failed = [output for output in outputs.values() if output.error]
        if failed:  # an answer cut short is no answer: say so, not return its part
            first = failed[0]
            raise RuntimeError(
                f"{len(failed)} of {len(outputs)} requests failed; {first.request_id}: "
                f"{first.error}"
            )
        return [
            self._request_output(prompt, ids, group, outputs)
            for prompt, ids, group in zip(prompts, token_ids, groups, strict=True)
        ]

    def _per_prompt(self, params: Params, num_prompts: int) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        if not isinstance(params, list) or any(not isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them")
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
        return list(params)

    def _add(
        self, group: list[str], ids: list[int], params: SamplingParams, added: list[str]
    ) -> None:
        """A prompt's first choice, and its other n - 1 as forks of it (one prefill)."""
        first = group[0]
        self.engine.add_request(first, ids, params)
        added.append(first)
        for j in range(1, params.n):
            seed = None if params.seed is None else fork_seed(params.seed, j)
            fork = f"{first}-{j}"
            self.engine.add_request(fork, ids, replace(params, seed=seed), fork_of=first)
            group.append(fork)
            added.append(fork)

    def _run_until_done(
        self, outputs: dict[str, StepOutput], request_ids: list[str], use_tqdm: bool
    ) -> None:
        """Step until every request finished; each request's outputs merged into one."""
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm)
        with bar:
            while len(outputs) < len(request_ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    merged = _merge(self._partial.get(out.request_id), out)
                    if out.finished:
                        self._partial.pop(out.request_id, None)
                        outputs[out.request_id] = merged
                        bar.update(1)
                    else:
                        self._partial[out.request_id] = merged

    def _request_output(
        self, prompt: Prompt, ids: list[int], group: list[str], outputs: dict[str, StepOutput]
    ) -> RequestOutput:
        first = outputs[group[0]]
        return RequestOutput(
            request_id=group[0],
            prompt=prompt.text,
            prompt_token_ids=list(ids),
            prompt_logprobs=prompt_logprob_dicts(first.prompt_logprobs, self._token_text),
            outputs=[self._choice(j, outputs[r]) for j, r in enumerate(group)],
        )

    def _choice(self, index: int, out: StepOutput) -> CompletionOutput:
        chosen = out.logprobs
        return CompletionOutput(
            index=index,
            text=out.text,
            token_ids=list(out.new_token_ids),
            cumulative_logprob=None if chosen is None else sum(lp.logprob for lp in chosen),
            logprobs=logprob_dicts(chosen, self._token_text),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _abort_unfinished(self, ids: list[str], outputs: dict[str, StepOutput]) -> None:
        """After a failed call: abort what is left and drain the abort outputs."""
        unfinished = [request_id for request_id in ids if request_id not in outputs]
        for request_id in unfinished:
            self.engine.abort_request(request_id)
            self._partial.pop(request_id, None)
        # Only this call's requests live in this private engine, so draining runs no model.
        while unfinished and self.engine.has_unfinished_requests():
            self.engine.step()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _merge(before: StepOutput | None, out: StepOutput) -> StepOutput:
    """One request's outputs so far as one (its token ids and logprobs gathered)."""
    if before is None:
        return out
    logprobs: list[TokenLogprob] | None = None
    if before.logprobs is not None or out.logprobs is not None:
        logprobs = [*(before.logprobs or []), *(out.logprobs or [])]
    return replace(
        out,
        new_token_ids=[*before.new_token_ids, *out.new_token_ids],
        logprobs=logprobs,
        prompt_logprobs=before.prompt_logprobs or out.prompt_logprobs,
    )


def _conversations(messages: Any) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them; TypeError otherwise."""
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return [messages]
    if (
        isinstance(messages, list)
        and messages
        and all(isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in messages)
    ):
        return messages
    raise TypeError("messages must be a list of message dicts, or a list of such lists")


__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput"]
