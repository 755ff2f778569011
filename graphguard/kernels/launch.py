"""Programmatic dependent launch (PDL): on Hopper and later, a kernel launched as a dependent
starts while the kernel before it on its stream is still running, its programs resident and
waiting, and goes on once that kernel has finished and its writes are visible.

Each of the decode step's Triton kernels takes a `PDL` flag: with it, a program first waits
for the previous kernel (`griddepcontrol.wait`), then lets the next one launch
(`griddepcontrol.launch_dependents`), before it reads anything a kernel of the step writes, or
writes anything, so every such load and store is ordered as in a plain launch: only the launch,
the program's start and (in the few-rows GEMM) its weight overlap the kernel before it: the GEMM
asks L2 for its whole share of the weight (`prefetch_l2`) and loads its first tile before the
wait, so the weight's round trips to memory are spent while the kernel before it runs. A graph
captures the dependency as a programmatic edge, so replays keep it.

NOTE: a program lets the next kernel launch only after its own wait, so at most two kernels of
a chain are resident at once: the one running and the next, waiting. Programs that let the next
launch before they wait can start the whole chain of dependents, kernel after kernel, each
holding its registers and shared memory on the SMs while it waits for kernels two or more back.
That order decoded one stream at 30k at 317 tok/s against 401 plainly on an H100 (run 93).

NOTE: what a program reads before its wait must not be written by any kernel of the step: a
weight qualifies; a block table, a sequence length or the K/V cache do not.

NOTE: every program waits, early exits included, before it does anything else: a kernel none
of whose programs waited could finish before the kernel it depends on, and the kernel after it
would then wait on the wrong one.

On by default on Hopper and later: in this order an H200 replayed the 512-token step in 0.92x
the plain launches' time and decoded one stream at 30k at 504 tok/s against 474 (run 94,
docs/gpu-validation.md). GRAPHGUARD_PDL=0 turns it off. Never on older GPUs or in Triton's CPU
interpreter, where the flag is a constant False and the instructions are never compiled.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_ENV = "GRAPHGUARD_PDL"
_BY_DEVICE: dict[int, bool] = {}
# Triton's CPU interpreter has no such instructions: there the flag selects only the code path
# around them (the CPU tests run it).
_GDC = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch as dependents of the kernel before them."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    enabled = _BY_DEVICE.get(index)
    if enabled is None:
        major, _ = torch.cuda.get_device_capability(index)
        # NOTE: a ROCm device reports a capability too (9 for MI300): NVIDIA's alone have PDL
        enabled = torch.version.hip is None and major >= 9 and asked_for()
        _BY_DEVICE[index] = enabled
    return enabled


def asked_for() -> bool:
    """Whether the environment leaves dependent launches on (GRAPHGUARD_PDL=0 turns them off)."""
    return os.environ.get(PDL_ENV, "1") != "0"


def launch_flags(device: torch.device) -> dict[str, bool]:
    """A kernel launch's keywords on `device`: the kernel's PDL flag and, for a dependent
    launch, the launch option, always together (a dependent launch whose programs did not wait
    would race the kernel before it). A plain launch passes no launch option: a Triton backend
    without it, such as AMD's, refuses the keyword."""
    if dependent_launch(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def prefetch_l2(pointers):
    """Ask L2 for the memory at `pointers` (one instruction each, nothing returned, nothing
    waited for). On the device only: the interpreter has no such instruction."""
    if _GDC:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // $0", "=r,l", [pointers], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip


@triton.jit
def follow_previous(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has finished, then let the next one launch."""
    if PDL:
        if _GDC:
            gdc_wait()
            gdc_launch_dependents()
