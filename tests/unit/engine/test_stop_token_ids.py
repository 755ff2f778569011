"""`SamplingParams.stop_token_ids`: a request ends when it generates one of them, as at an end
of sequence: finish "stop", the token among its output ids, its text left out."""

from __future__ import annotations

import pytest

from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams
from tests.unit.engine.fixtures_engine import (
    make_engine,
    one_torch_thread,  # noqa: F401 (fixture)
    run_to_completion,
    token_ids_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

COUNTING = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8,"


def _generate(loaded: LoadedModel, **params: object) -> tuple[list[int], str, str | None]:
    engine = make_engine(loaded)
    prompt = loaded.tokenizer.encode(COUNTING)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, **params))
    outputs = run_to_completion(engine)["r"]
    return token_ids_of(outputs), outputs[-1].text, outputs[-1].finish_reason


def test_a_stop_token_id_ends_the_request_and_its_text_is_left_out(
    embedded_model: LoadedModel,
) -> None:
    (comma,) = embedded_model.tokenizer.encode(",", add_special_tokens=False)
    plain_ids, plain_text, plain_reason = _generate(embedded_model)
    assert plain_reason == "length" and comma in plain_ids
    ids, text, reason = _generate(embedded_model, stop_token_ids=(comma,))
    assert reason == "stop"
    assert ids == plain_ids[: plain_ids.index(comma) + 1]  # the token itself is generated
    assert text == plain_text.split(",")[0]


def test_ignore_eos_does_not_ignore_stop_token_ids(embedded_model: LoadedModel) -> None:
    (comma,) = embedded_model.tokenizer.encode(",", add_special_tokens=False)
    ids, _, reason = _generate(embedded_model, stop_token_ids=(comma,), ignore_eos=True)
    assert reason == "stop" and ids[-1] == comma


@pytest.mark.parametrize("stop_token_ids", [(-1,), (True,), (2.0,)])
def test_stop_token_ids_must_be_token_ids(stop_token_ids: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=stop_token_ids).validate()  # type: ignore[arg-type]
