"""The admission's payback rule: a key is captured once its eager calls have cost a capture's
price more than replays would have (rent or buy; fake clock, SimBackend)."""

import pytest

from graphguard.core.admission import AdmissionConfig, AdmissionPolicy
from graphguard.core.keys import GraphKey
from graphguard.core.reasons import FallbackReason
from tests.unit.core.conftest import inputs
from tests.unit.core.stand_ins import kernel

DEFERRED = FallbackReason.ADMISSION_DEFERRED


def key(name: str) -> GraphKey:
    return GraphKey(rows=1, args=(name,))


def seen(policy: AdmissionPolicy, k: GraphKey, eager_s: float, times: int = 1) -> None:
    for _ in range(times):
        policy.record_call(k)
        policy.record_eager(k, eager_s)


def test_until_a_capture_is_priced_min_hits_alone_decides():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=2, payback=1.0))
    seen(policy, key("a"), 0.001, times=2)
    assert policy.price(key("a")) is None
    assert policy.blocked(key("a")) is None


def test_a_key_waits_until_its_eager_excess_covers_the_price():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=1, payback=1.0))
    policy.record_price(key("a"), 3.0)
    seen(policy, key("b"), 1.0, times=2)
    assert policy.blocked(key("b")) is DEFERRED
    assert policy.counters.awaiting_payback == 1
    seen(policy, key("b"), 1.0)
    assert policy.blocked(key("b")) is None


def test_what_a_replay_costs_is_not_counted_as_excess():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=1, payback=1.0))
    policy.record_price(key("a"), 3.0)
    for _ in range(200):
        policy.record_replay(0.5)
    seen(policy, key("b"), 1.0, times=5)  # 0.5 s of excess each: 2.5 s
    assert policy.blocked(key("b")) is DEFERRED
    seen(policy, key("b"), 1.0)
    assert policy.blocked(key("b")) is None


def test_payback_scales_the_price():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=1, payback=0.5))
    policy.record_price(key("a"), 4.0)
    seen(policy, key("b"), 1.0, times=2)
    assert policy.blocked(key("b")) is None


def test_a_keys_own_price_comes_before_the_runners_mean():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=1, payback=1.0))
    policy.record_price(key("a"), 1.0)
    policy.record_price(key("b"), 9.0)
    assert policy.price(key("c")) == 5.0
    seen(policy, key("a"), 1.0)
    assert policy.blocked(key("a")) is None  # its own 1 s, not the mean 5 s
    seen(policy, key("c"), 1.0, times=4)
    assert policy.blocked(key("c")) is DEFERRED


def test_an_admitted_key_must_pay_back_again_after_an_eviction():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=1, payback=1.0))
    policy.record_price(key("a"), 2.0)
    seen(policy, key("b"), 1.0, times=2)
    assert policy.blocked(key("b")) is None
    policy.record_admitted(key("b"), 1 << 20)
    policy.record_price(key("b"), 2.0)
    policy.record_eviction(key("b"))
    seen(policy, key("b"), 1.0)
    assert policy.blocked(key("b")) is DEFERRED


def test_payback_off_never_defers():
    policy = AdmissionPolicy(AdmissionConfig(min_hits=1))
    policy.record_price(key("a"), 100.0)
    seen(policy, key("b"), 0.001)
    assert policy.blocked(key("b")) is None
    assert policy.counters.awaiting_payback == 0


def test_negative_payback_is_refused():
    with pytest.raises(ValueError, match="payback"):
        AdmissionConfig(payback=-1.0)


def test_a_runner_prices_its_captures_and_times_its_eager_calls(make_runner, clock):
    slow = kernel(lambda x: clock.advance(1.0))  # every run "takes" a second of the clock

    def step(x, p):
        return slow(x) + p

    config = AdmissionConfig(min_hits=1, payback=1.0, max_capture_fraction=1.0)
    runner = make_runner(step, admission=config)
    runner(*inputs(2, width=4))
    # the first capture has no price to meet; it costs 3 s of work (the capture's run, the
    # first replay, the eager parity run), which prices the next key
    assert runner.stats()["captures"] == 1
    assert runner.policy.price(key("unseen")) == pytest.approx(3.0)
    assert runner.stats()["capture_price_ms"] == pytest.approx(3000.0)
    for _ in range(3):
        runner(*inputs(2, width=5))  # 1 s of excess each: 0, 1, 2 s before the call
    assert runner.stats()["captures"] == 1
    assert runner.stats()["admission"]["awaiting_payback"] == 3
    runner(*inputs(2, width=5))  # 3 s of excess: paid back
    assert runner.stats()["captures"] == 2
    assert runner.stats()["fallbacks"] == {"admission_deferred": 3}


@pytest.mark.parametrize("eager_s", [0.3, 1.0, 2.5])
def test_capture_work_and_eager_excess_stay_within_twice_the_cheaper_choice(eager_s):
    """Rent or buy: whether a key is called once or without end, what the rule spends (eager
    excess until it captures, then the price) is at most twice what the better of capturing at
    once and never capturing would have, plus one call."""
    price = 3.0
    for num_calls in range(1, 40):
        policy = AdmissionPolicy(AdmissionConfig(min_hits=1, payback=1.0))
        policy.record_price(key("priced"), price)
        spent = 0.0
        for _ in range(num_calls):
            policy.record_call(key("b"))
            if policy.blocked(key("b")) is None:
                spent += price  # captured: every later call replays
                break
            policy.record_eager(key("b"), eager_s)
            spent += eager_s
        cheaper = min(price, num_calls * eager_s)
        assert spent <= 2 * cheaper + eager_s, (num_calls, spent, cheaper)
