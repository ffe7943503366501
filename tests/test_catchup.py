"""A draft's catch-up past a steady step's (controller/catchup.py): its cost per token, fitted
from the steps that paid it, and its share in the draft budget of a step that switches into
drafting."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cluster.engine.request import RequestParams, Sequence
from cluster.engine.scheduler import Scheduler
from controller.catchup import (CATCHUP_MIN_SAMPLES, STRETCH_DECAY, SWEEP_CATCHUP, DraftStretches, catchup_ms,
                                switch_cost)
from controller.config import AdaptiveConfig, SpeculativeConfig
from controller.one_row_step import OneRowStep
from controller.policy import SpecPolicy
from controller.stand_down import PlainStep
from controller.registry import STEADY_CATCHUP, WINDOW, ProfileRegistry
from controller.samples import StepSample
from controller.time_model import TimeModel
from workers.plan import SamplingParams, SeqPlan, StepPlan
from workers.proposer import SeqState
from tests.conftest import greedy, local_engine, tiny_config
from tests.test_policy import _budget_at
from tests.test_scheduler import _prefill_all
from workers.runner import _behind, _catchup

DRAFTS = TimeModel(version=1, b0=1.0, b1=0.1, n_knots=(1.0, 8.0), n_ms=(0.3, 0.6), h_ms=(0.2, 0.5))


def test_the_cost_per_catch_up_token_is_the_slope_past_the_steady_draft_time():
    rng = np.random.default_rng(1)
    n = rng.integers(1, 9, 40).astype(np.float64)
    steps = rng.integers(1, 5, 40).astype(np.float64)
    tokens = n * SWEEP_CATCHUP + rng.integers(20, 400, 40)
    ms = DRAFTS.draft_ms_at(n, steps) + 0.03 * (tokens - SWEEP_CATCHUP * n)
    assert catchup_ms(DRAFTS, n, steps, tokens, ms) == pytest.approx(0.03, rel=1e-9)
    few = slice(0, CATCHUP_MIN_SAMPLES - 1)
    assert catchup_ms(DRAFTS, n[few], steps[few], tokens[few], ms[few]) is None
    # faster than a steady step (a quiet stretch of the machine): no negative price
    assert catchup_ms(DRAFTS, n, steps, tokens, DRAFTS.draft_ms_at(n, steps) * 0.5) == 0.0


def test_the_registry_prices_catch_up_from_the_steps_that_paid_it_and_remembers_it():
    sweep = [StepSample(n, q * n, q * n * 100, 1.0 + 0.1 * q * n + 1e-5 * q * n * 100, 0, 0.0)
             for n in (1, 2, 4, 8) for q in (1, 2, 4)]
    sweep += [StepSample(n, 0, 0, 0.0, m, DRAFTS.draft_ms(n, m), catchup_tokens=n * SWEEP_CATCHUP)
              for n in (1, 2, 4, 8) for m in (1, 3)]
    reg = ProfileRegistry(refit_every=10**6, sweep=sweep)
    reg.seed(sweep)
    assert reg.model.catchup_ms == 0.0  # nothing has caught up on more than a steady step yet

    def step(n: int, catchup: int) -> StepSample:
        fitted = reg.model.draft_ms(n, 2) + 0.025 * max(catchup - SWEEP_CATCHUP * n, 0)
        return StepSample(n, 3 * n, 300 * n, reg.model.validate_ms_from(3 * n, 300 * n), 2, fitted,
                          catchup_tokens=catchup)

    steady = [step(n, 3 * n) for n in (1, 2, 4) for _ in range(30)]
    behind = [step(n, STEADY_CATCHUP * n + 40 * i) for n in (1, 2) for i in range(1, 6)]
    reg.add(steady + behind)
    assert reg.refit().model.catchup_ms == pytest.approx(0.025, rel=0.05)
    # one-offs of another kind (a draft right after a calibration batch) are not catch-ups
    reg.add([s._replace(draft_ms=s.draft_ms * 3, one_off=1) for s in behind] * 4)
    assert reg.refit().model.catchup_ms == pytest.approx(0.025, rel=0.05)
    reg.add([steady[0]] * WINDOW)  # the window holds no catch-up any more: the last measure stays
    assert reg.refit().model.catchup_ms == pytest.approx(0.025, rel=0.05)


def test_until_its_steps_measure_it_the_registry_prices_catch_up_as_the_sweep_did():
    """The startup sweep's long catch-ups (one row, as a stand-down probe's) price a catch-up token
    in the first model, against the sweep's own draft times; the online window's measure replaces
    it, and once measured online, a window without catch-ups keeps that measure, not the sweep's."""
    sweep = [StepSample(n, q * n, q * n * 100, 1.0 + 0.1 * q * n + 1e-5 * q * n * 100, 0, 0.0)
             for n in (1, 2, 4, 8) for q in (1, 2, 4)]
    sweep += [StepSample(n, 0, 0, 0.0, m, DRAFTS.draft_ms(n, m), catchup_tokens=n * SWEEP_CATCHUP)
              for n in (1, 2, 4, 8) for m in (1, 3)]
    sweep += [StepSample(1, 0, 0, 0.0, 1, DRAFTS.draft_ms(1, 1) + 0.04 * (c - SWEEP_CATCHUP), catchup_tokens=c)
              for c in (32, 64, 128, 256)]
    reg = ProfileRegistry(refit_every=10**6, sweep=sweep)
    assert reg.seed(sweep).model.catchup_ms == pytest.approx(0.04, rel=0.02)
    assert reg.model.draft_ms(1, 1) == pytest.approx(DRAFTS.draft_ms(1, 1), rel=0.02)  # steady draft times apart

    def step(n: int, catchup: int, per_token: float) -> StepSample:
        fitted = reg.model.draft_ms(n, 2) + per_token * max(catchup - SWEEP_CATCHUP * n, 0)
        return StepSample(n, 3 * n, 300 * n, reg.model.validate_ms_from(3 * n, 300 * n), 2, fitted,
                          catchup_tokens=catchup)

    steady = [step(n, 3 * n, 0.0) for n in (1, 2, 4) for _ in range(30)]
    reg.add(steady)
    assert reg.refit().model.catchup_ms == pytest.approx(0.04, rel=0.02)  # none online yet: the sweep's
    reg.add([step(n, STEADY_CATCHUP * n + 40 * i, 0.01) for n in (1, 2) for i in range(1, 6)])
    assert reg.refit().model.catchup_ms == pytest.approx(0.01, rel=0.05)
    reg.add([steady[0]] * WINDOW)
    assert reg.refit().model.catchup_ms == pytest.approx(0.01, rel=0.05)


def test_switch_cost_spreads_each_rows_catch_up_over_what_it_may_still_emit():
    k = 3
    assert switch_cost([1, k + 1], [10, 10], k) == 0.0  # no further behind than a steady step
    assert switch_cost([k + 1 + 50, 2], [100, 1], k) == pytest.approx(0.5)
    assert switch_cost([k + 1 + 50, k + 1 + 30], [None, 0], k) == pytest.approx(30.0)  # None: not known


def _policy(rate: float = 0.6, k: int = 4) -> SpecPolicy:
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=k, adaptive=AdaptiveConfig(enabled=True)))
    rng = np.random.default_rng(0)
    for _ in range(400):  # every position accepted at `rate`
        accepted = 0
        while accepted < k and rng.random() < rate:
            accepted += 1
        policy.observe(np.full((1, k), 0.5), np.full((1, k), 0.2), np.array([k]), np.array([accepted]))
    policy.probes.hold()
    return policy


def _budget_by_the_formula(policy: SpecPolicy, tm: TimeModel, kv: list[int], k: int, per_token: float) -> int:
    """The draft budget's argmax, every term computed afresh (tests/test_policy.py), each token
    the step emits a row charged per_token ms more where it drafts."""
    return _budget_at(policy, tm, len(kv), k, tm.b2 * float(sum(kv)), per_token)


@pytest.mark.parametrize("n", [1, 4])
def test_a_step_that_switches_into_drafting_pays_its_share_of_the_catch_up(n):
    """A row far behind with few tokens left stands the step down where a steady step drafts;
    with a long way left it drafts as before; a steady batch is asked nothing it would not need."""
    k, kv = 4, [100] * n
    policy = _policy(k=k)
    tm = policy.models[policy.install(dataclasses.replace(DRAFTS, b0=3.0, o0=0.15, o1=0.01, catchup_ms=0.03))]
    steady = _budget_by_the_formula(policy, tm, kv, k, 0.0)
    assert steady >= 1

    def begin(behind: list[int], left: list[int]):
        asked = []
        step = policy.begin_step("adaptive", list(kv), [k] * n, tm.version, k, None,
                                 lambda kk: asked.append(kk) or switch_cost(behind, left, kk))
        return step, asked

    step, asked = begin([2] * n, [50] * n)  # every row steady
    assert step.best_m == steady and (not isinstance(step, OneRowStep)) == (n > 1)
    for behind, left in (([300] + [2] * (n - 1), [5] * n), ([300] + [2] * (n - 1), [10**6] * n)):
        step, asked = begin(behind, left)
        per_token = tm.catchup_ms * switch_cost(behind, left, k)
        assert not isinstance(step, OneRowStep) and asked and set(asked) == {k}
        assert step.best_m == _budget_by_the_formula(policy, tm, kv, k, per_token)
    down = begin([300] * n, [5] * n)[0]
    assert down.best_m == 0 and down.wants == steady  # a long catch-up for five tokens: plain, where it would draft
    assert begin([300] * n, [10**6] * n)[0].best_m == steady  # ... for a long request: paid once, drafts
    unpriced = policy.models[policy.install(dataclasses.replace(tm, version=tm.version + 1, catchup_ms=0.0))]
    asked = []
    step = policy.begin_step("adaptive", list(kv), [k] * n, unpriced.version, k, None,
                             lambda kk: asked.append(kk) or 1e9)
    assert step.best_m == steady and not asked  # nothing priced: never asked


def test_a_switch_is_priced_over_how_long_drafting_has_lasted_of_late():
    """Stretches of steps whose budget would draft: the ended ones' tokens a row, weighted, and the
    open one's, over the ended ones' weight; the horizon spreads a catch-up where it is shorter
    than what a row may still emit."""
    d = STRETCH_DECAY
    st = DraftStretches()
    assert st.horizon() is None
    st.end()  # nothing open: nothing ends
    st.extend(2.5)
    st.extend(7.5)
    assert st.horizon() is None  # none ended yet: no bound
    st.end()
    assert st.horizon() == pytest.approx(10.0)
    st.extend(30.0)
    st.end()
    assert st.horizon() == pytest.approx((10.0 * d + 30.0) / (d + 1.0))
    st.extend(100.0)  # a stretch going on counts already: a long one lifts the horizon before it ends
    assert st.horizon() == pytest.approx((10.0 * d + 30.0 + 100.0) / (d + 1.0))
    k = 3
    assert switch_cost([k + 1 + 50], [100], k, horizon=25.0) == pytest.approx(2.0)
    assert switch_cost([k + 1 + 50], [100], k, horizon=200.0) == pytest.approx(0.5)
    assert switch_cost([k + 1 + 50], [None], k, horizon=25.0) == pytest.approx(2.0)
    assert switch_cost([k + 1], [1], k, horizon=1.0) == 0.0


def test_the_runner_learns_how_long_drafting_lasts_from_its_own_steps():
    """Steps whose budget would draft extend the stretch by a row's tokens, drafted or, where the
    row's catch-up or a plain probe said no, plain (one); the first step whose budget would not
    draft ends it; and the horizon reaches the price of a row's catch-up. The step's end hands
    the policy what its draft caught up on (a probe's back-off prices it: policy.probe_price)."""
    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=3",
                                      "speculative.adaptive.enabled=true"))
    try:
        engine.set_mode("adaptive")
        runner = engine.workers.worker.runner
        policy, begin = runner.policy, runner.policy.decide_step
        phase, priced = ["plain"], []

        def steps(mode, kv, max_keep, version, k, oracle=None, catchup=None, record=None):
            if catchup is not None:
                priced.append(catchup(k))
            if phase[0] == "plain":
                return PlainStep(policy, policy.model(version), kv, max_keep, k)
            step = begin("static", kv, max_keep, version, k)  # drafts k for every row
            step.wants = 1  # as if the adaptive budget had chosen it
            if phase[0] == "plain probe":
                step.budget = 0
            return step

        policy.decide_step = steps  # the runner's entry (after held_plain)
        ended, end = [], policy.end_step
        policy.end_step = lambda *a: ended.append(a[5:]) or end(*a)
        for _ in range(2):
            engine.add_request("The capital of France is Paris. The capital of Italy is", greedy(60))
        engine.step()  # the prefills
        for _ in range(8):
            engine.step()
        stretches = runner.stretches
        assert stretches.open == 0.0 and stretches.horizon() is None
        phase[0] = "draft"
        emitted = [sum(len(u.new_token_ids) for u in engine.step()) for _ in range(3)]
        assert stretches.open == pytest.approx(sum(emitted) / 2) and max(emitted) > 2
        phase[0] = "plain probe"
        engine.step()
        assert stretches.open == pytest.approx(sum(emitted) / 2 + 1.0) and stretches.horizon() is None
        phase[0] = "plain"
        for _ in range(6):
            engine.step()
        horizon = sum(emitted) / 2 + 1.0
        assert stretches.open == 0.0 and stretches.horizon() == pytest.approx(horizon)
        rows = list(runner.seqs.values())
        left = [60 - (len(s.tokens) - s.prompt_len) for s in rows]
        assert min(left) > horizon
        behind = [_behind(s) for s in rows]
        del priced[:], ended[:]
        phase[0] = "draft"  # every row drafts, catching up first on all it emitted since it last drafted
        engine.step()
        assert ended == [(sum(behind),)], (ended, behind)
        assert priced == [pytest.approx(switch_cost(behind, left, 3, horizon))]
        assert priced[0] > switch_cost(behind, left, 3) > 0.0
    finally:
        engine.shutdown()


def test_the_runner_and_the_scheduler_say_how_far_behind_each_row_is_and_what_it_may_still_emit():
    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_prefill_tokens=64, num_spec=3, max_model_len=40)
    for i, most in ((0, 64), (1, 8)):
        s.add(Sequence(i, f"r{i}", 0, list(range(1, 11)), RequestParams(max_tokens=most), SamplingParams()))
    _prefill_all(s)  # each prompt of 10 and its first token
    plan, _ = s.schedule()
    assert [p.left for p in plan.seqs] == [40 - 11, 8 - 1]  # max_model_len, then max_tokens
    rows = [SeqState(0, list(range(30)), [], draft_len=4), SeqState(1, list(range(12)), [], draft_len=11)]
    step = StepPlan(1, [SeqPlan(0, [], left=29), SeqPlan(1, [], left=None)], decode=True)
    assert _catchup(rows, step, 3)(3) == pytest.approx((26 - 4) / 29)
    rows[0].prompt_len = 20  # a prompt the draft never saw is not counted: only what the row emitted since
    assert _catchup(rows, step, 3)(3) == pytest.approx((10 - 4) / 29)
    assert _catchup(rows[1:], StepPlan(1, step.seqs[1:], decode=True), 3) is None  # one row, steady: not asked
    # the row a stand-down probe drafts for: least to catch up on, its prompt's included (what its draft runs over)
    behind = _catchup(rows, step, 3)
    assert behind.least_lag() == 1 and behind.cheapest(0) == 1
    rows.append(SeqState(2, list(range(12)), [], draft_len=11))  # as cheap: the first from the turning row on
    assert [_catchup(rows, step, 3).cheapest(start) for start in range(3)] == [1, 1, 2]


def test_a_new_sequence_is_behind_by_what_it_emitted_not_by_its_prompt():
    """After its prefill a sequence's draft never saw its prompt; the price counts only what it
    emitted since (here the first token), so a new request is not charged its prompt's catch-up."""
    engine = local_engine(tiny_config("parallel.tp_size=1"))
    try:
        engine.add_request(list(range(5, 45)), greedy(8))
        engine.step()  # the prefill, and the first token
        (seq,) = engine.workers.worker.runner.seqs.values()
    finally:
        engine.shutdown()
    assert seq.prompt_len == 40 and len(seq.tokens) == 41 and _behind(seq) == 1
