"""The top-level package: the runtime eagerly, the offline API lazily, the documented example."""

from __future__ import annotations

import subprocess
import sys

import pytest

import graphguard as gg
from graphguard.engine.models.loader import LoadedModel
from tests.unit.engine.fixtures_engine import one_torch_thread  # noqa: F401 (fixture)


def test_import_graphguard_does_not_import_the_engine():
    code = (
        "import sys, graphguard; print(any(m.startswith('graphguard.engine') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_offline_api_is_exported_from_the_package():
    from graphguard.engine.llm import LLM, CompletionOutput
    from graphguard.engine.tokens.sampling import SamplingParams

    assert (gg.LLM, gg.SamplingParams, gg.CompletionOutput) == (
        LLM,
        SamplingParams,
        CompletionOutput,
    )
    assert {"LLM", "SamplingParams", "CompletionOutput"} <= set(gg.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        gg.Nothing  # noqa: B018


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_the_documented_offline_example(embedded_model: LoadedModel):
    # docs/serving.md, "Offline use": the same calls, on the session's embedded model
    llm = gg.LLM(embedded_model, max_model_len=256)
    params = gg.SamplingParams(temperature=0.0, max_tokens=8)
    (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    assert out.outputs[0].text.startswith(" Paris.")
    (reply,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    assert "Paris" in reply.outputs[0].text
    llm.engine.shutdown()
