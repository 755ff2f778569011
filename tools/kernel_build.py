"""Build the Triton kernels of the decode and prefill steps for a CUDA GPU on a machine without
one, and check what the build says about them (a check, not a benchmark).

    python tools/kernel_build.py              # every launch below, for sm_90 (H100, H200)
    python tools/kernel_build.py --quick      # the launches the CPU tests cannot run
    python tools/kernel_build.py --arch 90,80 # several targets (PDL needs 90 or later)

The host functions of graphguard/kernels run on CPU tensors, at the Qwen3-0.6B shape, with PDL
off and on; each distinct launch they make is built as the device would build it (the device's
loop forms, PDL's instructions, inline assembly), through Triton's compiler and ptxas, both in
the triton wheel. Nothing is launched. Triton's CPU interpreter, which the unit tests run,
compiles none of this, so a kernel that fails to build for the GPU fails here, before a GPU
session is spent on it.

For each build: registers per thread, shared memory, and local memory (spilled registers,
none expected); and for a PDL build, that the kernel waits for the one before it
(`griddepcontrol.wait`) before it lets the next one launch, with no global load before the wait
except the GEMMs' weight tiles and the few-rows GEMM's weight prefetches. Exits 1 if a build
fails or a check does not hold; the table is printed either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import driver  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphguard.kernels import (  # noqa: E402
    launch,
    triton_decode,
    triton_linear,
    triton_mlp,
    triton_norm,
    triton_prefill,
    triton_rope,
)
from graphguard.kernels.decode_plan import SPLIT_RULE, SplitRule  # noqa: E402
from graphguard.kernels.reference import HeadShape, QKNorm  # noqa: E402

# The GEMMs of few rows may read their weight before the wait: no kernel of a step writes one.
WEIGHT_READERS = ("_few_rows_kernel", "_one_row_kernel")


@dataclass
class Launch:
    """One distinct launch a host function made: the kernel and Triton's specialization of it."""

    fn: Any  # the JITFunction
    spec: dict[str, Any]
    case: str

    @property
    def name(self) -> str:
        return str(self.spec["name"]).rsplit(".", 1)[-1]

    def variant(self) -> str:
        """The constexprs that tell this launch from the kernel's others, and its launch shape."""
        names = self.fn.arg_names
        values = {
            names[key[0]]: value.get("constexpr", value) if isinstance(value, dict) else value
            for key, value in zip(
                self.spec["constant_keys"], self.spec["constant_vals"], strict=True
            )
            if len(key) == 1
        }
        shown = {k: values[k] for k in VARIANT_KEYS if values.get(k) not in (None, "")}
        options = self.spec["options"]
        text = " ".join(f"{k}={_short(v)}" for k, v in shown.items())
        return f"{text} w{options['num_warps']}s{options['num_stages']}".strip()


VARIANT_KEYS = (
    "PDL", "DIRECT", "SPLITS", "PROLOGUE", "HAS_RESIDUAL", "HAS_NORM", "WRITE_CACHE", "BLOCK_M",
    "BLOCK_N", "BLOCK", "CHUNK", "DIMS",
)  # fmt: skip


def _short(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


class _BuildOnlyDriver:
    """What Triton's launch path asks of a driver, answered for `target` and no device: the
    launch stops at the compile hook, so nothing else is asked."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return self.target.arch  # one binder cache per target

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def recording(target: GPUTarget, case: str, into: dict[str, Launch]) -> Iterator[None]:
    """Launches made inside are recorded into `into` (one per distinct specialization) and not
    run, with the kernels' PDL flag as `launch.dependent_launch` says for CPU tensors (off)
    unless a case turns it on (`pdl`)."""
    previous_hook, previous_driver = knobs.runtime.jit_cache_hook, driver._active

    def hook(*, key: Any, repr: str, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        spec = json.loads(compile["specialization_data"])
        into.setdefault(compile["specialization_data"], Launch(fn.jit_function, spec, case))
        return True  # built later, for the target: here the launch stops

    driver.set_active(_BuildOnlyDriver(target))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver._active = previous_driver  # not reset_active(): that looks for a device


@contextlib.contextmanager
def pdl(on: bool) -> Iterator[None]:
    """The kernels' launches as dependents (`on`) or plain, whatever the tensors' device."""
    previous = launch.dependent_launch
    launch.dependent_launch = lambda device: on
    try:
        yield
    finally:
        launch.dependent_launch = previous


# The Qwen3-0.6B shape: hidden 1,024, 16 query heads and 8 KV heads of 128, MLP 3,072.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 1024, 16, 8, 128, 3072
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def _cases(quick: bool) -> list[tuple[str, Callable[[], object]]]:
    """(name, host call) pairs: each call makes the launches a decode or prefill step makes."""
    heads = HeadShape(HEADS, KV_HEADS, HEAD_DIM)
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    gamma = torch.ones(HIDDEN, dtype=DTYPE)
    norm = QKNorm(torch.ones(HEAD_DIM, dtype=DTYPE), torch.ones(HEAD_DIM, dtype=DTYPE), 1e-6)
    cos = torch.ones(1, HEAD_DIM, dtype=DTYPE)
    num_blocks = 2048 // BLOCK_SIZE + 1
    cache = (
        torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE),
        torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE),
    )

    def rows(width: int, num_rows: int = 1) -> torch.Tensor:
        return torch.zeros(num_rows, width, dtype=DTYPE)

    def weight(num_out: int, num_in: int) -> torch.Tensor:
        return torch.zeros(num_out, num_in, dtype=DTYPE)

    def attention(tokens: int, rule: SplitRule = SPLIT_RULE) -> Callable[[], object]:
        table = torch.zeros(1, tokens // BLOCK_SIZE, dtype=torch.int32)
        lens = torch.full((1,), tokens, dtype=torch.int32)
        q = torch.zeros(1, HEADS, HEAD_DIM, dtype=DTYPE)
        return lambda: triton_decode.decode_attention(q, cache, table, lens, 0.1, rule)

    def o_proj(split: bool) -> Callable[[], object]:
        plan = triton_linear.plan_linear(2048, HIDDEN, split)
        return lambda: triton_linear.few_rows_linear(rows(2048), weight(HIDDEN, 2048), plan)

    def norm_qkv(residual: torch.Tensor | None) -> Callable[[], object]:
        w = weight(qkv_width, HIDDEN)
        return lambda: triton_linear.few_rows_norm_linear(rows(HIDDEN), residual, gamma, 1e-6, w)

    def rope_write() -> object:
        slots = torch.zeros(1, dtype=torch.int64)
        return triton_rope.rope_qkv_write(rows(qkv_width), cos, cos, heads, norm, cache, slots)

    def rope_pair() -> object:
        q, k = torch.zeros(4, HEADS, HEAD_DIM, dtype=DTYPE), torch.zeros(4, KV_HEADS, HEAD_DIM)
        return triton_rope.rope_pair(
            q, k.to(DTYPE), cos.expand(4, -1)[None], cos.expand(4, -1)[None], norm
        )

    fused: list[tuple[str, Callable[[], object]]] = [
        ("decode attention, 256 tokens", attention(256)),
        ("decode attention, 2k tokens", attention(2048)),
        ("decode attention, merge by 4", attention(2048, replace(SPLIT_RULE, merge_programs=4))),
        (
            "decode attention, merge by 8 x 64",
            attention(2048, replace(SPLIT_RULE, merge_programs=8, merge_chunk=64)),
        ),
        (
            "q/k/v, one row",
            lambda: triton_linear.one_row_linear(rows(HIDDEN), weight(4096, HIDDEN)),
        ),
        ("down, one row", lambda: triton_linear.one_row_linear(rows(MLP), weight(HIDDEN, MLP))),
        ("q/k/v after add + norm", norm_qkv(rows(HIDDEN))),
        ("q/k/v after norm", norm_qkv(None)),
        (
            "down after SiLU",
            lambda: triton_linear.few_rows_silu_linear(rows(2 * MLP), weight(HIDDEN, MLP)),
        ),
    ]
    if quick:
        return fused
    return [
        *fused,
        ("o_proj", o_proj(split=False)),
        ("o_proj, split K", o_proj(split=True)),
        (
            "add + RMSNorm",
            lambda: triton_norm.add_rms_norm(rows(HIDDEN), rows(HIDDEN), gamma, 1e-6),
        ),
        ("q/k norm, RoPE, KV write", rope_write),
        ("SiLU and multiply", lambda: triton_mlp.silu_mul(rows(2 * MLP))),
        ("RoPE pair", rope_pair),
        ("prefill attention, both tile sets", lambda: triton_prefill.compile_tiles(HEADS, cache)),
    ]


def record(target: GPUTarget, quick: bool) -> list[Launch]:
    """Every distinct launch of the cases, with PDL off and on (on only for targets that have
    it; the prefill kernel takes no PDL flag)."""
    launches: dict[str, Launch] = {}
    for on in (False, True) if target.arch >= 90 else (False,):
        for name, call in _cases(quick):
            with pdl(on), recording(target, name, launches):
                call()
    return list(launches.values())


@dataclass
class Build:
    launch: Launch
    arch: int
    seconds: float = 0.0
    error: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    prefetches: int = 0


def compile_launch(item: Launch, target: GPUTarget) -> Any:
    """Triton's compiled kernel of one launch for `target` (through ptxas)."""
    spec = item.spec
    constants = {
        tuple(key): triton.language.constexpr(value["constexpr"])
        if isinstance(value, dict) and "constexpr" in value
        else value
        for key, value in zip(spec["constant_keys"], spec["constant_vals"], strict=True)
    }
    attrs = {
        tuple(key): value for key, value in zip(spec["attrs_keys"], spec["attrs_vals"], strict=True)
    }
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    source = ASTSource(item.fn, spec["signature"], constants, attrs)
    return triton.compile(source, target=target, options=options)


def build(item: Launch, target: GPUTarget) -> Build:
    """Build one launch for `target` and check it."""
    result = Build(item, target.arch)
    start = time.perf_counter()
    try:
        compiled = compile_launch(item, target)
    except Exception as error:  # noqa: BLE001 - reported in the table, with the kernel's name
        result.error = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
        return result
    finally:
        result.seconds = time.perf_counter() - start
    result.usage = resource_usage(compiled.asm["cubin"])
    result.usage["SHARED"] = compiled.metadata.shared  # static and dynamic
    if result.usage.get("LOCAL", 0):
        result.problems.append(f"spills {result.usage['LOCAL']} bytes to local memory")
    if "C7515" in ptxas_report(compiled.asm["ptx"], target.arch):
        result.problems.append("ptxas serializes its asynchronous matrix instructions (C7515)")
    pdl_build = bool(item.spec["options"].get("launch_pdl"))
    if pdl_build:
        result.problems += pdl_problems(compiled.asm["ptx"], item.name)
    result.prefetches = compiled.asm["ptx"].count("prefetch.global.L2")
    if pdl_build and item.name == "_few_rows_kernel" and not result.prefetches:
        result.problems.append("asks L2 for none of its weight before the wait")
    return result


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, SHARED, LOCAL and STACK of the cubin's kernel, as cuobjdump reports them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", file.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return {key: int(value) for key, value in re.findall(r"\b([A-Z]+):(\d+)", text)}


def ptxas_report(ptx: str, arch: int) -> str:
    """ptxas's verbose report on the PTX, as Triton's build runs it (which keeps no report)."""
    arch_name = sm_arch_from_capability(arch)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        command = [get_ptxas(arch).path, f"-arch={arch_name}", "-v", str(path), "-o", f"{path}.o"]
        return subprocess.run(command, capture_output=True, text=True, check=True).stderr


def pdl_problems(ptx: str, kernel: str) -> list[str]:
    """What breaks PDL's rule in a dependent kernel's PTX (graphguard/kernels/launch.py): it
    must wait for the kernel before it, then let the next one launch, before any global load but
    a weight's."""
    lines = [line.strip() for line in ptx.splitlines()]
    release = next((i for i, s in enumerate(lines) if s.startswith("griddepcontrol.launch")), -1)
    wait = next((i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait")), -1)
    if wait < 0 or release < 0:
        return ["no griddepcontrol.launch_dependents / wait"]
    problems = []
    if release < wait:
        problems.append("lets the next kernel launch before it waits")
    early = [s for s in lines[:wait] if s.startswith(("ld.global", "st.global", "atom."))]
    if early and kernel not in WEIGHT_READERS:
        problems.append(f"{len(early)} global accesses before the wait")
    if kernel in WEIGHT_READERS and any(s.startswith(("st.global", "atom.")) for s in early):
        problems.append("stores before the wait")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90", help="compute capabilities x 10: 90 or 90,80")
    parser.add_argument("--quick", action="store_true", help="attention and fused GEMMs only")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("the interpreter's kernels are not built: run without TRITON_INTERPRET=1")
    builds = []
    for arch in (int(text) for text in args.arch.split(",")):
        target = GPUTarget("cuda", arch, 32)
        launches = record(target, args.quick)
        print(f"sm_{arch}: {len(launches)} launches to build (triton {triton.__version__})")
        builds += [build(item, target) for item in launches]
    failed = 0
    header = (
        f"{'sm':<3} {'kernel':<17} {'case':<28} {'variant':<52} {'reg':>4} {'smem':>6} {'pf':>4}"
    )
    header += " note"
    print(header)
    print("-" * len(header))
    for result in builds:
        item, usage = result.launch, result.usage
        note = result.error or "; ".join(result.problems) or "ok"
        failed += note != "ok"
        print(
            f"{result.arch:<3} {item.name[:17]:<17} {item.case[:28]:<28} {item.variant()[:52]:<52} "
            f"{usage.get('REG', 0):>4} {usage.get('SHARED', 0):>6} {result.prefetches:>4} {note}"
        )
    seconds = sum(result.seconds for result in builds)
    print(f"{len(builds) - failed} of {len(builds)} built and checked in {seconds:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
