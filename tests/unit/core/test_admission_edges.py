"""The admission policy's edges, on its own with a fake clock: which settings are valid, where
each window and deadline ends, and the counters that stats()["admission"] reports."""

import pytest

from graphguard.core.admission import MAX_TRACKED_KEYS, AdmissionConfig, AdmissionPolicy
from graphguard.core.keys import GraphKey
from graphguard.core.reasons import FallbackReason
from tests.unit.core.conftest import FakeClock

KEY = GraphKey(("k",))


def record_capture(policy: AdmissionPolicy, key: GraphKey, seconds: float, size: int) -> None:
    """A whole capture of `seconds`, admitted at `size` bytes (as a runner records one)."""
    policy.record_work(seconds)
    policy.record_admitted(key, size)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("min_hits", 0),
        ("max_capture_fraction", 0.0),
        ("max_capture_fraction", 1.5),
        ("mode", "eager-only"),
        ("backoff_initial_s", 0.0),
        ("backoff_max_s", 0.5),  # shorter than backoff_initial_s (1 s)
        ("capture_window_s", 0.0),
        ("thrash_window_s", 0.0),
        ("max_recaptures", 0),
    ],
)
def test_an_invalid_setting_is_refused_by_name(setting, value):
    with pytest.raises(ValueError, match=setting):
        AdmissionConfig(**{setting: value})


@pytest.mark.parametrize(
    "settings",
    [
        {"max_capture_fraction": 1.0},
        {"backoff_initial_s": 5.0, "backoff_max_s": 5.0},  # a fixed delay
        {"capture_window_s": 0.5, "thrash_window_s": 0.5},  # any positive window
    ],
)
def test_the_edges_of_the_valid_ranges_are_accepted(settings):
    config = AdmissionConfig(**settings)
    assert all(getattr(config, name) == value for name, value in settings.items())


def test_capture_seconds_add_up_over_captures():
    policy = AdmissionPolicy(AdmissionConfig(), FakeClock())
    record_capture(policy, GraphKey(("a",)), 1.5, 0)
    record_capture(policy, GraphKey(("b",)), 2.0, 0)
    assert policy.counters.capture_seconds == 3.5


def test_size_hints_keep_the_newest_keys_up_to_their_cap():
    policy = AdmissionPolicy(AdmissionConfig(), FakeClock())
    keys = [GraphKey((n,)) for n in range(MAX_TRACKED_KEYS + 1)]
    for key in keys:
        record_capture(policy, key, 0.0, 1)
    assert len(policy.size_hints) == MAX_TRACKED_KEYS
    assert keys[0] not in policy.size_hints and keys[1] in policy.size_hints


def test_a_recaptured_keys_size_hint_counts_as_the_newest():
    policy = AdmissionPolicy(AdmissionConfig(), FakeClock())
    keys = [GraphKey((n,)) for n in range(MAX_TRACKED_KEYS + 1)]
    for key in keys[:-1]:
        record_capture(policy, key, 0.0, 1)
    record_capture(policy, keys[0], 0.0, 2)  # the oldest, captured again
    record_capture(policy, keys[-1], 0.0, 1)  # one key too many: the oldest hint goes
    assert policy.size_hints[keys[0]] == 2 and keys[1] not in policy.size_hints


def test_each_quarantine_is_counted():
    policy = AdmissionPolicy(AdmissionConfig(), FakeClock())
    for _ in range(3):
        policy.quarantine(KEY)
    assert policy.counters.quarantines == 3


def test_each_capture_deferred_until_earned_is_counted():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=3), FakeClock())
    policy.record_call(KEY)
    assert policy.blocked(KEY) is FallbackReason.ADMISSION_DEFERRED
    assert policy.blocked(KEY) is FallbackReason.ADMISSION_DEFERRED
    assert policy.counters.deferred == 2


def test_each_candidate_refused_by_frequency_is_counted_as_deferred():
    policy = AdmissionPolicy(AdmissionConfig(), FakeClock())
    hot, cold = GraphKey(("hot",)), GraphKey(("cold",))
    for _ in range(3):
        policy.record_call(hot)
    assert not policy.worth_evicting(cold, [hot])
    assert not policy.worth_evicting(cold, [hot])
    assert policy.counters.deferred == 2


def test_each_thrash_backoff_is_counted():
    policy = AdmissionPolicy(AdmissionConfig(max_recaptures=1), FakeClock())
    for _ in range(2):
        policy.record_eviction(KEY)
        record_capture(policy, KEY, 0.0, 1)
    assert policy.counters.thrash_backoffs == 2


def test_a_quarantine_ends_exactly_at_its_deadline(clock):
    policy = AdmissionPolicy(AdmissionConfig(backoff_initial_s=2.0), clock)
    policy.quarantine(KEY)
    clock.advance(2.0)
    assert policy.blocked_for_warmup(KEY) is None
    assert policy.num_quarantined() == 0


def test_a_backoff_ended_exactly_backoff_max_s_ago_still_doubles_the_next(clock):
    config = AdmissionConfig(backoff_initial_s=1.0, backoff_max_s=4.0)
    policy = AdmissionPolicy(config, clock)
    policy.quarantine(KEY)  # ends 1 s from now
    clock.advance(1.0 + 4.0)
    policy.num_quarantined()  # forgets the backoffs that ended longer ago than 4 s
    assert policy.quarantine(KEY) == 2.0


def test_a_capture_exactly_one_window_old_still_counts_against_the_budget(clock):
    config = AdmissionConfig(min_hits=1, capture_window_s=60.0, max_capture_fraction=0.05)
    policy = AdmissionPolicy(config, clock)
    policy.record_call(KEY)
    record_capture(policy, GraphKey(("other",)), 3.0, 0)  # the window's whole 3 s
    clock.advance(60.0)
    assert policy.blocked(KEY) is FallbackReason.ADMISSION_DEFERRED
    clock.advance(0.5)
    assert policy.blocked(KEY) is None


def test_an_eviction_exactly_one_thrash_window_old_still_counts(clock):
    config = AdmissionConfig(max_recaptures=1, thrash_window_s=60.0)
    policy = AdmissionPolicy(config, clock)
    policy.record_eviction(KEY)
    clock.advance(60.0)
    record_capture(policy, KEY, 0.0, 1)
    assert policy.counters.thrash_backoffs == 1


def test_a_key_refused_for_its_state_stays_eager_with_its_reason_at_warm_up_too():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=1), FakeClock())
    key, other = GraphKey(("a",)), GraphKey(("b",))
    policy.record_call(key)
    policy.record_call(other)
    policy.refusals[key] = FallbackReason.PYTHON_STATE
    assert policy.blocked(key) is FallbackReason.PYTHON_STATE
    assert policy.blocked_for_warmup(key) is FallbackReason.PYTHON_STATE
    assert policy.blocked(other) is None and policy.blocked_for_warmup(other) is None
