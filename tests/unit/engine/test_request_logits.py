"""A request's changes to its logits (graphguard/engine/tokens/logits.py): bias, allowed tokens,
bad words, min_tokens, and the presence, frequency and repetition penalties, as vLLM applies
them; and min_p in the sampler."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.tokens.limits import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from graphguard.engine.tokens.logits import RequestLogits, adjusted
from graphguard.engine.tokens.sampling import SamplingParams, make_generator, sample
from graphguard.engine.tokens.structured import InvalidParamError

CPU = torch.device("cpu")
EOS = (0,)
WORDS = {"bad": [7], " bad": [8], "two words": [5, 6], " two words": [9, 5, 6]}


def encode(text: str) -> list[int]:
    return WORDS[text]


def changes(params: SamplingParams, prompt: tuple[int, ...] = (3,), vocab: int = 10):
    return RequestLogits.build(params, prompt, vocab, EOS, CPU, encode)


def pick(logits: torch.Tensor, params: SamplingParams, outputs: list[int], **kw) -> int:
    """The greedy token of one row after its request's changes."""
    made = changes(params, **kw)
    return sample(adjusted(logits, [made], [outputs]), [params], [None])[0]


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, **fields)


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values])


def test_a_request_without_changes_builds_none():
    assert changes(SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1)) is None


def test_frequency_penalty_lowers_a_logit_per_occurrence():
    # Token 1 leads token 2 by 3.0; generated twice, a 2.0 frequency penalty costs it 4.0.
    logits = row(0.0, 5.0, 2.0, 0.0)
    assert pick(logits, greedy(frequency_penalty=2.0), [1], vocab=4) == 1
    assert pick(logits, greedy(frequency_penalty=2.0), [1, 1], vocab=4) == 2


def test_presence_penalty_lowers_a_generated_token_once():
    logits = row(0.0, 5.0, 2.0, 0.0)
    assert pick(logits, greedy(presence_penalty=2.5), [1, 1, 1], vocab=4) == 1
    assert pick(logits, greedy(presence_penalty=-2.0), [3], vocab=4) == 1
    assert pick(logits, greedy(presence_penalty=-2.0, frequency_penalty=-2.0), [2], vocab=4) == 2


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = row(0.0, 4.0, 3.0, -1.0, -2.0)
    params = greedy(repetition_penalty=2.0)
    changed = adjusted(logits, [changes(params, prompt=(3,), vocab=5)], [[1, 4]])
    assert changed.tolist() == [[0.0, 2.0, 3.0, -2.0, -4.0]]  # the prompt's token 3 too
    assert logits[0, 1] == 4.0  # the model's logits are not changed


def test_counts_grow_with_the_new_tokens_of_each_step():
    params = greedy(frequency_penalty=1.0)
    made = changes(params, vocab=4)
    logits = row(0.0, 5.0, 4.5, 0.0)
    outputs: list[int] = []
    picked = []
    for _ in range(3):
        token = sample(adjusted(logits, [made], [outputs]), [params], [None])[0]
        outputs.append(token)
        picked.append(token)
    assert picked == [1, 2, 1]  # 5 vs 4.5, then 4 vs 4.5, then 4 vs 3.5


def test_logit_bias_allowed_tokens_and_bad_words():
    logits = row(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)
    assert pick(logits, greedy(logit_bias={2: 100.0}), []) == 2
    assert pick(logits, greedy(allowed_token_ids=[1, 3]), []) == 3
    assert pick(logits, greedy(bad_words=["bad"]), []) == 9  # 7 and 8 banned, 9 is best
    assert pick(logits, greedy(bad_words=["bad"], allowed_token_ids=[7, 8, 6]), []) == 6


def test_a_bad_word_of_several_tokens_is_banned_only_after_its_prefix():
    logits = row(0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 5.0, 0.0, 0.0, 0.0)
    params = greedy(bad_words=["two words"])
    assert pick(logits, params, [1]) == 6
    assert pick(logits, params, [1, 5]) == 5  # "two" was generated: "words" may not follow


def test_min_tokens_bans_the_end_until_that_many_are_out():
    logits = row(9.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # 0 is end-of-sequence
    params = greedy(min_tokens=2, stop_token_ids=[2])
    assert pick(logits, params, []) == 1  # neither 0 nor 2 yet
    assert pick(logits, params, [1]) == 1
    assert pick(logits, params, [1, 1]) == 0


def test_min_p_keeps_only_tokens_within_its_share_of_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, min_p=0.5)  # keeps 0.5 and 0.3
    generator = make_generator(0, CPU)
    drawn = {sample(logits, [params], [generator])[0] for _ in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize("penalty", [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
def test_the_strongest_repetition_penalties_keep_every_logit_finite(penalty):
    params = SamplingParams(temperature=1.0, repetition_penalty=penalty)
    params.validate()
    changes = RequestLogits.build(params, [0, 1], 4, [3], CPU, lambda text: [])
    logits = torch.tensor([[3.0e4, -3.0e4, 1.0, 0.0]])  # beyond any model's
    changed = adjusted(logits, [changes], [[]])
    assert torch.isfinite(changed).all() and changed[0, 0] != logits[0, 0]
    assert sample(changed, [params], [make_generator(0, CPU)])[0] in range(4)


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # seen logits made infinite
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"stop": ["x"] * 1025}, "stop"),
        ({"stop": ["x" * 70_000]}, "stop has 70000 characters"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ],
)
def test_each_new_field_is_checked_and_named(fields, name):
    with pytest.raises(InvalidParamError, match=name) as refused:
        SamplingParams(**fields).validate()
    assert refused.value.param == name.split(" ")[0]  # the field a server's 400 names


def test_vllm_style_arguments_are_kept_as_tuples():
    params = SamplingParams(stop="###", stop_token_ids=[3], bad_words=["x"], logit_bias={5: 1.5})
    assert params.stop == ("###",) and params.stop_token_ids == (3,)
    assert params.bad_words == ("x",) and params.logit_bias == ((5, 1.5),)
    hash(params)
