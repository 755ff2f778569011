"""The prefill attention kernel compiled for Hopper (sm_90) on the CPU: Triton's own compiler and
its bundled ptxas need no GPU, so CI checks what only the device would otherwise show. For the
model families' head shapes, with either tile set, the kernel compiles, ptxas keeps its matrix
instructions asynchronous (no warning C7515, which serializes them for the whole kernel) and
spills nothing.

NOTE: the compiles run in a fresh interpreter: once Triton's CPU interpreter has run a kernel
in a process (the other kernel tests), it has patched triton.language there, and compiling
for a device in that process fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]
INT_POINTERS = ("tables_ptr", "query_start_ptr", "seq_lens_ptr")
# (dtype, group, head_dim): Qwen3-0.6B, SmolLM2-135M, Llama-3.1-8B, GQA 8, multi-head
SHAPES = [("bf16", 2, 128), ("bf16", 3, 64), ("fp16", 4, 128), ("bf16", 8, 128), ("bf16", 1, 64)]


def ptxas_log(small: bool, dtype: str, group: int, head_dim: int) -> str:
    """ptxas's verbose report on the kernel as the launcher would compile it for an H200, with
    the tiles of a small grid or the usual ones. Run in a process without the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from graphguard.kernels import triton_prefill as module

    fn = module._prefill_kernel
    config = (module.SMALL_CONFIGS if small else module.CONFIGS)[head_dim]
    block_m = max(config.block_m, triton.next_power_of_2(group))
    constants = dict(
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, NUM_KV_HEADS=8,
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
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        command = [get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", f"{ptx}.cubin"]
        return subprocess.run(command, capture_output=True, text=True, check=True).stderr


@pytest.fixture(scope="module")
def logs() -> dict[str, str]:
    """ptxas's report for each (tiles, shape), keyed as the tests' ids."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "tests.unit.kernels.test_triton_prefill_hopper"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def key(small: bool, shape: tuple[str, int, int]) -> str:
    return f"{'small' if small else 'usual'}-{shape[0]}-g{shape[1]}-d{shape[2]}"


@pytest.mark.parametrize("small", [False, True], ids=["tiles", "small_tiles"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-g{s[1]}-d{s[2]}")
def test_compiles_for_hopper_with_async_matrix_instructions_and_no_spills(logs, small, shape):
    log = logs[key(small, shape)]
    assert "C7515" not in log, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log


if __name__ == "__main__":
    reports = {key(s, shape): ptxas_log(s, *shape) for s in (False, True) for shape in SHAPES}
    print(json.dumps(reports))
