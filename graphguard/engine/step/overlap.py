"""Decode steps launched ahead: the device runs step N+1 while the host turns step N's tokens
into outputs.

Once a decode step replays as one graph in about a millisecond, the host's share of a step
(scheduling, the inputs' copy, the launch, reading the sampled tokens, detokenizing, building
outputs) is as long again, and without overlap device and host take turns. When every running
request decodes greedily and nothing reads its logits on the host (no logprobs, logit bias,
penalties or grammar), and nothing waits to be scheduled, step N+1's inputs are known before
step N's tokens reach the host: each sequence moves one position on, its KV slot is reserved
now, and its token id is step N's argmax, copied on the device. So the engine launches step
N+1 right after step N's argmax and only then waits for step N's tokens, which come back
through one asynchronous copy into pinned memory (a plain copy would wait for step N+1 too).

Tokens are the same as without overlap: step N+1 runs on the inputs the scheduler would have
given it, padded to the same bucket. A request that turns out to end at step N (EOS, a stop
string, an abort) has a row in step N+1 that no one reads; its KV write lands in its own
block, which goes back to the pool now but is handed out only to work that the stream runs
later. Whenever the batch would change (a request arrives or ends, one asks for logprobs,
a length limit comes, the pool is short), the step in flight is finished and the next one is
scheduled as usual, so overlap never changes what is computed, only when the host waits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from graphguard.engine.config import OVERLAP_CHOICES
from graphguard.engine.scheduling.sequence import Sequence


class HostTokens:
    """A step's sampled token ids on their way to the host: an asynchronous copy into pinned
    memory and an event, so that reading them waits for this step's work only."""

    def __init__(self, device_ids: Tensor) -> None:
        self.device_ids = device_ids
        self._event: torch.cuda.Event | None = None
        if device_ids.is_cuda:
            self._host = torch.empty(device_ids.shape, dtype=device_ids.dtype, pin_memory=True)
            self._host.copy_(device_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = device_ids

    def wait(self) -> list[int]:
        """The token ids, once the step that sampled them is done (not the ones after it)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


@dataclass
class StepAhead:
    """A decode step in flight whose tokens the host has not read yet."""

    seqs: list[Sequence]  # its rows, in order
    tokens: HostTokens


def resolve_overlap(choice: str, device: torch.device, is_tensor_parallel: bool) -> bool:
    """Whether decode steps are launched ahead: "auto" does on CUDA (on a CPU the step runs
    on the calling thread, so there is nothing to overlap); never under tensor parallelism
    (the followers replay exactly the batches rank 0 schedules, in step)."""
    if choice not in OVERLAP_CHOICES:
        raise ValueError(f"overlap_decode must be one of {OVERLAP_CHOICES}, got {choice!r}")
    if is_tensor_parallel or choice == "off":
        return False
    return choice == "on" or device.type == "cuda"


def decodes_ahead(seq: Sequence, max_model_len: int) -> bool:
    """Whether `seq` (running, its last token not read yet) may take part in a step launched
    ahead: it samples greedily with nothing the host must apply to its logits, and that
    last token cannot end it by length (the step ahead would be wasted on it)."""
    params = seq.params
    if not seq.is_running or seq.grammar is not None:
        return False
    if not params.is_greedy or params.adjusts_logits or params.min_tokens:
        return False
    if params.logprobs is not None:
        return False
    # After the token in flight: num_output_tokens + 1 outputs and num_tokens + 1 tokens.
    return seq.num_output_tokens + 2 <= params.max_tokens and seq.num_tokens + 1 < max_model_len


def greedy_tokens(logits: Tensor) -> Tensor:
    """The greedy choice of each row, as the sampler makes it (engine/tokens/sampling.py)."""
    return torch.argmax(logits.float(), dim=-1)
