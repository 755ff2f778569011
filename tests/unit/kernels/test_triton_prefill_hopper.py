"""The prefill attention kernel compiled for Hopper (sm_90) on the CPU: Triton's own compiler and
its bundled ptxas need no GPU, so CI checks what only the device would otherwise show. For the
model families' head shapes the kernel compiles, ptxas keeps its matrix instructions
asynchronous (no warning C7515, which serializes them for the whole kernel) and spills nothing.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import graphguard.kernels  # noqa: E402

SOURCE = Path(graphguard.kernels.__file__).with_name("triton_prefill.py")
INT_POINTERS = ("tables_ptr", "query_start_ptr", "seq_lens_ptr")


@pytest.fixture(scope="module")
def device_module(tmp_path_factory):
    """A copy of the kernel's module built for the device, not the interpreter (the other
    kernel tests may have imported it interpreted)."""
    mp = pytest.MonkeyPatch()
    mp.delenv("TRITON_INTERPRET", raising=False)
    try:
        spec = importlib.util.spec_from_file_location("triton_prefill_for_device", SOURCE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        mp.undo()
    if module._INTERPRETED:
        pytest.skip("Triton builds interpreted kernels in this process")
    return module


def ptxas_log(module, ptx: Path, dtype: str, group: int, head_dim: int, num_kv_heads: int) -> str:
    """ptxas's verbose report on the kernel as the launcher would compile it for an H200 (its
    PTX written to `ptx`)."""
    fn, config = module._prefill_kernel, module.pick_config(head_dim)
    block_m = max(config.block_m, triton.next_power_of_2(group))
    constants = dict(
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_N=config.block_n, SEARCH_STEPS=1, KEY_TILES=1,
        DYNAMIC_LOOP=True, PRECISION="tf32",
    )  # fmt: skip
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in INT_POINTERS else f"*{dtype}"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    aligned = [n for n in fn.arg_names if n.endswith("_ptr") or n == "stride_q"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    source = ASTSource(fn, signature, constants, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx.write_text(kernel.asm["ptx"])
    command = [get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx) + ".cubin"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stderr


# (dtype, group, head_dim, KV heads): Qwen3-0.6B, SmolLM2-135M, Llama-3.1-8B, GQA 8, MHA
SHAPES = [("bf16", 2, 128, 8), ("bf16", 3, 64, 3), ("fp16", 4, 128, 8), ("bf16", 8, 128, 1),
          ("bf16", 1, 64, 8)]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-g{s[1]}-d{s[2]}")
def test_compiles_for_hopper_with_async_matrix_instructions_and_no_spills(
    device_module, shape, tmp_path
):
    log = ptxas_log(device_module, tmp_path / "kernel.ptx", *shape)
    assert "C7515" not in log, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log
