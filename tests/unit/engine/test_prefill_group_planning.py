"""Prefill groups (graphguard/engine/models/attention.py `plan_prefill_groups`, host work on every
packed prefill step) are planned by the model runner only for a kernel set whose prefill
attention reads them: the Triton set's kernel attends every sequence in one launch and gets
none (its `needs_prefill_groups` is False). The reference set's attention plans them itself
when they are missing, so a set that needs none loses nothing; these tests turn the flag off on
the reference set to watch the model runner without a GPU."""

from __future__ import annotations

import pytest

from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams
from graphguard.kernels.reference import TorchKernels
from tests.unit.engine.fixtures_engine import make_engine, run_to_completion, token_ids_of
from tests.unit.engine.test_background_capture import tiny  # noqa: F401

# a fresh prompt, a prompt whose 16-token chunks continue over its cached first ones, a short one
PROMPTS = [[5, 6, 7], list(range(20, 45)), list(range(50, 53))]


@pytest.fixture
def seen_groups(monkeypatch: pytest.MonkeyPatch) -> list:
    """The prefill groups of the metadata each prefill attention call of the reference set got."""
    seen: list = []
    attend = TorchKernels.prefill_attention

    def recording(self, q, k, v, kv_cache, meta, scale):
        seen.append(meta.prefill_groups)
        return attend(self, q, k, v, kv_cache, meta, scale)

    monkeypatch.setattr(TorchKernels, "prefill_attention", recording)
    return seen


def generate(loaded: LoadedModel) -> dict[str, list[int]]:
    engine = make_engine(loaded, max_num_batched_tokens=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(str(index), prompt, params)
        return {rid: token_ids_of(outs) for rid, outs in run_to_completion(engine).items()}
    finally:
        engine.shutdown()


def test_groups_are_planned_only_for_a_set_that_reads_them(
    tiny: LoadedModel,  # noqa: F811
    seen_groups: list,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    planned = generate(tiny)
    assert seen_groups and all(groups is not None for groups in seen_groups)
    seen_groups.clear()
    monkeypatch.setattr(TorchKernels, "needs_prefill_groups", False)
    assert generate(tiny) == planned
    assert seen_groups and all(groups is None for groups in seen_groups)
