"""4-bit GEMMs on the CPU for 4-bit weights (graphguard/kernels/q4.py): the packing reads a
Q4_1 checkpoint's levels back exactly and refuses other weights, the matmul agrees with the
float32 GEMM, and the engine with `kernels="q4"` gives the documented answers of the embedded
model in float32."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.config import EngineConfig
from graphguard.engine.llm import LLM
from graphguard.engine.loader import load_model
from graphguard.engine.sampling import SamplingParams
from graphguard.kernels import select_kernels
from graphguard.kernels.q4 import GROUP, Q4Kernels, pack_q4, q4_matmul


def q4_1_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight as a Q4_1 checkpoint dequantizes: per block of 32, d * q + m with q in
    0..15 (the block's minimum at q = 0 and its maximum at q = 15), d and m float16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols // GROUP, GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(rows, cols // GROUP, 1, generator=g) * 0.02).half().float()
    m = (-torch.rand(rows, cols // GROUP, 1, generator=g) * 0.1).half().float()
    return (q * d + m).reshape(rows, cols)


@pytest.mark.parametrize("num_rows", [1, 7, 33])
def test_the_4bit_gemm_matches_the_float32_one_within_bfloat16(num_rows: int) -> None:
    weight = q4_1_weight(96, 128)
    packed = pack_q4(weight)
    assert packed is not None
    x = torch.randn(num_rows, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = x.float() @ weight.T
    got = q4_matmul(x, packed).float()
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 0.01 * scale  # bfloat16 output and scales


def test_weights_that_are_not_4bit_blocks_are_refused() -> None:
    assert pack_q4(q4_1_weight(64, 128)) is not None
    assert pack_q4(torch.randn(64, 128)) is None  # never 4-bit
    assert pack_q4(q4_1_weight(64, 128).bfloat16()) is None  # its rounding lost the levels
    assert pack_q4(q4_1_weight(64, 96)[:, :80]) is None  # not in blocks of 32


def test_prepare_packs_a_float32_model_and_turns_it_to_bfloat16() -> None:
    loaded = load_model(None, dtype="float32", device="cpu", progress=False)
    kernels = Q4Kernels()
    kernels.prepare(loaded.model)
    # 30 layers x (q/k/v, o, gate/up, down): the embedded model's Q4_1 weights, all of them
    assert kernels.num_packed == 4 * loaded.config.num_layers
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    layer = loaded.model.layers[0].self_attn
    assert layer.qkv_weight is not None and layer.qkv_weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        Q4Kernels().prepare(loaded.model)  # bfloat16 now: its levels are gone


def test_the_embedded_model_gives_its_documented_answers_with_4bit_gemms() -> None:
    short = SamplingParams(temperature=0.0, max_tokens=24)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answers = {}
    for kernels in ("torch", "q4"):
        loaded = load_model(None, dtype="float32", device="cpu", progress=False)
        llm = LLM(loaded, kernels=kernels, max_model_len=256, max_num_seqs=2)
        try:
            assert llm.engine.kernels.name == ("torch-q4" if kernels == "q4" else "torch")
            chat = llm.chat(question, short).text
            count = llm.generate(["1, 2, 3, 4,"], short, use_tqdm=False)[0].text
            answers[kernels] = (chat, count)
            if kernels == "q4":
                with pytest.raises(RuntimeError, match="q4"):
                    llm.engine.reload_weights(dict(llm.engine.model.state_dict()))
        finally:
            llm.engine.shutdown()
    assert answers["q4"] == answers["torch"]
    assert answers["q4"][0] == "The capital of France is Paris."


def test_q4_is_asked_for_on_a_cpu_in_bfloat16_only() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(kernels="q4", dtype="float32")
    with pytest.raises(ValueError, match="CPU"):
        select_kernels("q4", torch.device("cuda", 0), torch.bfloat16)
    assert select_kernels("q4", torch.device("cpu"), torch.bfloat16).name == "torch-q4"
    assert select_kernels("auto", torch.device("cpu"), torch.bfloat16).name == "torch"
