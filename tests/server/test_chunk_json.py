"""Streamed chunks written from a per-response template are what pydantic writes for the same
chunk, byte for byte, whatever the text, index, finish reason and model name."""

from __future__ import annotations

import os
import warnings
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from graphguard.server import responses as r
from graphguard.server.formatting import (
    ChatFormat,
    CompletionFormat,
    CompletionPrompt,
    response_id,
)

TOKENIZER: Any = None  # the chunks without logprobs never read it
FINISH = st.sampled_from([None, "stop", "length", "abort"])
MODEL_NAMES = st.sampled_from(["SmolLM2-135M-Instruct", 'a "quoted"\\name é', "模型/\u2028x"])


@settings(max_examples=300, deadline=None)
@given(text=st.text(), index=st.integers(0, 127), finish=FINISH, model=MODEL_NAMES)
def test_a_completion_chunk_is_the_json_pydantic_writes(
    text: str, index: int, finish: str | None, model: str
) -> None:
    fmt = CompletionFormat(model, TOKENIZER, [CompletionPrompt([1])] * (index + 1))
    expected = r.CompletionResponse(
        id=fmt.request_id,
        created=fmt.created,
        model=model,
        choices=[r.CompletionChoice(index=index, text=text, finish_reason=finish)],
    )
    assert fmt.chunk(index, text, finish, []) == expected.model_dump_json()


@settings(max_examples=300, deadline=None)
@given(text=st.text(), index=st.integers(0, 127), finish=FINISH, model=MODEL_NAMES)
def test_a_chat_chunk_is_the_json_pydantic_writes(
    text: str, index: int, finish: str | None, model: str
) -> None:
    fmt = ChatFormat(model, TOKENIZER, num_choices=index + 1)
    choice = r.ChatChunkChoice(
        index=index, delta=r.ChatDelta(content=text or None), finish_reason=finish
    )
    expected = r.ChatCompletionChunk(
        id=fmt.request_id, created=fmt.created, model=model, choices=[choice]
    )
    assert fmt.chunk(index, text, finish, []) == expected.model_dump_json()


def test_an_echoed_prompt_leads_its_choices_first_chunk_only() -> None:
    prompts = [CompletionPrompt([1, 2], "Once"), CompletionPrompt([3], "Twice")]
    fmt = CompletionFormat("m", TOKENIZER, prompts)
    texts = [
        r.CompletionResponse.model_validate_json(fmt.chunk(i, " upon", None, [])) for i in (1, 0, 1)
    ]

    assert [t.choices[0].text for t in texts] == ["Twice upon", "Once upon", " upon"]
    assert [t.choices[0].index for t in texts] == [1, 0, 1]


def test_every_chunk_of_a_response_carries_its_creation_time() -> None:
    fmt = ChatFormat("m", TOKENIZER)
    chunks = [fmt.opening()[0].model_dump_json(), fmt.chunk(0, "a", None, [])]
    chunks.append(
        fmt.usage_chunk(
            r.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        ).model_dump_json()
    )

    created = {r.ChatCompletionChunk.model_validate_json(chunk).created for chunk in chunks}
    assert created == {fmt.created}


def test_response_ids_are_openai_shaped_and_distinct() -> None:
    ids = [response_id("cmpl") for _ in range(10_000)]

    assert len(set(ids)) == len(ids)
    assert all(len(i) == 37 and int(i.removeprefix("cmpl-"), 16) >= 0 for i in ids)
    assert CompletionFormat("m", TOKENIZER, []).request_id.startswith("cmpl-")
    assert ChatFormat("m", TOKENIZER).request_id.startswith("chatcmpl-")


def test_a_forked_child_draws_other_response_ids_than_its_parent() -> None:
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # forking with threads running: the child only writes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.write(write_end, response_id("cmpl").encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as pipe:
        child_id = pipe.read()

    assert child_id.startswith("cmpl-") and child_id != response_id("cmpl")
