"""Structured output and logit bias in the sampler: a grammar's mask confines only its own
row, the matcher follows the sampled tokens to the grammar's end, bad schemas and biases are
refused naming their parameter. On the real tokenizer (no model steps)."""

from __future__ import annotations

import json

import pytest
import torch

from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.logits import RequestLogits, adjusted
from graphguard.engine.tokens.sampling import SamplingParams, fork_seed, sample
from graphguard.engine.tokens.structured import (
    GrammarCompiler,
    InvalidParamError,
    ResponseFormat,
    ResponseFormatKind,
    check_response_format,
)

VOCAB = 49152
GREEDY = SamplingParams(temperature=0.0)
FLAG = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(embedded_model: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(embedded_model.tokenizer, VOCAB)


def test_a_mask_confines_its_own_row_and_leaves_the_others_alone() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0  # both rows' greedy token
    only_7 = torch.zeros(VOCAB, dtype=torch.bool)
    only_7[7] = True
    picked = sample(logits, [GREEDY, GREEDY], [None, None], allowed=[only_7, None])
    assert picked == [7, 5]


def test_a_mask_that_allows_nothing_raises_for_its_row() -> None:
    nothing = torch.zeros(VOCAB, dtype=torch.bool)
    with pytest.raises(ValueError, match="allows no next token"):
        sample(torch.zeros(1, VOCAB), [GREEDY], [None], allowed=[nothing])


def test_greedy_decoding_under_a_schema_writes_a_valid_document(
    compiler: GrammarCompiler, embedded_model: LoadedModel
) -> None:
    matcher = compiler.matcher(ResponseFormat.json_schema(FLAG))
    generator = torch.Generator().manual_seed(0)
    tokens: list[int] = []
    while not matcher.is_finished:  # random logits: only the mask makes this JSON
        logits = torch.randn(1, VOCAB, generator=generator)
        (token,) = sample(logits, [GREEDY], [None], allowed=[matcher.allowed_tokens()])
        assert matcher.accept(token)
        tokens.append(token)
    document = json.loads(embedded_model.tokenizer.decode(tokens))
    assert set(document) == {"ok"} and isinstance(document["ok"], bool)


def test_json_object_mode_starts_with_a_brace(
    compiler: GrammarCompiler, embedded_model: LoadedModel
) -> None:
    matcher = compiler.matcher(ResponseFormat(ResponseFormatKind.JSON_OBJECT))
    allowed = matcher.allowed_tokens().nonzero().flatten().tolist()
    texts = {embedded_model.tokenizer.token_bytes(t) for t in allowed}
    assert texts and all(text.startswith(b"{") for text in texts)


@pytest.mark.parametrize(
    "schema",
    [{"type": "tree"}, {"$ref": "#/nowhere"}, {"type": "object", "properties": {"a": 3}}],
)
def test_an_invalid_schema_is_refused_naming_response_format(
    compiler: GrammarCompiler, schema: dict[str, object]
) -> None:
    for check in (check_response_format, compiler.matcher):
        with pytest.raises(InvalidParamError) as refused:
            check(ResponseFormat.json_schema(schema))
        assert refused.value.param == "response_format"


def test_logit_bias_moves_only_its_own_tokens() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0
    params = [SamplingParams(temperature=0.0, logit_bias=((5, -100.0), (9, 50.0))), GREEDY]
    changes = [
        RequestLogits.build(p, [1, 2], VOCAB, [0], torch.device("cpu"), lambda text: [])
        for p in params
    ]
    assert sample(adjusted(logits, changes, [[], []]), params, [None, None]) == [9, 5]


@pytest.mark.parametrize(
    "bias", [((1, 100.5),), ((1, -101.0),), ((-1, 1.0),), ((1, 1.0), (1, 2.0)), ((1, "5"),)]
)
def test_a_bias_outside_openais_range_is_refused(bias: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(InvalidParamError) as refused:
        SamplingParams(logit_bias=bias).validate()
    assert refused.value.param == "logit_bias"


def test_fork_seeds_are_distinct_signed_64_bit_and_keep_choice_zero() -> None:
    seeds = [fork_seed(2**63 - 1, j) for j in range(64)]
    assert seeds[0] == 2**63 - 1 and len(set(seeds)) == 64
    assert all(-(2**63) <= s < 2**63 for s in seeds)
