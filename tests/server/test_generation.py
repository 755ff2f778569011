"""Completions and chat through the openai client: content, streaming, usage, stop, seed."""

from __future__ import annotations

import json

import httpx
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from .helpers import MODEL, RunningServer

CAPITAL_QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


def test_models_lists_the_served_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_chat_answers_paris(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CAPITAL_QUESTION, temperature=0, max_tokens=12
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_greedy_chat_stream_answers_paris(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CAPITAL_QUESTION, temperature=0, max_tokens=12, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_greedy_completion_continues_with_paris(client: OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3
    )
    assert reply.choices[0].text.startswith(" Paris")
    assert reply.choices[0].finish_reason == "length"


def test_streamed_completion_joins_to_the_non_streamed_text(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 6}
    whole = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert whole.startswith(" 5, 6")


def test_chat_usage_counts_match_the_tokenizer(client: OpenAI, server: RunningServer) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CAPITAL_QUESTION, temperature=0, max_completion_tokens=3
    )
    num_prompt = len(server.tokenizer.apply_chat_template([dict(m) for m in CAPITAL_QUESTION]))
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == num_prompt
    assert reply.usage.completion_tokens == 3  # finish_reason "length": exactly max tokens
    assert reply.usage.total_tokens == num_prompt + 3


def test_completion_usage_counts_match_the_tokenizer(client: OpenAI, server: RunningServer) -> None:
    prompt = "Once upon a time"
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(server.tokenizer.encode(prompt))
    assert reply.usage.completion_tokens == 4


def test_stream_usage_chunk_matches_the_non_streamed_usage(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": CAPITAL_QUESTION, "temperature": 0, "max_tokens": 4}
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(  # type: ignore[call-overload]
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage


def test_stop_string_ends_the_completion_before_it(client: OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=[" 7", "zz"]
    )
    assert reply.choices[0].text == " 5, 6,"
    assert reply.choices[0].finish_reason == "stop"


def test_same_seed_samples_the_same_text(client: OpenAI) -> None:
    def draw() -> str:
        reply = client.completions.create(
            model=MODEL, prompt="My favourite animal is", temperature=1.0, seed=7, max_tokens=8
        )
        return reply.choices[0].text

    assert draw() == draw()


def test_frequency_and_presence_penalties_curb_repetition(client: OpenAI) -> None:
    prompt = "The colors of the rainbow are red, red, red, red, red,"
    kwargs = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 16}
    plain = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    assert plain.count("red") >= 6  # greedy decoding keeps repeating the pattern
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        reply = client.completions.create(**kwargs, **penalty)  # type: ignore[call-overload]
        assert reply.choices[0].text.count("red") <= 2, (penalty, reply.choices[0].text)


def test_sse_stream_is_json_events_ending_in_done(server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_without_max_tokens_fits_a_kv_pool_smaller_than_the_context(
    client: OpenAI,
) -> None:
    # The test pool holds 1008 tokens against a 1024-token context: an unbounded request
    # must be sized to the pool, not refused by the engine.
    reply = client.chat.completions.create(
        model=MODEL, messages=CAPITAL_QUESTION, temperature=0, stop=["."]
    )
    assert "Paris" in (reply.choices[0].message.content or "")


def test_chat_logprobs_describe_each_generated_token(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": CAPITAL_QUESTION, "temperature": 0, "max_tokens": 8}
    reply = client.chat.completions.create(logprobs=True, top_logprobs=3, **kwargs)  # type: ignore[call-overload]
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = choice.logprobs.content
    # Every generated token but the end-of-sequence one, which is not part of the content.
    assert reply.usage is not None and choice.finish_reason == "stop"
    assert len(tokens) == reply.usage.completion_tokens - 1
    content = choice.message.content or ""
    assert "".join(t.token for t in tokens) == content
    assert b"".join(bytes(t.bytes or []) for t in tokens) == content.encode()
    for token in tokens:
        assert token.logprob <= 0.0 and len(token.top_logprobs) == 3
        alternatives = [t.logprob for t in token.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        # Greedy picks the most likely token: it is the first alternative, same logprob.
        assert token.top_logprobs[0].token == token.token
        assert abs(token.top_logprobs[0].logprob - token.logprob) < 1e-6
    plain = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content

    stream = client.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **kwargs)  # type: ignore[call-overload]
    streamed = [
        t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content or []
    ]  # fmt: skip
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in tokens]


def test_completion_logprobs_line_up_with_the_text(client: OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None
    lp = choice.logprobs
    assert lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == 5
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top, key=top.__getitem__) == token
        assert abs(top[token] - logprob) < 1e-6


def test_echo_returns_the_prompt_and_its_token_logprobs(client: OpenAI) -> None:
    prompt = "The capital of France is Paris"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=2, logprobs=1, echo=True
    )
    choice, usage = reply.choices[0], reply.usage
    assert choice.text.startswith(prompt) and usage is not None
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    # The first prompt token has no context; every other token has a logprob.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])
    # " Paris" (the last prompt token) scores as it does when generated after the rest.
    asked = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=1, logprobs=1
    ).choices[0]
    assert asked.text == " Paris" and asked.logprobs is not None
    assert asked.logprobs.token_logprobs is not None
    paris = lp.token_logprobs[usage.prompt_tokens - 1]
    assert paris is not None
    assert abs(paris - asked.logprobs.token_logprobs[0]) < 1e-3

    plain = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=2, echo=True
    ).choices[0]
    assert plain.text == choice.text and plain.logprobs is None
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=2, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_logprobs_of_tokens_that_split_a_character_carry_their_bytes(client: OpenAI) -> None:
    prompt = "日本語のテキスト 🎉 ok"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=1, logprobs=0, echo=True
    )
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    text = reply.choices[0].text
    # Byte-level tokens split these characters: such tokens are named by their bytes ...
    partial = [t for t in lp.tokens if t.startswith("bytes:")]
    assert partial and all(t.startswith("bytes:\\x") for t in partial)
    # ... and offsets count characters of the returned text, never past its end.
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    whole = [(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True) if t == " ok"]
    assert whole and text[whole[0][1] :].startswith(" ok")


def test_completion_logprobs_list_every_token_control_tokens_too(client: OpenAI) -> None:
    # A chat-formatted prompt: the model answers, then ends its turn with <|im_end|>.
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=24, logprobs=1, echo=True
    )
    choice, usage = reply.choices[0], reply.usage
    lp = choice.logprobs
    assert usage is not None and lp is not None and choice.finish_reason == "stop"
    assert lp.tokens is not None and lp.text_offset is not None
    # One entry per token, so scoring tools can index them by position.
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert lp.tokens[-1] == "<|im_end|>" and lp.text_offset[-1] == len(choice.text)
    # Control tokens the prompt spells sit at their place in the echoed text.
    for token, offset in zip(lp.tokens[: usage.prompt_tokens], lp.text_offset, strict=False):
        assert choice.text[offset:].startswith(token), (token, offset)


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client: OpenAI) -> None:
    prompt = "The capital of France is Paris"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True
    )
    choice, usage = reply.choices[0], reply.usage
    assert choice.text == prompt and choice.finish_reason == "length"
    assert usage is not None and usage.completion_tokens == 0
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == usage.prompt_tokens
