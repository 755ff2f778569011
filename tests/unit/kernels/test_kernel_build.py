"""tools/kernel_build.py: the Triton kernels of the decode and prefill steps, as their host
functions launch them, build for Hopper and Ampere on the CPU (Triton's compiler and the
wheel's ptxas need no GPU). The interpreter the other kernel tests run compiles none of the
device's code: its loop forms, PDL's instructions, the weight prefetch's inline assembly.

NOTE: the builds run in a fresh interpreter, as in test_triton_prefill_hopper.py: Triton's CPU
interpreter, once it has run a kernel in a process, leaves triton.language patched there.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]
STEP_KERNELS = {
    "_partial_kernel", "_merge_kernel", "_few_rows_kernel", "_one_row_kernel", "_rms_norm_kernel",
    "_rope_kernel", "_silu_mul_kernel", "_rope_pair_kernel",
}  # fmt: skip


def load_tool():
    spec = importlib.util.spec_from_file_location("kernel_build", ROOT / "tools/kernel_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kernel_build", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    """The tool's table for sm_90 and sm_80, a dict per build; the run must succeed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "tools/kernel_build.py", "--arch", "90,80"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    table = []
    for line in done.stdout.splitlines():
        fields = line.split()
        if fields and fields[0] in ("90", "80"):
            table.append({
                "arch": fields[0], "kernel": fields[1], "line": line,
                "pdl": "PDL=1" in line, "prefetches": int(fields[-2]), "note": fields[-1],
            })  # fmt: skip
    return table


def test_every_kernel_of_the_step_builds_for_hopper_and_ampere_without_problems(rows):
    for arch in ("90", "80"):
        built = {row["kernel"] for row in rows if row["arch"] == arch}
        assert STEP_KERNELS | {"_prefill_kernel"} <= built, (arch, built)
    assert all(row["note"] == "ok" for row in rows), [r["line"] for r in rows if r["note"] != "ok"]


def test_hopper_builds_each_step_kernel_as_a_dependent_launch_and_ampere_does_not(rows):
    dependent = {row["kernel"] for row in rows if row["arch"] == "90" and row["pdl"]}
    assert dependent == STEP_KERNELS
    assert not any(row["pdl"] for row in rows if row["arch"] == "80")


def test_the_few_rows_gemm_prefetches_its_weight_only_as_a_dependent(rows):
    gemms = [row for row in rows if row["kernel"] == "_few_rows_kernel"]
    assert gemms and all((row["prefetches"] > 0) == row["pdl"] for row in gemms), gemms


PTX = """
griddepcontrol.wait; // dummy %r1
griddepcontrol.launch_dependents; // dummy %r2
ld.global.b32 %r3, [%rd1];
"""


def test_the_pdl_check_flags_what_a_dependent_kernel_must_not_do():
    tool = load_tool()
    assert tool.pdl_problems(PTX, "_merge_kernel") == []
    early_load = "ld.global.b32 %r0, [%rd0];\n" + PTX
    assert tool.pdl_problems(early_load, "_merge_kernel") == ["1 global accesses before the wait"]
    # the GEMMs may load their weight before the wait, never store
    assert tool.pdl_problems(early_load, "_few_rows_kernel") == []
    assert tool.pdl_problems(early_load, "_one_row_kernel") == []
    early_store = "st.global.b32 [%rd0], %r0;\n" + PTX
    assert tool.pdl_problems(early_store, "_few_rows_kernel") == ["stores before the wait"]
    swapped = PTX.replace("launch_dependents", "TMP").replace("wait", "launch_dependents")
    swapped = swapped.replace("TMP", "wait")
    assert tool.pdl_problems(swapped, "_rope_kernel") == [
        "lets the next kernel launch before it waits"
    ]
    assert tool.pdl_problems("ld.global.b32 %r3, [%rd1];", "_rope_kernel") == [
        "no griddepcontrol.launch_dependents / wait"
    ]
