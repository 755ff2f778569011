"""The offline API on the real embedded model, in vLLM's shape: scripts written for vLLM's `LLM`
and `SamplingParams` run unchanged."""

from __future__ import annotations

import pytest

from graphguard.engine import outputs
from graphguard.engine.llm import LLM, RequestOutput
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams
from tests.unit.engine.fixtures_engine import one_torch_thread  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
COUNT = "1, 2, 3, 4,"


@pytest.fixture(scope="module")
def llm(embedded_model: LoadedModel) -> LLM:
    return LLM(embedded_model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def answer(llm: LLM) -> RequestOutput:
    (out,) = llm.chat(QUESTION, CHAT_GREEDY, use_tqdm=False)
    return out


def test_chat_answers_the_capital_of_france(answer: RequestOutput) -> None:
    assert "Paris" in answer.outputs[0].text


def test_eos_ends_the_answer_with_stop(answer: RequestOutput, llm: LLM) -> None:
    choice = answer.outputs[0]
    assert choice.finish_reason == "stop" and choice.stop_reason is None
    assert choice.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert len(choice.token_ids) < CHAT_GREEDY.max_tokens


def test_ignore_eos_generates_past_eos(answer: RequestOutput, llm: LLM) -> None:
    tokens = answer.outputs[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=len(tokens) + 1, ignore_eos=True)
    (longer,) = llm.chat(QUESTION, params, use_tqdm=False)
    choice = longer.outputs[0]
    assert (choice.finish_reason, len(choice.token_ids)) == ("length", len(tokens) + 1)
    assert choice.token_ids[: len(tokens)] == tokens


def test_generate_returns_results_in_prompt_order(llm: LLM) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (5, 1)]
    results = llm.generate([COUNT, "The capital of France is"], params, use_tqdm=False)
    assert [r.outputs[0].text for r in results] == [" 5, 6", " Paris"]
    assert [r.prompt for r in results] == [COUNT, "The capital of France is"]


def test_every_prompt_form_vllm_takes_gives_the_same_answer(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5)
    ids = llm.tokenizer.encode(COUNT)
    forms = [COUNT, {"prompt": COUNT}, {"prompt_token_ids": ids}, [{"prompt": COUNT}]]
    answers = [llm.generate(form, sampling_params=params, use_tqdm=False)[0] for form in forms]
    assert {a.outputs[0].text for a in answers} == {" 5, 6"}
    assert all(a.prompt_token_ids == ids for a in answers)
    assert answers[2].prompt is None and answers[1].prompt == COUNT


@pytest.mark.parametrize(
    "prompts", [42, {"text": "hi"}, {"prompt": "a", "prompt_token_ids": [1]}, [["a"]], []]
)
def test_a_prompt_of_another_shape_is_a_type_error_before_anything_runs(llm: LLM, prompts) -> None:
    with pytest.raises(TypeError):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_n_choices_are_distinct_and_repeat_under_their_seed(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=5)
    (first,) = llm.generate("Once upon a time", params, use_tqdm=False)
    (again,) = llm.generate("Once upon a time", params, use_tqdm=False)
    texts = [c.text for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c.text for c in again.outputs]
    (one,) = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=6,
                                                             seed=5), use_tqdm=False)  # fmt: skip
    assert one.outputs[0].text == texts[0]  # choice 0 of n is the n=1 answer


def test_logprobs_are_vllms_dicts_of_the_chosen_token_and_its_alternatives(llm: LLM) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=1), SamplingParams()]
    with_logprobs, without = llm.generate([COUNT, "Hi"], params, use_tqdm=False)
    assert without.outputs[0].logprobs is None and without.outputs[0].cumulative_logprob is None
    choice = with_logprobs.outputs[0]
    assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
    for token_id, top in zip(choice.token_ids, choice.logprobs, strict=True):
        chosen = top[token_id]  # greedy: the chosen token is the likeliest
        assert chosen.rank == 1 and chosen.logprob <= 0.0 and len(top) == 1
        assert chosen.decoded_token == llm.tokenizer.decode([token_id])
    total = sum(top[t].logprob for t, top in zip(choice.token_ids, choice.logprobs, strict=True))
    assert choice.cumulative_logprob == pytest.approx(total)


def test_prompt_logprobs_score_every_prompt_token_after_the_first(llm: LLM) -> None:
    prompt = "1, 2, 3, 4, 5"
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    result = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = llm.tokenizer.encode(prompt)
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(ids)
    assert result.prompt_logprobs[0] is None
    last = result.prompt_logprobs[-1]
    # A counting prompt is easy to predict: its last token is the model's first choice.
    assert last is not None and last[ids[-1]].rank == 1 and len(last) == 2


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm: LLM) -> None:
    prompt = "The capital of France is Paris"
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)
    scored, generated = llm.generate(
        [prompt, prompt], [score, SamplingParams(temperature=0.0, max_tokens=2)], use_tqdm=False
    )
    choice = scored.outputs[0]
    assert choice.token_ids == [] and choice.text == "" and choice.finish_reason == "length"
    assert scored.prompt_logprobs is not None
    assert len(scored.prompt_logprobs) == len(llm.tokenizer.encode(prompt))
    assert generated.outputs[0].text  # its neighbour in the batch is unaffected
    assert llm.engine.kv.num_used_blocks == 0


def test_a_stop_string_ends_the_text_and_is_the_stop_reason(llm: LLM) -> None:
    five_stops = SamplingParams(temperature=0.0, max_tokens=20, stop=[" 7", "x", "y", "z", "w"])
    kept_stop = SamplingParams(
        temperature=0.0, max_tokens=20, stop=" 7", include_stop_str_in_output=True
    )
    cut, kept = llm.generate([COUNT, COUNT], [five_stops, kept_stop], use_tqdm=False)
    assert cut.outputs[0].text == " 5, 6," and cut.outputs[0].stop_reason == " 7"
    assert kept.outputs[0].text == " 5, 6, 7" and kept.outputs[0].finish_reason == "stop"


def test_min_tokens_lets_no_stop_end_the_text_before_them(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=[","], min_tokens=5)
    (out,) = llm.generate(COUNT, params, use_tqdm=False)
    # " 5" "," " " "6" then "," once five tokens are out
    assert out.outputs[0].text == " 5, 6" and out.outputs[0].stop_reason == ","


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM) -> None:
    ids = llm.tokenizer.encode("Some words before. " + COUNT)
    params = SamplingParams(temperature=0.0, max_tokens=3, truncate_prompt_tokens=8)
    (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    (tail,) = llm.generate({"prompt_token_ids": ids[-8:]}, SamplingParams(
        temperature=0.0, max_tokens=3), use_tqdm=False)  # fmt: skip
    assert out.outputs[0].token_ids == tail.outputs[0].token_ids


def test_chat_takes_a_list_of_conversations_and_the_templates_controls(llm: LLM) -> None:
    other = [{"role": "user", "content": "What is 2 + 2?"}]
    first, second = llm.chat([QUESTION, other], CHAT_GREEDY, use_tqdm=False)
    assert "Paris" in first.outputs[0].text and second.outputs[0].text
    begun = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    (cont,) = llm.chat(
        begun, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )
    assert cont.prompt is not None and cont.prompt.endswith("The capital of France is")
    assert cont.outputs[0].text.startswith(" Paris")


def test_get_tokenizer_is_a_transformers_tokenizer_of_the_same_vocabulary(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode(COUNT, add_special_tokens=False) == llm.tokenizer.encode(
        COUNT, add_special_tokens=False
    )
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text == llm.tokenizer.render_chat(QUESTION)


def test_generate_shows_progress_over_requests(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    llm.generate(["a", "b"], SamplingParams(temperature=0.0, max_tokens=1))
    assert "2/2" in capsys.readouterr().err


def test_a_bad_prompt_fails_the_call_and_leaves_no_request_behind(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_one_params_per_prompt_is_enforced(llm: LLM) -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(["a"], {"temperature": 0}, use_tqdm=False)  # type: ignore[arg-type]


def test_vllm_keywords_are_taken_or_refused_with_their_reason(embedded_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(embedded_model, trust_remote_code=True)
    with pytest.raises(ValueError, match="dtype"):
        LLM(embedded_model, dtype="int3")
    with pytest.raises(TypeError, match="swap_space"):
        LLM(embedded_model, swap_space=4)
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)  # type: ignore[call-arg]


def test_a_request_whose_sampling_fails_is_an_error_not_an_empty_answer(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(*args: object, **kwargs: object) -> list[int]:
        raise RuntimeError("probability tensor contains nan")

    monkeypatch.setattr(outputs, "sample", failing)
    with pytest.raises(RuntimeError, match="2 of 2 requests failed.*nan"):
        llm.generate(["Hello", "Bye"], SamplingParams(max_tokens=3))
    monkeypatch.undo()
    assert llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].outputs[0].text  # goes on
