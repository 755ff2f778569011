"""When a key earns a capture.

Capture-on-miss under a byte budget thrashes when more shapes are live than the budget holds:
every call evicts one graph and captures another, and the runner becomes slower than eager. This
policy decides *whether* to capture, not only what to evict:

1. earned capture: a key is captured only once it has been seen `min_hits` times;
2. capture-work budget: time spent capturing (warm-up, capture and parity check, whether the
   graph is admitted or not, in the call or between calls) stays under `max_capture_fraction`
   of wall time over a sliding `capture_window_s`; a capture between calls counts each unit of
   work as it runs;
3. frequency-aware replacement: a key that would evict resident graphs is captured only if it is
   used more often than each of them (count-min sketch with aging: TinyLFU);
4. thrash backoff: a key evicted and recaptured `max_recaptures` times inside `thrash_window_s`
   is backed off exponentially (reason `thrashing`);
5. quarantine: a failed capture or a parity mismatch backs the key off exponentially; a step
   whose state a capture cannot put back (graphguard/core/state.py) is refused for good, with
   the named reason;
6. mode "prewarmed": only keys captured by warmup() may replay; lazy capture is off;
7. payback (`payback` > 0; off by default, on in the engine): a key is captured only once its
   eager calls have cost `payback` times a capture's price more than replays of it would have.
   The price is what this runner's last admitted capture of the key (else the mean of its
   captures) cost in capture work; an eager call's cost is its time less the runner's mean
   replay time. This is the break-even rule of rent-or-buy: a key called without end is
   captured after at most `payback` captures' worth of eager time, and a key that stops being
   called before that never costs a capture, so capture work plus eager excess stays within
   1 + max(payback, 1 / payback) times the cheaper of the two whatever traffic does (2x at
   payback 1, the best such bound), plus one call's excess. Until the runner has admitted a
   capture it knows no price, and `min_hits` alone decides.

Every decision reads the injected clock, so tests drive time by hand.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from graphguard.core.keys import GraphKey
from graphguard.core.reasons import FallbackReason
from graphguard.core.sketch import FrequencySketch

Clock = Callable[[], float]
# Per-key memory (size hints, payback) is capped; the frequency sketch is fixed-size already.
MAX_TRACKED_KEYS = 4096
REPLAY_WEIGHT = 0.1  # weight of the newest replay in the mean replay time


def _bound(table: dict[GraphKey, Any]) -> None:
    """Forget the oldest entries (insertion order) beyond MAX_TRACKED_KEYS."""
    while len(table) > MAX_TRACKED_KEYS:
        del table[next(iter(table))]


@dataclass(frozen=True)
class AdmissionConfig:
    """Admission policy settings (see module docstring for the rules)."""

    min_hits: int = 2
    capture_window_s: float = 60.0
    max_capture_fraction: float = 0.05
    frequency_aware: bool = True
    thrash_window_s: float = 60.0
    max_recaptures: int = 2
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 300.0
    mode: str = "lazy"  # "lazy" | "prewarmed"
    payback: float = 0.0  # captures' worth of eager excess a key must cost first (0: off)

    def __post_init__(self) -> None:
        if self.payback < 0:
            raise ValueError(f"payback must be >= 0, got {self.payback}")
        if self.min_hits < 1:
            raise ValueError(f"min_hits must be >= 1, got {self.min_hits}")
        if not 0 < self.max_capture_fraction <= 1:
            raise ValueError(
                f"max_capture_fraction must be in (0, 1], got {self.max_capture_fraction}"
            )
        if self.mode not in ("lazy", "prewarmed"):
            raise ValueError(f"mode must be 'lazy' or 'prewarmed', got {self.mode!r}")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_initial_s must be > 0 and <= backoff_max_s")
        if self.capture_window_s <= 0 or self.thrash_window_s <= 0:
            raise ValueError("capture_window_s and thrash_window_s must be > 0")
        if self.max_recaptures < 1:
            raise ValueError(f"max_recaptures must be >= 1, got {self.max_recaptures}")


@dataclass
class _Backoff:
    until: float = 0.0
    delay_s: float = 0.0
    count: int = 0


@dataclass
class AdmissionCounters:
    deferred: int = 0
    thrash_backoffs: int = 0
    quarantines: int = 0
    capture_seconds: float = 0.0
    awaiting_payback: int = 0  # of `deferred`: earned by min_hits, not yet by payback


@dataclass
class AdmissionPolicy:
    """Stateful admission decisions for one runner. Not thread-safe: the runner's lock guards it."""

    config: AdmissionConfig = field(default_factory=AdmissionConfig)
    clock: Clock = field(default=lambda: 0.0)

    def __post_init__(self) -> None:
        self.sketch = FrequencySketch()
        self.counters = AdmissionCounters()
        self.size_hints: dict[GraphKey, int] = {}  # bytes of a key's last capture
        self.prewarmed: set[GraphKey] = set()
        # keys whose step writes state a capture cannot put back: eager for good, with the reason
        self.refusals: dict[GraphKey, FallbackReason] = {}
        self._captures: deque[tuple[float, float]] = deque()  # (end time, seconds)
        self._evicted_at: dict[GraphKey, deque[float]] = {}
        self._quarantine: dict[GraphKey, _Backoff] = {}
        self._thrash: dict[GraphKey, _Backoff] = {}
        # payback (rule 7): eager excess per key, and prices of admitted captures
        self._excess: dict[GraphKey, float] = {}
        self._prices: dict[GraphKey, float] = {}
        self._price_sum = 0.0
        self._num_prices = 0
        self._replay_s = 0.0  # mean host time of a replay (exponentially weighted)

    # -- observations ----------------------------------------------------------------------
    def record_call(self, key: GraphKey) -> None:
        self.sketch.add(key)  # the sightings min_hits counts, in fixed memory

    def record_work(self, seconds: float) -> None:
        """Capture work (a unit of it, or a whole capture), admitted or not: the price that the
        capture-work budget counts."""
        self._captures.append((self.clock(), seconds))
        self.counters.capture_seconds += seconds

    def record_admitted(self, key: GraphKey, resident_bytes: int) -> None:
        """A capture admitted at `resident_bytes` (its work is recorded apart, record_work)."""
        self.size_hints.pop(key, None)  # re-inserted last: the oldest hints go first
        self.size_hints[key] = resident_bytes
        _bound(self.size_hints)
        self._excess.pop(key, None)  # bought: after an eviction it must pay back again
        self._note_recapture(key, self.clock())

    def record_eager(self, key: GraphKey, seconds: float) -> None:
        """An eager call of `key` that took `seconds`: what a replay would have saved of it
        adds to the key's excess (payback)."""
        if self.config.payback:
            excess = self._excess.pop(key, 0.0) + max(0.0, seconds - self._replay_s)
            self._excess[key] = excess
            _bound(self._excess)

    def record_replay(self, seconds: float) -> None:
        """A replay that took `seconds` (payback's estimate of what a replay costs)."""
        self._replay_s += REPLAY_WEIGHT * (seconds - self._replay_s)

    def record_price(self, key: GraphKey, seconds: float) -> None:
        """An admitted capture of `key` whose work took `seconds`: the price of its next one,
        and one more sample of the runner's mean price."""
        self._prices.pop(key, None)
        self._prices[key] = seconds
        _bound(self._prices)
        self._price_sum += seconds
        self._num_prices += 1

    @property
    def mean_price(self) -> float | None:
        """The mean work of this runner's admitted captures, in seconds; None before any."""
        return self._price_sum / self._num_prices if self._num_prices else None

    @property
    def knows_a_price(self) -> bool:
        """Whether a capture of this runner has been admitted (and priced)."""
        return self._num_prices > 0

    def price(self, key: GraphKey) -> float | None:
        """What a capture of `key` is expected to cost in capture work; None before any."""
        if key in self._prices:
            return self._prices[key]
        return self.mean_price

    def record_eviction(self, key: GraphKey) -> None:
        self._evicted_at.setdefault(key, deque()).append(self.clock())

    def quarantine(self, key: GraphKey) -> float:
        """Back the key off after a failure; returns the delay in seconds."""
        self.counters.quarantines += 1
        return self._back_off(self._quarantine, key)

    # -- decisions -------------------------------------------------------------------------
    def blocked(self, key: GraphKey) -> FallbackReason | None:
        """Reasons a key may not capture now, whatever the cache holds.

        A prewarmed key has earned its capture: after an eviction or an invalidation (new
        weights) it is captured again as soon as it is called.
        """
        reason = self.blocked_for_warmup(key)
        if reason is not None:
            return reason
        is_prewarmed = key in self.prewarmed
        if self.config.mode == "prewarmed" and not is_prewarmed:
            return FallbackReason.NOT_PREWARMED
        earned = is_prewarmed or self.sketch.estimate(key) >= self.config.min_hits
        if not earned or self._over_capture_budget(self.clock()):
            self.counters.deferred += 1
            return FallbackReason.ADMISSION_DEFERRED
        if not (is_prewarmed or self.paid_back(key)):
            self.counters.deferred += 1
            self.counters.awaiting_payback += 1
            return FallbackReason.ADMISSION_DEFERRED
        return None

    def paid_back(self, key: GraphKey) -> bool:
        """Whether `key`'s eager excess covers `payback` times its price (rule 7; True when
        payback is off or no price is known yet)."""
        if not self.config.payback:
            return True
        price = self.price(key)
        return price is None or self._excess.get(key, 0.0) >= self.config.payback * price

    def blocked_for_warmup(self, key: GraphKey) -> FallbackReason | None:
        """Warm-up skips earned-capture and frequency rules, not a refusal, quarantine or
        thrash backoff."""
        refusal = self.refusals.get(key)
        if refusal is not None:
            return refusal
        now = self.clock()
        if self._active(self._quarantine, key, now):
            return FallbackReason.QUARANTINED
        if self._active(self._thrash, key, now):
            return FallbackReason.THRASHING
        return None

    def worth_evicting(self, key: GraphKey, victims: Iterable[GraphKey]) -> bool:
        """TinyLFU: the candidate must be used more often than every graph it would evict."""
        if not self.config.frequency_aware:
            return True
        candidate = self.sketch.estimate(key)
        if all(candidate > self.sketch.estimate(v) for v in victims):
            return True
        self.counters.deferred += 1
        return False

    def num_quarantined(self) -> int:
        now = self.clock()
        self._forget_old_backoffs(now)
        return sum(1 for b in self._quarantine.values() if b.until > now)

    def _forget_old_backoffs(self, now: float) -> None:
        # A backoff that ended longer ago than the longest delay no longer shapes the next one.
        horizon = now - self.config.backoff_max_s
        for table in (self._quarantine, self._thrash):
            for key in [k for k, b in table.items() if b.until < horizon]:
                del table[key]

    # -- internals -------------------------------------------------------------------------
    def _over_capture_budget(self, now: float) -> bool:
        window = self.config.capture_window_s
        while self._captures and self._captures[0][0] < now - window:
            self._captures.popleft()
        spent = math.fsum(seconds for _, seconds in self._captures)
        return spent >= self.config.max_capture_fraction * window

    def _note_recapture(self, key: GraphKey, now: float) -> None:
        evictions = self._evicted_at.get(key)
        if not evictions:
            return
        while evictions and evictions[0] < now - self.config.thrash_window_s:
            evictions.popleft()
        if not evictions:
            del self._evicted_at[key]
        elif len(evictions) >= self.config.max_recaptures:
            evictions.clear()
            self.counters.thrash_backoffs += 1
            self._back_off(self._thrash, key)

    def _back_off(self, table: dict[GraphKey, _Backoff], key: GraphKey) -> float:
        backoff = table.setdefault(key, _Backoff())
        if backoff.delay_s:
            backoff.delay_s = min(backoff.delay_s * 2, self.config.backoff_max_s)
        else:
            backoff.delay_s = self.config.backoff_initial_s
        backoff.count += 1
        backoff.until = self.clock() + backoff.delay_s
        return backoff.delay_s

    @staticmethod
    def _active(table: dict[GraphKey, _Backoff], key: GraphKey, now: float) -> bool:
        backoff = table.get(key)
        return backoff is not None and backoff.until > now
