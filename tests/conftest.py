"""Set before any test module is imported.

On a machine without CUDA, Triton's kernels run in its interpreter (`TRITON_INTERPRET=1`, as
the kernel tests ask). The variable must be set before anything imports triton, which peft
does: triton.language's own helpers are otherwise built for a device, and an interpreted kernel
that calls one fails."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
