"""The step message between the engine process and the server survives the pipe whole: rows,
stats, failures, every field of every row."""

from __future__ import annotations

from graphguard.engine.outputs import RequestOutput
from graphguard.engine.tokens.sampling import TokenLogprob
from graphguard.server import engine_messages as m


def _output(request_id: str, finished: bool, with_logprobs: bool) -> RequestOutput:
    logprobs = [TokenLogprob(7, -0.25, ((7, -0.25), (9, -1.5)))] if with_logprobs else None
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[7, 8],
        delta_text=" é\\n",
        text="ignored: the text crosses as deltas",
        finished=finished,
        finish_reason="stop" if finished else None,
        num_prompt_tokens=11,
        num_output_tokens=5,
        logprobs=logprobs,
        prompt_logprobs=[None, TokenLogprob(3, -2.0, ())] if with_logprobs else None,
        error="boom" if finished and with_logprobs else None,
    )


def test_a_step_message_decodes_to_the_rows_and_stats_it_was_made_of() -> None:
    outputs = [_output(f"r{i}", finished=i % 2 == 1, with_logprobs=i % 3 == 0) for i in range(6)]
    rows = [m.output_row(output) for output in outputs]
    message = m.StepOutputs(rows, {"num_running": 6, "prefix_cache": {"hits": 3}}, is_step=True)
    failed = m.StepOutputs([], {"num_running": 0}, True, failed=["r9"], error="step failed")

    for sent in (message, failed):
        received = m.decode(m.encode(sent))
        assert received == sent
        assert all(type(row) is m.OutputRow for row in received.rows)

    row = m.decode(m.encode(message)).rows[3]
    assert m.request_output(row, "before") == RequestOutput(
        **{**outputs[3].__dict__, "text": "before" + outputs[3].delta_text}
    )
