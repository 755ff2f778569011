"""When a step spends time on the graph capture in flight (captures between steps).

A unit of capture work runs on the step thread before the step, so it delays that step by its
length: requests waiting for their first token pay it in TTFT, running ones in one slower
token. A GPU serve load (SmolLM2 shape, waves of 16 requests) measured decode units of up to
71 ms and prefill units of up to 181 ms in front of the steps that prefilled new waves. So:

1. **Slack.** No unit runs in a step that has prefills pending (requests waiting for their
   first token, or a chunked prefill in progress), unless the capture has been put off
   `max_deferred_steps` steps in a row and for at least `max_deferred_ms`: a queue that never
   empties (a saturated server) still lets a capture finish, one slice per deferral, while a
   wave of arrivals (which keeps prefills pending for a few dozen fast graph steps) does not
   wait behind one. A bound in steps alone let units run in the middle of waves once decode
   steps took 2 ms (run 35).
2. **Slice.** A step that may run units runs them until `slice_ms` of capture work is spent
   (at least one unit): the many small units of a prefill group (a segment's warm-up or
   capture) finish in a few steps instead of one step each, while a long unit (a decode
   warm-up, one whole forward) still runs alone.

Idle steps (no request at all) have no prefill pending, so idle time finishes captures first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from graphguard.engine.config import CapturePacing


class CapturePacer:
    """Runs the units a step may run of the capture in flight (see module docstring).

    `advance` runs one unit and returns True while a capture remains in flight.
    """

    def __init__(
        self,
        pacing: CapturePacing,
        advance: Callable[[], bool],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.pacing = pacing
        self._advance = advance
        self._clock = clock
        self.num_deferred = 0  # steps in a row that ran no unit for a pending prefill
        self.deferred_since = 0.0  # when the first of them began
        self.num_deferred_total = 0  # every step that did so

    def before_step(self, has_pending_prefills: bool) -> int:
        """Run this step's units of the capture in flight (call only while one is in flight);
        how many ran."""
        if has_pending_prefills and self._may_defer():
            if self.num_deferred == 0:
                self.deferred_since = self._clock()
            self.num_deferred += 1
            self.num_deferred_total += 1
            return 0
        self.num_deferred = 0
        return self._run_slice()

    def _may_defer(self) -> bool:
        if self.num_deferred < self.pacing.max_deferred_steps:
            return True
        return (self._clock() - self.deferred_since) * 1e3 < self.pacing.max_deferred_ms

    def _run_slice(self) -> int:
        deadline = self._clock() + self.pacing.slice_ms / 1e3
        num_units = 1
        while self._advance() and self._clock() < deadline:
            num_units += 1
        return num_units
