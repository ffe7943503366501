"""A sequence's own draft record (controller/history.py): what it counts, the level it gives,
how a level moves a batch-1 step's budget and early stop, and that the runner keeps it."""
from __future__ import annotations

import pytest

from controller import history
from controller.config import AdaptiveConfig, SpeculativeConfig
from controller.history import LEVELS, level, record, shifted, shifted_shares
from controller.policy import SpecPolicy
from controller.time_model import TimeModel
from tests.conftest import greedy, local_engine, teach, tiny_config


def test_a_record_counts_the_trials_up_to_the_first_rejection_and_forgets_slowly():
    assert record(0.0, 0.0, 3, 1) == (1.0, 2.0)  # drafts 1 and 2 were trials, the first accepted
    assert record(0.0, 0.0, 3, 3) == (3.0, 3.0)
    assert record(0.0, 0.0, 2, 0) == (0.0, 1.0)
    hits, trials = record(1.0, 2.0, 1, 0)
    assert hits == pytest.approx(history.HISTORY_DECAY) and trials == pytest.approx(2 * history.HISTORY_DECAY + 1)


def test_a_record_fades_while_its_sequence_verifies_nothing_until_it_is_level_with_the_pool():
    """A bad stretch stands a sequence down, and standing down brings no new outcomes: the
    record fades all the same, back to level 0 (the sequence drafts again), then to nothing."""
    bad = (0.0, 0.0)
    for _ in range(7):
        bad = record(*bad, 3, 0)
    assert level(*bad, 0.8) <= -2
    faded, steps = bad, 0
    while level(*faded, 0.8) < 0:
        faded, steps = history.fade(*faded), steps + 1
    assert 10 <= steps <= 40
    assert history.fade(*bad) == pytest.approx((0.0, bad[1] * history.HISTORY_DECAY))
    for _ in range(100):
        faded = history.fade(*faded)
    assert faded == (0.0, 0.0)


def test_the_level_follows_the_record_against_the_pooled_rate_within_its_bounds():
    assert level(0.0, 0.0, 0.7) == 0  # nothing seen
    good = bad = typical = (0.0, 0.0)
    for _ in range(60):
        good, bad = record(*good, 3, 3), record(*bad, 3, 0)
        typical = record(*typical, 10, 7)  # 7 of 8 trials: the pooled rate's odds
    assert level(*good, 0.7) == LEVELS  # bounded
    assert -LEVELS <= level(*bad, 0.7) <= -2  # (with the decay a record holds about 10 trials: -3 here)
    assert level(*bad, 0.99) == -LEVELS
    assert level(*typical, 0.875) == 0
    assert 0 < level(*record(0.0, 0.0, 3, 3), 0.7) < LEVELS  # one good step moves it part of the way


def test_a_level_shifts_every_rate_and_share_the_same_way():
    rates = [0.8, 0.7, 0.6]
    assert shifted(rates, 0) == rates
    up, down = shifted(rates, 2), shifted(rates, -2)
    assert all(d < r < u for d, r, u in zip(down, rates, up))
    accepted, verified = [0.8, 0.56, 0.3], [1.0, 1.0, 0.5]
    assert shifted_shares(accepted, verified, 0) == accepted
    high, low = shifted_shares(accepted, verified, 3), shifted_shares(accepted, verified, -3)
    assert all(lo < a for lo, a in zip(low, accepted)) and high[0] > accepted[0] and high[1] > accepted[1]
    assert high[2] <= verified[2]  # never accepted more often than verified
    assert all(b <= a for a, b in zip(high, high[1:]))  # still a path probability


def _batch_1_budgets(seq_history: bool, rate: float = 0.6) -> dict[int, int]:
    """The budget of one batch-1 step after a record at each of a few levels; the drafts are
    accepted at `rate` and a draft step costs about what a token brings at that rate."""
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=6,
                                          adaptive=AdaptiveConfig(enabled=True, seq_history=seq_history)))
    teach(policy, rate, 6, times=400)
    policy.install(TimeModel(version=1, b0=1.0, b1=0.02, d0=0.45, d1=0.0))
    policy.probes.hold()  # no probe
    out = {}
    for label, verified, accepted in (("bad", 3, 0), ("none", 0, 0), ("good", 3, 3)):
        rec = (0.0, 0.0)
        for _ in range(20 if verified else 0):
            rec = record(*rec, verified, accepted)
        step = policy.begin_step("adaptive", [100], [6], 1, 6, record=rec)
        out[label] = (step.budget, step.level)
    return out


def test_a_good_record_drafts_deeper_and_a_bad_one_shallower_at_batch_1():
    got = _batch_1_budgets(True)
    assert got["bad"][1] < 0 == got["none"][1] < got["good"][1]
    assert got["bad"][0] < got["none"][0] < got["good"][0], got
    off = _batch_1_budgets(False)  # seq_history off: the record is not read
    assert {b for b, _ in off.values()} == {got["none"][0]} and {lv for _, lv in off.values()} == {0}


def test_the_early_stop_expects_a_good_records_next_draft_more_often():
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=4,
                                          adaptive=AdaptiveConfig(enabled=True, seq_history=True)))
    policy.one_row_steps = False  # a SpecStep: its keep_drafting reads the level's rates
    policy.install(TimeModel(version=1, b0=1.0, b1=0.01, d0=0.2, d1=0.0))
    policy.probes.hold()
    good = (0.0, 0.0)
    for _ in range(20):
        good = record(*good, 3, 3)
    step = policy.begin_step("adaptive", [100], [4], 1, 4, record=good)
    assert step.level > 0 and policy.rates_at(step.level)[1] > policy.next_rates[1]


def _records_given(policy) -> list:
    """The record each later decide_step of `policy` (begin_step's, and the runner's entry) is handed, in order."""
    given, begin = [], policy.decide_step

    def spy(*args, **kwargs):
        given.append(args[7] if len(args) > 7 else kwargs.get("record"))
        return begin(*args, **kwargs)

    policy.decide_step = spy
    return given


def _drafting_engine(*overrides):
    """An in-process engine at k = 4 whose time model makes drafting pay, and the records its
    decide_step is handed (_records_given)."""
    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.adaptive.enabled=true",
                                      "speculative.adaptive.profile_on_start=false",
                                      "speculative.num_speculative_tokens=4", *overrides))
    given = _records_given(engine.workers.worker.runner.policy)
    engine.time_models.install(TimeModel(b0=5.0, b1=0.1, b2=0.0, d0=0.05, d1=0.0))  # drafting pays
    return engine, given


def test_the_runner_keeps_each_sequences_record_and_hands_it_to_the_next_step():
    """Every step of one greedy sequence: the record begin_step was given is the one its earlier
    steps' verified and accepted drafts make (history.record, from nothing), faded by each step
    that verified none (history.fade: here once drafting stops paying)."""
    engine, given = _drafting_engine("speculative.adaptive.seq_history=true")
    try:
        engine.add_request(list(range(5, 45)), greedy(40))
        engine.step()  # the prefill
        (seq,) = engine.seqs.values()
        expected, steps, faded = (0.0, 0.0), 0, 0
        while engine.has_work():
            if steps == 6:  # from here drafting cannot pay: plain steps, and the record fades
                engine.time_models.install(TimeModel(b0=1.0, b1=0.01, b2=0.0, d0=1000.0, d1=0.0))
            verified, accepted = seq.verified, seq.accepted
            engine.step()
            assert given[-1] == pytest.approx(expected)
            if seq.verified > verified:
                expected = record(*expected, seq.verified - verified, seq.accepted - accepted)
                steps += 1
            elif expected[1]:
                expected = history.fade(*expected)
                faded += 1
    finally:
        engine.shutdown()
    assert steps >= 6 and faded >= 10 and expected[1] > 0


def test_a_level_found_by_bisection_is_the_rounded_logit_shift():
    """level_in places the record's shrunk rate among bounds computed once per calibration
    batch: the same level as rounding its logit distance from the pooled rate, bounded."""
    import math
    import random

    def by_logits(hits, trials, pooled):
        if trials <= 0:
            return 0
        own = (hits + history.HISTORY_WEIGHT * pooled) / (trials + history.HISTORY_WEIGHT)
        shift = (math.log(own / (1 - own)) - math.log(pooled / (1 - pooled))) / history.LEVEL_STEP
        return max(-LEVELS, min(LEVELS, round(shift)))

    rng = random.Random(0)
    seen = set()
    for _ in range(20000):
        pooled, trials = rng.uniform(0.05, 0.95), rng.uniform(0.0, 12.0)
        hits = rng.uniform(0.0, trials)
        got = level(hits, trials, pooled)
        assert got == by_logits(hits, trials, pooled), (hits, trials, pooled)
        seen.add(got)
    assert seen == set(range(-LEVELS, LEVELS + 1))


def test_without_seq_history_the_runner_keeps_and_hands_on_no_record():
    engine, given = _drafting_engine()
    try:
        engine.add_request(list(range(5, 45)), greedy(24))
        engine.step()
        (state,) = engine.workers.worker.runner.seqs.values()
        while engine.has_work():
            engine.step()
    finally:
        engine.shutdown()
    assert engine.stats.verified > 0 and state.hits == state.trials == 0.0
    assert given and all(record is None for record in given)  # and hands begin_step none
