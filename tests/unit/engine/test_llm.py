"""The offline API on the real embedded model."""

from __future__ import annotations

import pytest

from graphguard.engine.llm import LLM, CompletionOutput
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams
from tests.unit.engine.fixtures_engine import one_torch_thread  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(embedded_model: LoadedModel) -> LLM:
    return LLM(embedded_model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def answer(llm: LLM) -> CompletionOutput:
    return llm.chat(QUESTION, CHAT_GREEDY)


def test_chat_answers_the_capital_of_france(answer: CompletionOutput) -> None:
    assert "Paris" in answer.text


def test_eos_ends_the_answer_with_stop(answer: CompletionOutput, llm: LLM) -> None:
    assert answer.finish_reason == "stop"
    assert answer.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert len(answer.token_ids) < CHAT_GREEDY.max_tokens


def test_ignore_eos_generates_past_eos(answer: CompletionOutput, llm: LLM) -> None:
    num_tokens = len(answer.token_ids) + 1
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    longer = llm.chat(QUESTION, params)
    assert (longer.finish_reason, len(longer.token_ids)) == ("length", num_tokens)
    assert longer.token_ids[: len(answer.token_ids)] == answer.token_ids


def test_generate_returns_results_in_prompt_order(llm: LLM) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (5, 1)]
    results = llm.generate(["1, 2, 3, 4,", "The capital of France is"], params, use_tqdm=False)
    assert [r.text for r in results] == [" 5, 6", " Paris"]


def test_logprobs_follow_each_token_and_only_when_asked(llm: LLM) -> None:
    prompts = ["1, 2, 3, 4,", "The capital of France is"]
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=1), SamplingParams()]
    with_logprobs, without = llm.generate(prompts, params, use_tqdm=False)
    assert without.logprobs is None and with_logprobs.logprobs is not None
    assert [lp.token_id for lp in with_logprobs.logprobs] == with_logprobs.token_ids
    for lp in with_logprobs.logprobs:  # greedy: each chosen token is the most likely one
        assert lp.top[0][0] == lp.token_id and lp.logprob <= 0.0


def test_prompt_logprobs_score_every_prompt_token_after_the_first(llm: LLM) -> None:
    prompt = "1, 2, 3, 4, 5"
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    result = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = llm.tokenizer.encode(prompt)
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(ids)
    assert result.prompt_logprobs[0] is None
    scored = result.prompt_logprobs[1:]
    assert [lp.token_id for lp in scored if lp is not None] == ids[1:]
    # A counting prompt is easy to predict: its last token is the model's first choice.
    last = scored[-1]
    assert last is not None and last.top[0][0] == ids[-1] and len(last.top) == 2
    assert result.logprobs is None


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm: LLM) -> None:
    prompt = "The capital of France is Paris"
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)
    scored, generated = llm.generate(
        [prompt, prompt], [score, SamplingParams(temperature=0.0, max_tokens=2)], use_tqdm=False
    )
    assert scored.token_ids == [] and scored.text == "" and scored.finish_reason == "length"
    assert scored.prompt_logprobs is not None
    assert len(scored.prompt_logprobs) == len(llm.tokenizer.encode(prompt))
    assert generated.text  # its neighbour in the batch is unaffected
    assert llm.engine.kv.num_used_blocks == 0


def test_generate_shows_progress_over_requests(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    llm.generate(["a", "b"], SamplingParams(temperature=0.0, max_tokens=1))
    assert "2/2" in capsys.readouterr().err


def test_generate_accepts_a_single_prompt_string(llm: LLM) -> None:
    results = llm.generate("The capital of France is", SamplingParams(max_tokens=1), False)
    assert len(results) == 1 and results[0].num_prompt_tokens == 5


def test_a_bad_prompt_fails_the_call_and_leaves_no_request_behind(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_one_params_per_prompt_is_enforced(llm: LLM) -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
