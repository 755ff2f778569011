"""vLLM's request fields on a real server over the embedded model: each is honoured (its effect
asserted here), or refused with a 400 that names it; a field the server does not know is a
400 unless it runs permissive."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from .helpers import CHAT, COMPLETIONS, COUNTING, QUESTION, RunningServer, ok, post

GREEDY: dict[str, Any] = {"temperature": 0.0}


def text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def refused(server: RunningServer, path: str, param: str, **fields: Any) -> dict[str, Any]:
    response = post(server, path, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") + error["message"], error
    return dict(error)


def test_min_tokens_keeps_the_answer_going_past_its_end(server: RunningServer) -> None:
    short = ok(server, CHAT, max_tokens=40, **GREEDY)
    longer = ok(server, CHAT, max_tokens=40, min_tokens=30, **GREEDY)
    assert short["usage"]["completion_tokens"] < 30 <= longer["usage"]["completion_tokens"]


def test_repetition_penalty_changes_a_repeating_answer(server: RunningServer) -> None:
    plain = text(ok(server, COMPLETIONS, max_tokens=16, **GREEDY))
    penalized = text(ok(server, COMPLETIONS, max_tokens=16, repetition_penalty=1.8, **GREEDY))
    assert plain.startswith(" 5, 6") and penalized != plain


def test_min_p_one_keeps_only_the_likeliest_token(server: RunningServer) -> None:
    greedy = text(ok(server, COMPLETIONS, max_tokens=6, **GREEDY))
    for seed in range(3):
        sampled = ok(server, COMPLETIONS, max_tokens=6, temperature=1.5, min_p=1.0, seed=seed)
        assert text(sampled) == greedy


def test_stop_strings_any_number_and_included_on_request(server: RunningServer) -> None:
    stops = [" 7", "a", "b", "c", "d", "e"]  # lm-eval adds the end-of-text one to a task's
    cut = ok(server, COMPLETIONS, max_tokens=20, stop=stops, **GREEDY)
    kept = ok(server, COMPLETIONS, max_tokens=20, stop=stops, include_stop_str_in_output=True,
              **GREEDY)  # fmt: skip
    assert text(cut) == " 5, 6," and text(kept) == " 5, 6, 7"
    assert cut["choices"][0]["stop_reason"] == " 7" == kept["choices"][0]["stop_reason"]


def test_special_tokens_are_kept_in_the_text_when_asked(server: RunningServer) -> None:
    plain = ok(server, CHAT, max_tokens=30, **GREEDY)
    assert plain["choices"][0]["finish_reason"] == "stop"
    # the end of sequence is a stop: its text joins the output only with both switches
    both = dict(skip_special_tokens=False, include_stop_str_in_output=True)
    kept = ok(server, CHAT, max_tokens=30, spaces_between_special_tokens=False, **both, **GREEDY)
    assert text(kept) == text(plain) + "<|im_end|>"
    spaced = ok(server, CHAT, max_tokens=30, **both, **GREEDY)  # a special token set apart
    assert text(spaced) == text(plain) + " <|im_end|>"
    skipped = ok(server, CHAT, max_tokens=30, include_stop_str_in_output=True, **GREEDY)
    assert text(skipped) == text(plain)
    assert text(ok(server, CHAT, max_tokens=30, skip_special_tokens=False, **GREEDY)) == text(plain)


def test_bad_words_and_allowed_token_ids_bound_the_tokens(server: RunningServer, engine) -> None:
    assert "6" not in text(ok(server, COMPLETIONS, max_tokens=6, bad_words=["6"], **GREEDY))
    allowed = engine.tokenizer.encode(" 5", add_special_tokens=False)  # " " and "5"
    only = ok(server, COMPLETIONS, max_tokens=4, allowed_token_ids=allowed, **GREEDY)
    assert set(text(only)) <= {" ", "5"} and only["usage"]["completion_tokens"] == 4


def test_prompt_logprobs_come_back_in_vllms_shape(server: RunningServer) -> None:
    answer = ok(server, COMPLETIONS, max_tokens=1, prompt_logprobs=1, **GREEDY)
    scored = answer["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == answer["usage"]["prompt_tokens"]
    first = next(iter(scored[1].values()))
    assert set(first) == {"logprob", "rank", "decoded_token"}
    chat = ok(server, CHAT, max_tokens=1, prompt_logprobs=0, **GREEDY)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server: RunningServer) -> None:
    long = "Some words that will not be read. " + COUNTING
    cut = ok(server, COMPLETIONS, prompt=long, max_tokens=5, truncate_prompt_tokens=8, **GREEDY)
    assert cut["usage"]["prompt_tokens"] == 8 and text(cut).startswith(" 5")


@pytest.mark.parametrize(
    "fields,pattern",
    [
        ({"guided_regex": "[0-9]{3}"}, r"[0-9]{3}"),
        ({"guided_choice": ["yes", "no"]}, r"(yes|no)"),
        ({"structured_outputs": {"choice": ["Paris", "Lyon"]}}, r"(Paris|Lyon)"),
        ({"structured_outputs": {"regex": "[A-Z][a-z]+"}}, r"[A-Z][a-z]+"),
        ({"guided_grammar": 'start: "It is " ("Paris" | "Rome")'}, r"It is (Paris|Rome)"),
    ],
)
def test_structured_outputs_confine_the_answer(server, fields, pattern) -> None:
    answer = ok(server, CHAT, max_tokens=20, **fields, **GREEDY)
    assert re.fullmatch(pattern, text(answer)), text(answer)


def test_guided_json_gives_a_document_of_the_schema(server: RunningServer) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for fields in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        answer = ok(server, CHAT, max_tokens=40, **fields, **GREEDY)
        assert isinstance(json.loads(text(answer))["city"], str)


def test_two_output_constraints_at_once_are_refused(server: RunningServer) -> None:
    refused(server, CHAT, "guided_regex", guided_regex="a+", guided_choice=["x"])
    refused(server, CHAT, "response_format", guided_regex="a+",
            response_format={"type": "json_object"})  # fmt: skip
    refused(server, CHAT, "guided_regex", guided_regex="(")


def test_chat_template_controls(server: RunningServer) -> None:
    begun = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    cont = ok(server, CHAT, messages=begun, add_generation_prompt=False,
              continue_final_message=True, max_tokens=3, **GREEDY)  # fmt: skip
    assert text(cont).startswith(" Paris")
    echoed = ok(server, CHAT, messages=begun, add_generation_prompt=False,
                continue_final_message=True, echo=True, max_tokens=3, **GREEDY)  # fmt: skip
    assert text(echoed) == "The capital of France is" + text(cont)
    counting = ok(server, CHAT, chat_template="{{ greeting }}", max_tokens=5,
                  chat_template_kwargs={"greeting": COUNTING}, **GREEDY)  # fmt: skip
    assert text(counting) == " 5, 6"
    refused(server, CHAT, "continue_final_message", continue_final_message=True)


def test_tool_history_reaches_the_template(server: RunningServer) -> None:
    # the template writes the counting prompt only if the call's parsed arguments and the
    # answer's call id arrive
    template = (
        "{% if messages[1].tool_calls[0].function.arguments.city == 'Paris' and "
        "messages[2].tool_call_id == 'call-1' %}" + COUNTING + "{% else %}no{% endif %}"
    )
    arguments = json.dumps({"city": "Paris"})
    call = {"id": "call-1", "type": "function",
            "function": {"name": "weather", "arguments": arguments}}  # fmt: skip
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
    ]
    answer = ok(server, CHAT, messages=history, chat_template=template, max_tokens=5, **GREEDY)
    assert text(answer) == " 5, 6"


def test_a_field_the_server_does_not_know_is_a_400_naming_it(server: RunningServer) -> None:
    error = refused(server, CHAT, "frobnicate", frobnicate=1)
    assert error["code"] == "unknown_field"
    nested = refused(server, CHAT, "messages[0].mood",
                     messages=[{"role": "user", "content": "hi", "mood": "happy"}])  # fmt: skip
    assert nested["param"] == "messages[0].mood"
    refused(server, COMPLETIONS, "frobnicate", frobnicate=1)


def test_cache_salt_is_taken_and_checked(server: RunningServer) -> None:
    assert text(ok(server, COMPLETIONS, max_tokens=2, cache_salt="tenant-a", **GREEDY))
    refused(server, COMPLETIONS, "cache_salt", cache_salt="")
