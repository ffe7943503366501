"""Speculation control without a model: the calibrator's bookkeeping, the draft budget,
and probe steps backing off while drafting does not pay."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from controller.config import AdaptiveConfig, SpeculativeConfig
from controller.estimators import HALVE_AT, NUM_BUCKETS, PRIOR_WEIGHT, Calibrator
from controller.pending import stacked as _stacked
from controller.policy import COLD_TRIALS, SpecPolicy
from controller.probes import PLAIN_EVERY, PLAIN_RUN, PROBE_EVERY, PROBE_MAX_EVERY
from controller.samples import SETTLE_STEPS
from controller.one_row_step import OneRowStep
from controller.stand_down import PlainStep
from controller.step import EXPLORE_EVERY
from controller.time_model import TimeModel
from controller.yields import batch_bucket
from tests.conftest import teach


def test_calibrator_counts_trials_and_hits_by_position_and_bucket():
    cal = Calibrator(k=3)
    # verified 3 drafts, accepted 1: position 0 a hit, position 1 a miss, position 2 never reached
    cal.update(np.array([[0.9, 0.5, 0.2]]), np.array([3]), np.array([1]))
    b = Calibrator.buckets(np.array([0.9, 0.5, 0.2]))
    assert cal.trials[0, b[0]] == 1 and cal.hits[0, b[0]] == 1
    assert cal.trials[1, b[1]] == 1 and cal.hits[1, b[1]] == 0
    assert cal.trials[2].sum() == 0 and cal.trials.sum() == 2
    # an unverified position is no trial, whatever was accepted before it
    cal.update(np.array([[0.9, 0.5, 0.2]]), np.array([1]), np.array([1]))
    assert cal.trials[1].sum() == 1


def test_calibrator_moves_from_its_prior_to_what_it_sees():
    cal = Calibrator(k=1)
    top = np.array([[0.05]])  # bucket of log-odds -2.94: prior estimate = its centre, near 0.05
    b = int(cal.buckets(top)[0, 0])
    prior = cal.centers[b]
    assert 0 < b < NUM_BUCKETS - 1 and 0.03 < prior < 0.08
    assert cal.buckets(np.array([[0.001, 0.999]])).tolist() == [[0, NUM_BUCKETS - 1]]
    assert np.isclose(cal.estimate(top)[0, 0], prior)
    for _ in range(200):  # the draft is always right even though it is unsure
        cal.update(top, np.array([1]), np.array([1]))
    assert np.isclose(cal.estimate(top)[0, 0], (200 + PRIOR_WEIGHT * prior) / (200 + PRIOR_WEIGHT))
    for _ in range(HALVE_AT):  # old evidence is halved once a bucket holds HALVE_AT trials
        cal.update(top, np.array([1]), np.array([0]))
    assert cal.trials[0, b] < HALVE_AT and cal.estimate(top)[0, 0] < 0.2


def test_logistic_learns_an_under_confident_draft():
    """A draft whose top probability understates acceptance (0.05 said, 90% accepted at
    position 0; 0.6 said, 20% accepted at position 1): within a few hundred steps the
    online Newton fit says so, per position."""
    from controller.estimators import LogisticCalibrator

    rng = np.random.default_rng(0)
    cal = LogisticCalibrator(k=2)
    top, margin = np.array([[0.05, 0.6]]), np.array([[0.01, 0.3]])
    assert np.allclose(cal.estimate(top, margin), 0.5)  # it starts at 0.5, whatever the draft says
    for _ in range(400):
        first = rng.random() < 0.9
        accepted = (1 + (rng.random() < 0.2)) if first else 0
        cal.update(top, margin, np.array([2]), np.array([accepted]))
    est = cal.estimate(top, margin)[0]
    assert abs(est[0] - 0.9) < 0.05 and abs(est[1] - 0.2) < 0.07


def test_logistic_tells_drafts_apart_by_their_margin():
    """Same top probability, different margins to the second choice: a wide margin is
    accepted 85% of the time, a narrow one 25%. Top probability alone cannot tell them
    apart; with the margin the fit ranks them."""
    from controller.estimators import LogisticCalibrator

    rng = np.random.default_rng(1)
    cal = LogisticCalibrator(k=1)
    top = np.full((64, 1), 0.4)
    for _ in range(60):
        margin = np.where(rng.random((64, 1)) < 0.5, 0.3, 0.01)
        accepted = (rng.random(64) < np.where(margin[:, 0] > 0.1, 0.85, 0.25)).astype(np.int64)
        cal.update(top, margin, np.ones(64, dtype=np.int64), accepted)
    wide, narrow = cal.estimate(top[:2], np.array([[0.3], [0.01]]))[:, 0]
    assert abs(wide - 0.85) < 0.05 and abs(narrow - 0.25) < 0.05
    column = cal.estimate_column([0.4, 0.4], [0.3, 0.01], 0)  # the small path agrees with the array one
    assert np.allclose(column, [wide, narrow], atol=1e-12)


def test_logistic_survives_a_long_run_of_identical_drafts():
    """A stream where every draft looks the same (a sure draft: top probability 1, margin 1,
    as a repetition loop gives) for longer than the evidence's memory. Its curvature has
    rank 1; once the earlier, varied evidence has faded the Newton step's matrix was
    singular and the update raised, which stopped the engine. It must stay solvable, and
    the estimate must still follow what was observed."""
    from controller.estimators import LogisticCalibrator

    rng = np.random.default_rng(2)
    cal = LogisticCalibrator(k=1)
    for _ in range(20):  # varied evidence first
        cal.update(rng.random((32, 1)), rng.random((32, 1)) * 0.5, np.ones(32, dtype=np.int64),
                   (rng.random(32) < 0.6).astype(np.int64))
    sure = np.ones((32, 1))
    for _ in range(40):  # then 40 batches of 20,000 steps each of identical, accepted drafts
        cal.update(sure, sure, np.ones(32, dtype=np.int64), np.ones(32, dtype=np.int64), steps=20_000)
    assert np.isfinite(cal.w).all()
    assert cal.estimate(sure, sure)[0, 0] > 0.9


def test_logistic_holds_after_a_cold_start_and_a_large_batch():
    """A cold start's single drafts (some standing for 8 unverified ones), then a batch of
    512 drafts, 75% of them accepted, whatever their top probability says. A full Newton
    step from the cold start's estimates overshot: a served engine's weights went to
    [14.0, -67.1, 18.7, 13.9] and its estimates to 0 for most drafts, and batch 1 stood
    down for good. Damped, the estimates on fresh drafts of the same kind average 0.75 and
    none is near 0."""
    from controller.estimators import LogisticCalibrator

    for seed in range(10):
        rng = np.random.default_rng(seed)

        def batch(n):
            top = np.exp(rng.uniform(np.log(0.01), np.log(0.5), (n, 1)))
            margin = top * rng.uniform(0.02, 1.0, (n, 1))
            return top, margin, np.ones(n, dtype=np.int64), (rng.random(n) < 0.75).astype(np.int64)

        cal = LogisticCalibrator(k=1)
        for _ in range(6):
            cal.update(*batch(2), weights=np.array([[1.0], [8.0]]))
        cal.update(*batch(512), steps=240, weights=np.where(rng.random((512, 1)) < 0.2, 8.0, 1.0))
        top, margin, _, _ = batch(2000)
        est = cal.estimate(top, margin)[:, 0]
        assert abs(est.mean() - 0.75) < 0.08 and est.min() > 0.2, (seed, cal.w[0].tolist())


def _policy(k: int = 4, **adaptive) -> SpecPolicy:
    return SpecPolicy(SpeculativeConfig(num_speculative_tokens=k, adaptive=AdaptiveConfig(enabled=True, **adaptive)))


def _budget(policy: SpecPolicy, model: TimeModel, n: int = 4, k: int = 4) -> int:
    policy.install(model)
    step = policy.begin_step("adaptive", np.full(n, 100), np.full(n, k), model.version, k)
    policy.end_step(step, np.zeros((n, 0)), np.zeros((n, 0)), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
    return step.budget


def _finish(policy: SpecPolicy, step, accept) -> None:
    """End `step` as the engine would, every draft it made read at top probability 0.5 and margin
    0.3; accept(keep) -> the drafts each row got accepted of the `keep` it verified."""
    m = step.budget
    if not m:
        policy.end_plain_step(step)
        return
    n = len(step.kv)
    top, margin = np.full((n, m), 0.5), np.full((n, m), 0.3)
    keep = np.array(step.keep(top, top, margin, None))
    width = int(keep.max())
    policy.end_step(step, top[:, :width], margin[:, :width], keep, np.asarray(accept(keep)))


def _teach(policy: SpecPolicy, rate: float, k: int = 4) -> None:
    """Every position accepted at `rate` (conditional), seen 600 times (no longer cold)."""
    teach(policy, rate, k)
    assert not policy.cold


def test_the_draft_slab_lends_rows_in_order_until_the_calibration_batch_takes_them_back():
    """draft_row: a step's k rows after the last step's, None once they would not fit; the
    calibration batch, which reads every step's drafts where they lie, frees them all."""
    policy = _policy(4)
    rows = policy.draft_slab.shape[1]
    assert [policy.draft_row(4) for _ in range(3)] == [0, 4, 8]
    policy._slab_used = rows - 3
    assert policy.draft_row(4) is None and policy.draft_row(3) == rows - 3
    policy._flush()
    assert policy.draft_row(2) == 0


def test_a_calibration_batch_lines_up_each_steps_drafts_and_weighs_what_only_exploration_verified():
    """The steps' (n_i, w_i) inputs, one row per sequence-step: zeros and ones past a step's
    width; a draft at or past what the rule chose counts EXPLORE_EVERY times (exploration's)."""
    top_a = np.array([[0.1, 0.2, 0.3, 0.9, 0.5], [0.4, 0.5, 0.6, 0.9, 0.5]])[:, :4]  # a strided view, as the runner's
    pending = [(top_a, top_a + 0.01, None, None, [1, 3], 3),  # 4 drafted, 3 at most verified: row 0's rule kept 1
               (np.array([[0.7]]), np.array([[0.8]]), None, None, None, 1),  # static: every draft counts once
               (np.array([[0.2, 0.3]]), np.array([[0.25, 0.35]]), None, None, np.array([0]), 2)]
    top, margin, weights = _stacked(pending)
    assert top.tolist() == [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.0, 0.0], [0.2, 0.3, 0.0]]
    assert np.allclose(margin, [[0.11, 0.21, 0.31], [0.41, 0.51, 0.61], [0.8, 1, 1], [0.25, 0.35, 1]])
    e = float(EXPLORE_EVERY)
    assert weights.tolist() == [[1, e, e], [1, 1, 1], [1, 1, 1], [e, e, 1]]


def test_a_calibration_batch_joins_each_steps_values_whatever_they_hold():
    """joined: the steps' per-sequence values end to end as int64, from short lists (batch 1),
    long ones (a large batch's, through bytes: values past 0..255 and negative ones too) and
    arrays, mixed."""
    from controller.pending import BYTES_FROM, joined

    rng = np.random.default_rng(5)
    long = [rng.integers(0, 8, BYTES_FROM + 40).tolist() for _ in range(3)]
    cases = [[[1], [0], [7]], long, long + [[256] * (BYTES_FROM + 1)], long + [[-1] * (BYTES_FROM + 1)],
             [np.array([3, 4]), [5] * (BYTES_FROM + 2)], [rng.integers(0, 300, 100) for _ in range(2)]]
    for parts in cases:
        got = joined(parts)
        assert got.dtype == np.int64 and got.tolist() == [int(v) for p in parts for v in p]


def test_draft_budget_follows_acceptance_and_cost():
    cheap_drafts = TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0)
    costly_drafts = TimeModel(version=2, b0=5.0, b1=0.1, d0=50.0, d1=0.0)
    good, bad = _policy(), _policy()
    _teach(good, 0.95)
    _teach(bad, 0.02)
    good.probes.hold(), bad.probes.hold()  # no probe in these steps
    assert _budget(good, cheap_drafts) == 4  # drafts nearly always accepted and nearly free: all of them
    assert _budget(bad, cheap_drafts) == 0  # drafts never accepted: a plain decode step
    assert _budget(good, costly_drafts) == 0  # a draft step costs ten validations
    static = _policy()
    assert static.begin_step("static", np.full(4, 100), np.full(4, 4), 0, 4).budget == 4


def test_what_a_drafting_step_costs_beyond_its_tokens_can_stand_the_budget_down():
    """The rest of a step that drafts costs o2 + o3 n more than a plain step's, and its validation
    v_drafted more: priced in,
    a budget that drafted where its gain was a few percent stands down; a plain step is not
    charged it (no batch margin: the gain would not clear it)."""
    policy = _policy(batch_draft_margin=0.0)
    _teach(policy, 0.6)
    policy.probes.hold()  # no probe
    plain = TimeModel(version=1, b0=1.0, b1=0.1, d0=0.3, d1=0.0, o0=0.15, o1=0.01)
    assert _budget(policy, plain) >= 1
    for version, extra in enumerate((dict(o2=0.4), dict(o3=0.1), dict(v_drafted=0.4)), start=2):
        costly = dataclasses.replace(plain, version=version, **extra)
        assert _budget(policy, costly) == 0, extra
    assert dataclasses.replace(plain, o2=0.4).other_ms(4) == plain.other_ms(4)


def test_a_batch_drafts_only_past_its_margin_and_batch_1_is_untouched():
    """batch_draft_margin: from two sequences on, a budget must beat the plain step's estimated
    throughput by that fraction; where it drafts with the margin it drafts without it, and as a
    draft step grows dearer the margin stands the batch down first. Batch 1 ignores it."""
    from controller.terms import best_budget_rate

    # one draft step: 1.5 tokens for 1.45 ms against a plain step's 1 token in 1 ms (3.4% better)
    assert [best_budget_rate(1.0, [(1, 1.5, 1.45, 1.5)], 0.0, 1.0, enter=e)[0] for e in (1.0, 1.03, 1.05)] == [1, 1, 0]
    plain, margin = _policy(batch_draft_margin=0.0), _policy(batch_draft_margin=0.1)
    for policy in (plain, margin):
        _teach(policy, 0.7)
        policy.probes.hold()  # no probe
    only_plain = 0
    for version, d0 in enumerate(np.linspace(0.05, 6.0, 60), start=1):
        model = TimeModel(version=version, b0=5.0, b1=0.1, d0=float(d0), d1=0.0)
        assert _budget(plain, model, n=1) == _budget(margin, model, n=1), d0
        with_margin, without = _budget(margin, model), _budget(plain, model)
        assert without or not with_margin, d0
        only_plain += bool(without and not with_margin)
    assert only_plain >= 3, only_plain


def test_probes_back_off_while_drafting_does_not_pay_and_reset_when_it_does():
    policy = _policy()
    policy.probes.plain_every = 10**9  # plain probes aside (test_one_drafting_step_in_128_runs_plain_in_stretches)
    _teach(policy, 0.02)
    model = TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0)
    assert _budget(policy, model) == 1  # the first adaptive step probes one position past the budget (0)
    assert policy.probes.every_at(4) == 2 * PROBE_EVERY
    steps, probes = 0, policy.probes.probes
    while policy.probes.every_at(4) < PROBE_MAX_EVERY:
        _budget(policy, model)
        steps += 1
    assert policy.probes.probes - probes == int(np.log2(PROBE_MAX_EVERY // PROBE_EVERY)) - 1
    assert steps == sum(PROBE_EVERY * 2 ** i for i in range(1, int(np.log2(PROBE_MAX_EVERY // PROBE_EVERY))))
    _teach(policy, 0.95)  # drafting pays again: the next probe brings the interval back
    for _ in range(PROBE_MAX_EVERY):
        _budget(policy, model)
    assert policy.probes.every_at(4) == PROBE_EVERY and _budget(policy, model) == 4


def test_a_dear_probe_backs_off_by_its_price():
    """A stand-down probe whose row first catches up on 300 tokens costs several plain steps: the
    interval it backs off to is the doubled one times that price (its draft forward, 0.05 ms, and
    300 catch-up tokens past a steady step's 2 at 0.1 ms, over a plain step's 5 + 16 * 0.1 ms), so
    the bucket's probes keep to the same share of its time; a probe no dearer than a plain step
    just doubles it, and one that finds drafting pays starts it over. Batch 1 only doubles."""
    policy, n = _policy(), 16
    policy.probes.plain_every = 10**9
    _teach(policy, 0.02)
    model = TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0, catchup_ms=0.1)
    policy.install(model)
    price = (0.05 + 0.1 * 300) / (5.0 + 0.1 * n)

    def probe(catchup_tokens: int, pays: bool = False) -> None:
        policy.probes.last = [-10**6] * len(policy.probes.last)  # the next step probes
        step = policy.begin_step("adaptive", np.full(n, 100), np.full(n, 4), 1, 4)
        assert step.probe and (step.best_m > 0) == pays and step.budget == (4 if pays else 1)
        top = np.full((n, step.budget), 0.001)
        keep = np.array(step.keep(top, top, top / 2, None))
        policy.end_step(step, top, top / 2, keep, keep, catchup_tokens)

    probe(302)
    assert policy.probes.every_at(n) == math.ceil(2 * PROBE_EVERY * price) > 8 * PROBE_EVERY
    probe(302)
    assert policy.probes.every_at(n) == math.ceil(4 * PROBE_EVERY * price)
    probe(2)  # no catch-up past a steady step's: cheaper than a plain step, the interval doubles
    assert policy.probes.every_at(n) == 8 * PROBE_EVERY
    for _ in range(30):
        probe(2000)
    assert policy.probes.every_at(n) == PROBE_MAX_EVERY
    _teach(policy, 0.95)
    policy._flush()
    probe(2000, pays=True)  # drafting pays: the interval starts over, whatever the probe cost
    assert policy.probes.every_at(n) == PROBE_EVERY
    # batch 1 backs off by doubling alone, however far behind its row (where drafting pays most)
    alone = _policy()
    alone.probes.plain_every = 10**9
    _teach(alone, 0.02)
    alone.install(dataclasses.replace(model, b0=0.5))
    step = alone.begin_step("adaptive", [100], [4], 1, 4)
    assert step.probe and step.best_m == 0 and step.budget == 1
    top = np.full((1, 1), 0.001)
    alone.end_step(step, top, top / 2, [1], [1], 302)
    assert alone.probes.every_at(1) == 2 * PROBE_EVERY


def test_one_drafting_step_in_128_runs_plain_in_stretches():
    """A plain probe: of the adaptive steps that would draft, one in PLAIN_EVERY runs plain, the
    last PLAIN_RUN of every PLAIN_EVERY * PLAIN_RUN in a row, so the time model sees what a plain
    step costs beside a drafting one, and once it has settled after drafting (the stretch's
    last steps); a batch that stands down has none (nothing to stand down from)."""
    policy = _policy()
    _teach(policy, 0.95)
    policy.probes.last = [10**9] * len(policy.probes.last)  # no stand-down probe in these steps
    model = TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0)
    period = PLAIN_EVERY * PLAIN_RUN
    budgets = [_budget(policy, model) for _ in range(3 * period)]
    assert [i for i, b in enumerate(budgets) if b == 0] == [p * period - PLAIN_RUN + j for p in (1, 2, 3)
                                                            for j in range(PLAIN_RUN)]
    assert set(budgets) == {0, 4} and policy.probes.plain == 3 * PLAIN_RUN and PLAIN_RUN > SETTLE_STEPS
    down = _policy()
    _teach(down, 0.02)  # drafting does not pay: no step would draft
    down.probes.last = [10**9] * len(down.probes.last)
    assert all(_budget(down, model) == 0 for _ in range(2 * period)) and down.probes.plain == 0


@pytest.mark.parametrize("n", [1, 4])
def test_plain_probes_come_more_often_until_the_time_model_has_priced_a_plain_step(ops, n):
    """Under a time model that has not priced a plain step from settled plain steps of its own
    (plain_measured False: a young engine whose batch drafts at nearly every step) the plain
    probes' stretches come YOUNG_SHARE times as often, at batch 1 (its OneRow) and above; under a
    measured model as before."""
    from controller.probes import YOUNG_SHARE

    period = PLAIN_EVERY // YOUNG_SHARE * PLAIN_RUN
    for measured in (False, True):
        policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=4, adaptive=AdaptiveConfig(enabled=True)), ops)
        _teach(policy, 0.95)
        policy.cold_alone = False
        policy.probes.last = [10**9] * len(policy.probes.last)  # no stand-down probe in these steps
        model = TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0, plain_measured=measured)
        budgets = [_budget(policy, model, n=n) for _ in range(3 * period)]
        plain = [i for i, b in enumerate(budgets) if b == 0]
        if measured:
            assert plain == [], n
        else:
            assert plain == [p * period - PLAIN_RUN + j for p in (1, 2, 3) for j in range(PLAIN_RUN)], n


def test_probes_back_off_per_batch_size():
    """A load that moves between one sequence (drafting pays there) and eight (it does not), a
    tenth of its steps at eight: the steps at eight back off their probes as if the steps at one
    were not there, counting only their own steps, and the steps at one draft throughout (but
    for their plain probes)."""
    policy = _policy()
    _teach(policy, 0.8)
    model = TimeModel(version=1, b0=1.0, b1=0.5, d0=0.2, d1=0.0)  # validation dear: drafting pays at 1, not at 8
    probes_at_8, budgets_at_1 = 0, []
    for _ in range(20):
        for _ in range(90):
            budgets_at_1.append(_budget(policy, model, n=1))
        for _ in range(10):
            before = policy.probes.probes
            _budget(policy, model, n=8)
            probes_at_8 += policy.probes.probes - before
    # ... but for the plain probes: one in PLAIN_EVERY steps that would draft and are no probe, in stretches (those
    # at eight would not draft)
    period = PLAIN_EVERY * PLAIN_RUN  # (the last PLAIN_RUN of every period)
    stretches = sum((i + PLAIN_RUN - 1) % period < PLAIN_RUN for i in range(1, policy.probes.drafting + 1))
    assert sum(b == 0 for b in budgets_at_1) == policy.probes.plain == stretches >= PLAIN_RUN
    assert min(b for b in budgets_at_1 if b) >= 2
    # 200 steps at eight: probes at their steps 1, 65 and 193 (counted among all 2000 adaptive steps, the
    # interval passed at nearly every stretch at eight early on: 5 probes)
    assert probes_at_8 == 3 and policy.probes.every_at(8) == 8 * PROBE_EVERY, probes_at_8
    assert policy.probes.every_at(1) == PROBE_EVERY


def test_a_cold_start_at_batch_1_learns_that_drafting_pays_within_its_first_steps():
    """Drafts accepted 80% of the time, a time model under which that pays at batch 1 and the
    prior's 50% does not (the engine's own after a refit). Cold, every step probes and its
    outcomes reach the rates at once: the budget drafts within the first 100 steps and keeps
    drafting. Probing on the usual schedule, the rates kept their prior for 256 steps (the
    calibration batch) while the probes backed off, and the budget stood down throughout."""
    k, rng = 7, np.random.default_rng(3)
    policy = _policy(k)
    model = TimeModel(version=1, b0=0.79, b1=0.06, b2=1.6e-4, d0=0.37, d1=0.053, o0=0.093, o1=0.093)
    policy.install(model)
    drafting, cold_probes = [], []
    for _ in range(600):
        cold = policy.cold
        step = policy.begin_step("adaptive", np.array([300]), np.array([k]), 1, k)
        drafting.append(step.best_m > 0)
        if cold:
            cold_probes.append(step.probe)
        m = step.budget
        top, margin = np.full((1, m), 0.5), np.full((1, m), 0.3)
        keep = np.array(step.keep(top, top, margin, None)) if m else np.zeros(1, dtype=np.int64)
        accepted = 0
        while accepted < keep[0] and rng.random() < 0.8:
            accepted += 1
        width = int(keep.max())
        policy.end_step(step, top[:, :width], margin[:, :width], keep, np.array([accepted]))
    assert not drafting[0]  # the prior: drafting does not pay
    assert sum(drafting[100:200]) >= 95 and sum(drafting[200:]) >= 380, (sum(drafting[100:200]), sum(drafting[200:]))
    assert not policy.cold and abs(policy.next_rates[0] - 0.8) < 0.1
    assert len(cold_probes) > 2 and all(cold_probes)  # every cold step probed


def test_a_cold_start_outlasts_one_request_s_poor_drafts():
    """Batch 1 alone: the first request's drafts, 80 of them, accepted 45% of the time and
    every later one 80%, under a time model where 80% pays and 45% does not. A cold start
    ended on that one request's sample (64 first drafts) stood batch 1 down for good: its
    stand-down probes, one draft each, backed off before they could move the rates (in an
    engine: 71 first drafts, 68% accepted, and 83 drafting steps in its first round, where
    static-3's drafted 5,240). Spanning several requests' drafts, it learns the workload's rate."""
    k, rng = 3, np.random.default_rng(3)
    policy = _policy(k)
    policy.install(TimeModel(version=1, b0=0.79, b1=0.06, b2=1.6e-4, d0=0.37, d1=0.053, o0=0.093, o1=0.093))
    drafting, trials = [], [0]

    def accept(keep):
        rate, accepted = 0.45 if trials[0] < 80 else 0.8, 0
        trials[0] += int(keep[0] > 0)
        while accepted < keep[0] and rng.random() < rate:
            accepted += 1
        return [accepted]

    for _ in range(1500):
        step = policy.begin_step("adaptive", [300], [k], 1, k)
        drafting.append(step.best_m > 0)
        _finish(policy, step, accept)
    assert sum(drafting[-500:]) >= 450, sum(drafting[-500:])
    assert abs(policy.next_rates[0] - 0.8) < 0.05


def test_batch_1_s_cold_start_probes_no_row_further_behind_than_a_steady_step():
    """Batch 1 still cold: a row no further behind than a steady step (the runner's catchup None)
    probes at every step; one that stood down at a larger batch (the runner's catchup callable:
    the last request of a batch-capped run at eight caught up on 100-140 tokens first) probes on
    the schedule only: its first step, then backing off while its probes find nothing that pays."""
    k, steps = 3, 200
    model = TimeModel(version=1, b0=0.79, b1=0.06, b2=1.6e-4, d0=0.37, d1=0.053, o0=0.093, o1=0.093,
                      catchup_ms=0.013)
    probes = {}
    for behind, catchup in (("steady", None), ("far", lambda k: 117 / 11)):
        policy = _policy(k)
        policy.install(model)
        count = []
        for i in range(steps):
            assert policy.cold_alone
            step = policy.begin_step("adaptive", [300], [k], 1, k, catchup=catchup)
            count += [i] if step.probe else []
            _finish(policy, step, lambda keep: [0])
        probes[behind] = count
    assert probes == {"steady": list(range(steps)), "far": [0, 2 * PROBE_EVERY, 6 * PROBE_EVERY]}, probes


def test_a_cold_start_at_eight_sequences_ends_after_cold_trials_first_drafts():
    """At eight sequences a cold probe's row turns, so COLD_TRIALS first drafts are many
    requests' already: the cold start ends there, not at batch 1's ALONE_COLD_TRIALS (probing
    at every step until then had cost a batch-32 round 4%). Drafts accepted 2% of the time,
    cheap enough that drafting could pay: cold probes, then the backed-off schedule."""
    k, n, rng = 4, 8, np.random.default_rng(5)
    policy = _policy(k)
    policy.install(TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0))
    probes = []
    for _ in range(600):
        step = policy.begin_step("adaptive", [300] * n, [k] * n, 1, k)
        probes.append(step.probe)
        _finish(policy, step, lambda keep: [int(c > 0 and rng.random() < 0.02) for c in keep])
    assert not policy.cold and policy.cold_alone  # (batch 1 would still be cold)
    assert COLD_TRIALS - 8 <= sum(probes[:80]) and sum(probes[80:]) <= 5, (sum(probes[:80]), sum(probes[80:]))


def test_cold_probes_do_not_back_off_the_probe_schedule():
    """Drafts accepted 20% of the time, where drafting could pay only if most were: the cold
    probes (one a step) all find nothing worth drafting, yet the schedule the warm controller
    starts from is still a probe every PROBE_EVERY steps, not one backed off per cold step."""
    k, rng = 4, np.random.default_rng(5)
    policy = _policy(k)
    policy.install(TimeModel(version=1, b0=0.79, b1=0.06, b2=1.6e-4, d0=0.37, d1=0.053, o0=0.093, o1=0.093))
    cold_steps = 0
    while policy.cold:
        step = policy.begin_step("adaptive", np.array([300]), np.array([k]), 1, k)
        assert step.probe and step.best_m == 0
        m = step.budget
        top, margin = np.full((1, m), 0.5), np.full((1, m), 0.3)
        keep = np.array(step.keep(top, top, margin, None))
        accepted = int(keep[0] > 0 and rng.random() < 0.2)
        policy.end_step(step, top[:, :int(keep.max())], margin[:, :int(keep.max())], keep, np.array([accepted]))
        cold_steps += 1
    assert cold_steps >= 32 and policy.probes.every_at(1) == PROBE_EVERY


def test_no_step_probes_where_no_acceptance_could_pay():
    """A draft step dearer than what a whole step of accepted drafts saves: past the cold start
    no step probes (no rate a probe could teach would change the budget, and each stand-down
    probe catches its row up on everything since it last drafted); the schedule counts the
    steps all the same, and a model under which drafting could pay probes again at once.
    During the cold start there is no cold start's probe at every step, but the probes keep
    their schedule (the first adaptive step, then backing off): their first drafts help end it."""
    costly = TimeModel(version=1, b0=5.0, b1=0.1, d0=50.0, d1=0.0)
    cheap = TimeModel(version=2, b0=5.0, b1=0.1, d0=0.05, d1=0.0)
    cold = _policy(4)
    assert not cold.terms.could_pay(costly, 4, 4) and cold.terms.could_pay(cheap, 4, 4)
    probed = [i for i in range(1, 701) if _budget(cold, costly)]
    # the first step, then 64 steps times the probe's price: its 50 ms draft step over a plain step's 5.4 ms
    assert cold.cold and probed == [1, 1 + math.ceil(2 * PROBE_EVERY * 50.0 / 5.4)]
    warm = _policy(4)
    _teach(warm, 0.02)
    assert [_budget(warm, costly) for _ in range(5000)] == [0] * 5000
    assert warm.probes.probes == 0 and warm.probes.steps[batch_bucket(4)] == 5000
    assert _budget(warm, cheap) == 1 and warm.probes.probes == 1  # a stand-down probe: one position


def test_standing_down_where_no_acceptance_could_pay_stays_on_the_fast_path():
    """Where no probe can be due (drafting could not pay were every draft accepted), a stand-down
    holds on begin_step's fast path step after step, answering as the full path does."""
    fast, full = _policy(4), _policy(4)
    costly = TimeModel(version=1, b0=5.0, b1=0.1, b2=1e-3, d0=50.0, d1=0.0)
    for policy in (fast, full):
        _teach(policy, 0.6)
        policy._flush()  # (a calibration batch moves the rates, which ends a stand-down's fast path)
        policy.install(costly)
    held, kinds = None, []
    for i in range(3000):
        full._downs.clear()
        a = fast.begin_step("adaptive", [300] * 4, [4] * 4, 1, 4)
        b = full.begin_step("adaptive", [300] * 4, [4] * 4, 1, 4)
        assert (type(a), a.budget, a.probe) == (type(b), b.budget, b.probe) == (PlainStep, 0, False), i
        fast.end_plain_step(a), full.end_plain_step(b)
        held = held or fast._downs.get(4)
        kinds.append(fast._downs.get(4) is held)
    assert held is not None and held.probe_at == float("inf") and all(kinds)
    assert fast.probes.steps == full.probes.steps and fast.probes.probes == full.probes.probes == 0


def test_a_held_step_counted_at_its_start_is_the_step_ended_as_usual():
    """The runner's held stand-down, its end counted by held_plain (counted=True) and not by
    end_plain_step: over steps that draft, stand down, probe and run calibration batches at two
    batch sizes, every step and the policy's counts are those of begin_step and the usual end."""
    rng = np.random.default_rng(3)
    runner, usual = _policy(4), _policy(4)
    tm = TimeModel(version=1, b0=1.0, b1=0.05, b2=1e-4, d0=0.3, d1=0.01)
    for policy in (runner, usual):
        _teach(policy, 0.7)
        policy.install(tm)
    held = drafted = held_calibrations = 0
    for i in range(3000):
        n = 4 + (i // 7) % 2
        # stretches of drafting, then standing down for longer than a calibration batch's most steps (OBSERVE_MAX)
        kv = [int(c) for c in rng.integers(200, 900, n)] if i % 700 < 60 else [6000] * n
        accepted = rng.integers(0, 5, n)
        before = runner.calibrations
        a = runner.held_plain(kv, [4] * n, 1, 4, counted=True)
        counted = a is not None
        if a is None:
            a = runner.decide_step("adaptive", kv, [4] * n, 1, 4)
        b = usual.begin_step("adaptive", kv, [4] * n, 1, 4)
        assert (type(a), a.budget, a.probe) == (type(b), b.budget, b.probe), i
        held += counted
        drafted += a.budget > 0
        for policy, step, skip in ((runner, a, counted), (usual, b, False)):
            if not skip:
                _finish(policy, step, lambda keep: np.minimum(keep, accepted))
        held_calibrations += counted and runner.calibrations > before
        assert (runner.calibrations, runner._observed, runner.adaptive_steps) == \
               (usual.calibrations, usual._observed, usual.adaptive_steps), i
        assert runner.probes.steps == usual.probes.steps and runner.probes.probes == usual.probes.probes, i
    assert held > 1000 and drafted > 150 and held_calibrations >= 3 and runner.probes.probes > 3, \
        (held, drafted, held_calibrations, runner.probes.probes)


def test_a_stand_down_is_held_for_each_batch_size():
    """Served, a batch's size moves every few steps as requests arrive and finish: each size's
    stand-down is held, so a batch going 4, 5, 4, 5 .. stays on the fast path after a step at
    each size (holding only the last one, every step went the full way), answering as the full
    path does."""
    fast, full = _policy(4), _policy(4)
    costly = TimeModel(version=1, b0=5.0, b1=0.1, b2=1e-3, d0=50.0, d1=0.0)
    for policy in (fast, full):
        _teach(policy, 0.6)
        policy._flush()
        policy.install(costly)
    on_fast_path = []
    for i in range(400):
        n = 4 + i % 2
        held = fast._downs.get(n)
        full._downs.clear()
        a = fast.begin_step("adaptive", [300] * n, [4] * n, 1, 4)
        b = full.begin_step("adaptive", [300] * n, [4] * n, 1, 4)
        assert (type(a), a.budget, a.probe) == (type(b), b.budget, b.probe) == (PlainStep, 0, False), i
        fast.end_plain_step(a), full.end_plain_step(b)
        on_fast_path.append(held is not None and fast._downs.get(n) is held)
    assert on_fast_path[:2] == [False, False] and all(on_fast_path[2:])
    assert fast.probes.steps == full.probes.steps and fast.probes.probes == full.probes.probes == 0


def test_a_stand_down_held_for_k_drafts_holds_as_the_caps_fall():
    """A round's last sequences near their ends, their caps (and the step's k) fall: the
    stand-down held for k drafts answers for fewer, each answer the full path's (which decides
    each k afresh), and no step between goes it."""
    fast, full = _policy(7), _policy(7)
    tm = TimeModel(version=1, b0=1.0, b1=0.05, b2=1e-4, d0=0.3, d1=0.01)
    for policy in (fast, full):
        _teach(policy, 0.7, k=7)
        policy._flush()
        policy.probes.hold()  # no probe
        policy.install(tm)
    at = fast.terms.stand_down_at(tm, 4, 7)
    assert 0.0 < at < np.inf
    kv = [int(at / tm.b2 / 4) + 50] * 4
    full_way, counted0 = [], fast.probes.steps[batch_bucket(4)]
    calls = fast.decide_step
    fast.decide_step = lambda *a, **kw: full_way.append(a[4]) or calls(*a, **kw)
    for i in range(60):
        k = max(7 - i // 3, 1) if i < 40 else 7 - i % 3
        a = fast.held_plain(kv, [k] * 4, 1, k, counted=True)
        counted = a is not None
        if a is None:
            a = fast.decide_step("adaptive", kv, [k] * 4, 1, k)
        full._downs.clear()
        b = full.begin_step("adaptive", kv, [k] * 4, 1, k)
        assert (type(a), a.budget, a.probe) == (type(b), b.budget, b.probe) == (PlainStep, 0, False), (i, k)
        if not counted:
            fast.end_plain_step(a)
        full.end_plain_step(b)
        assert fast.adaptive_steps == full.adaptive_steps and fast.probes.steps == full.probes.steps, i
        assert fast.probes.steps[batch_bucket(4)] == counted0 + i + 1, i  # every step counted
    assert full_way == [7], full_way  # once, at k = 7


@pytest.mark.parametrize("n", [1, 4])
def test_a_time_model_that_prices_everything_at_zero_still_decides(n):
    """A refit on a few samples can price a step at 0 (forced refits every 4 steps at TP=4
    had done so, and the cold start's could_pay divided by it): every adaptive step still
    gets a budget, the same one each time (drafting is free: as far as it may go)."""
    policy = _policy(4)
    zero = TimeModel(version=1, b0=0.0, b1=0.0, d0=0.0, d1=0.0)
    assert policy.terms.could_pay(zero, n, 4)
    assert [_budget(policy, zero, n=n) for _ in range(3)] == [4] * 3


@pytest.mark.parametrize("n", [1, 2, 40])  # batch 1's path, the small batches', the arrays'
def test_early_stop_looks_one_draft_ahead_at_the_observed_rate(n):
    """After one draft the early stop asks whether a second pays. Position 1 is accepted 90%
    of the time; after it, position 2 either 90% (continue) or 10% of the time (stop: 0.09
    expected tokens do not pay a draft step and a validation). An estimate of 1 for the draft
    not yet made, as the stop assumed before, would continue in both."""
    for second, expected in ((0.9, True), (0.1, False)):
        policy = _policy()
        rng = np.random.default_rng(0)
        for _ in range(600):
            accepted = 0 if rng.random() >= 0.9 else 1 + (rng.random() < second)
            policy.observe(np.full((1, 4), 0.5), np.full((1, 4), 0.2), np.array([2]), np.array([accepted]))
        model = TimeModel(version=1, b0=1.0, b1=0.01, d0=0.2, d1=0.0)
        policy.install(model)
        policy.probes.hold()  # no probe
        step = policy.begin_step("adaptive", np.full(n, 100), np.full(n, 4), 1, 4)
        assert abs(policy.next_rates[1] - second) < 0.05
        assert step.keep_drafting(np.full((n, 1), 0.5), np.full((n, 1), 0.2), np.full((n, 1), 7)) is expected


def test_a_stand_down_probe_drafts_for_one_row_in_turn():
    """Where drafting does not pay, a probe drafts one position for one row, which exploration
    verifies, and for no other (each row that drafts first catches up on all it emitted since
    it last drafted: at batch 32 a probe's four explored rows had caught up on 500-600 tokens,
    10-16 ms). The row turns with the probes, so every sequence takes its turn. The draft
    yields count what the rule would have verified there, not exploration's verify-all."""
    policy, n = _policy(), 16
    _teach(policy, 0.02)
    policy.install(TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0))
    step = policy.begin_step("adaptive", np.full(n, 100), np.full(n, 4), 1, 4)
    rows = step.rows
    assert step.probe and step.best_m == 0 and step.budget == 1 and len(rows) == 1
    assert step.max_keep.tolist() == [4 if i in rows else 0 for i in range(n)]
    top, margin = np.full((n, 1), 0.001), np.full((n, 1), 0.0005)  # hopeless: the rule keeps none
    keep = np.array(step.keep(top, top, margin, None))
    assert keep.tolist() == [1 if i in rows else 0 for i in range(n)] and sum(step.rule_keep) == 0
    policy.end_step(step, top, margin, keep, keep)
    policy._flush()  # the draft yields count a step's drafts at the calibration batch
    yields = policy.yields.of(n)
    assert yields.drafted.tolist() == [1, 0, 0, 0] and yields.verified.sum() == yields.accepted.sum() == 0
    # (exploration verified it and got it)
    assert policy.probes.every_at(16) == 2 * PROBE_EVERY  # and the probes back off
    probed = []
    for _ in range(n):
        policy.probes.last = [-10**6] * len(policy.probes.last)  # the next step probes
        probed += policy.begin_step("adaptive", np.full(n, 100), np.full(n, 4), 1, 4).rows
    assert sorted(probed) == list(range(n))  # every row in turn


class _Behind:
    """The runner's RowsBehind (workers/runner.py) over given lags: no switch to price (0), the
    rows' tokens to catch up on, `cheapest` and `least_lag` as the runner's."""

    def __init__(self, lags):
        self.lags = lags

    def __call__(self, k):
        return 0.0

    def least_lag(self):
        return min(self.lags)

    def cheapest(self, start):
        n = len(self.lags)
        return min(range(n), key=lambda i: (self.lags[i], (i - start) % n))


def test_a_stand_down_probe_drafts_for_the_row_cheapest_to_catch_up():
    """Where the runner says what each row would catch up on, a stand-down probe drafts for the
    row that has least (a batch in a steady flow of requests has young rows: a probe on one costs
    a draft step, on an old one a catch-up of hundreds of tokens), the first from the turning row
    on among equals."""
    policy, n = _policy(), 8
    _teach(policy, 0.02)
    policy.install(TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0))
    lags = [300, 40, 250, 40, 500, 7, 7, 90]
    picked = []
    for _ in range(n):
        policy.probes.last = [-10**6] * len(policy.probes.last)  # the next step probes
        step = policy.begin_step("adaptive", np.full(n, 100), np.full(n, 4), 1, 4, catchup=_Behind(lags))
        turn = policy.probes.probes % n  # (this probe counted)
        assert step.probe and step.best_m == 0 and step.budget == 1
        picked.append((turn, step.rows))
    assert sorted(turn for turn, _ in picked) == list(range(n))
    assert all(rows == ([6] if turn == 6 else [5]) for turn, rows in picked), picked


def test_a_probe_waits_on_what_it_would_cost_its_first_one_included():
    """From two sequences on, a bucket's probe also waits `base` times what it would cost now beyond
    a plain step (policy.stand_down_price: its row's catch-up at the time model's catchup_ms): the
    bucket's first probe, which no earlier probe's price had stretched, waits 32 steps for a row no
    further behind than a steady step and about 32 * 4.5 for one 300 tokens behind; standing down
    meanwhile, the held stand-down names that step (no step in between goes the full way)."""
    n = 16
    model = TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0, catchup_ms=0.1)
    plain = 5.0 + 0.1 * n
    for lag, price in ((2, 0.05 / plain), (300, (0.05 + 0.1 * 298) / plain)):
        policy = _policy()
        policy.probes.plain_every = 10**9
        _teach(policy, 0.02)
        policy.install(model)
        full, decide = [], policy.decide_step

        def counted(*args, **kwargs):
            full.append(policy.probes.steps[batch_bucket(n)])
            return decide(*args, **kwargs)

        policy.decide_step = counted
        policy.probes.last = [0] * len(policy.probes.last)  # the first probe waits from step 0
        probed = None
        for step_no in range(1, 400):
            step = policy.begin_step("adaptive", np.full(n, 100), np.full(n, 4), 1, 4, catchup=_Behind([lag] * n))
            if step.probe:
                probed = step_no
                break
            policy.end_plain_step(step)
        assert probed == max(PROBE_EVERY, math.ceil(PROBE_EVERY * price))
        assert len(full) <= 3  # the first, the held one's probe step, the probe


def test_a_cold_engine_where_drafting_could_not_pay_holds_its_stand_down():
    """During a cold start, where drafting could not pay were every draft accepted, a step stands
    down and probes on the schedule alone; the stand-down is held (held_plain hands it out) as a
    warm engine's is, and its steps are those of a policy deciding every step afresh: an engine
    that never drafts stays cold, and unheld each of its steps went decide_step's whole way."""
    n, k = 8, 4
    model = TimeModel(version=1, b0=1.0, b1=0.5, d0=9.0, d1=0.0)  # drafting could not pay at 8
    held, fresh = _policy(k), _policy(k)
    for policy in (held, fresh):
        policy.install(model)
    assert held.cold and not held.terms.could_pay(model, n, k)
    full, decide = [], held.decide_step

    def counted(*args, **kwargs):
        full.append(1)
        return decide(*args, **kwargs)

    held.decide_step = counted
    seen = []
    for _ in range(300):
        fresh._downs.clear()  # decided afresh
        got = []
        for policy in (held, fresh):
            step = policy.begin_step("adaptive", [100] * n, [k] * n, 1, k)
            got.append((type(step).__name__, step.probe, step.budget, step.rows))
            if step.budget:
                top = np.full((n, step.budget), 0.01)
                keep = step.keep(top, top, top / 2, None)
                policy.end_step(step, top, top / 2, keep, [0] * n)
            else:
                policy.end_plain_step(step)
        assert got[0] == got[1]
        seen.append(got[0])
    assert held.cold and any(g[1] for g in seen)  # still cold; the schedule's probes came
    assert sum(g[0] == "PlainStep" for g in seen) > 250 and len(full) < 30


def test_batch_1_verifies_every_draft_when_the_exploration_rotation_reaches_it():
    """At batch 1 (its OneRow decides) exploration falls on the one sequence every
    EXPLORE_EVERY-th adaptive step: that step verifies every draft made, whatever the rule
    chose; the others verify the rule's choice (none, for hopeless drafts)."""
    policy = _policy()
    _teach(policy, 0.02)
    policy.install(TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0))
    top, margin = np.full((1, 3), 0.001), np.full((1, 3), 0.0005)
    verified = []
    for _ in range(2 * EXPLORE_EVERY):
        step = policy.begin_step("adaptive", [100], [4], 1, 4)
        assert isinstance(step, OneRowStep)
        keep = step.keep(top, top, margin, None)
        explored = -policy.adaptive_steps % EXPLORE_EVERY == 0
        assert step.rule_keep == [0] and keep == ([3] if explored else [0])
        verified.append(keep[0])
        policy.end_step(step, top, margin, keep, [0])
    assert verified.count(3) == 2


def _budget_by_the_formula(policy: SpecPolicy, tm: TimeModel, kv: np.ndarray, k: int, at: int = 0) -> int:
    """The draft budget's argmax, every term computed afresh (at: a batch-1 record's level)."""
    return _budget_at(policy, tm, len(kv), k, tm.b2 * float(kv.sum()), at=at)


def _budget_at(policy: SpecPolicy, tm: TimeModel, n: int, k: int, kv_ms: float, per_token: float = 0.0,
               at: int = 0) -> int:
    """The same for n sequences whose context costs kv_ms; per_token: ms more each token the step
    emits a row costs where it drafts (its rows' catch-up, controller/catchup.py)."""
    gain, share = policy.shares(n, at)
    g = tm.draft_step_ms(n)
    f = tm.q_ms_at(n * np.arange(1, k + 2)).tolist()
    # from two sequences on a draft budget must beat the plain step by 1 + batch_draft_margin as well
    enter = 1.0 + policy.cfg.adaptive.batch_draft_margin if n > 1 else 1.0
    best_m, best, expected, verified = 0, enter / (tm.other_ms(n) + f[0] + kv_ms), 1.0, 1.0
    for m in range(1, k + 1):
        expected += gain[m - 1]
        verified += share[m - 1]
        lo = min(int(verified - 1.0), k - 1)
        f_val = f[lo] + (verified - 1.0 - lo) * (f[lo + 1] - f[lo])
        theta = expected / (((tm.o0 + tm.drafting_extra_ms(n)) + tm.o1 * (n * expected)) + (tm.first_ms(n) + m * g)
                             + f_val + verified * kv_ms + expected * per_token)
        if theta > best * (1.0 + policy.cfg.adaptive.min_gain):
            best_m, best = m, theta
    return best_m


@pytest.mark.parametrize("compiled,margin", [(False, 0.0), (True, 0.0), (False, 0.05)])
def test_the_budget_from_cached_terms_equals_the_formula(request, compiled, margin):
    """The budget's context-free terms are kept per time model, batch size and calibration
    batch; each step's answer is still the formula's, over many models, rates, contexts and
    caps. Batch 1 asks its OneRow (the Python one, and the compiled one where the kernels load)."""
    ops = request.getfixturevalue("ops") if compiled else None
    rng, levels = np.random.default_rng(0), set()
    for trial in range(60):
        policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=7, adaptive=AdaptiveConfig(
            enabled=True, seq_history=True, batch_draft_margin=margin)), compiled=ops)
        _teach(policy, rng.uniform(0.3, 0.95), k=7)
        policy.probes.hold()  # no probe
        tm = TimeModel(version=1, b0=rng.uniform(0.5, 5), b1=rng.uniform(0.01, 0.5), b2=rng.uniform(0, 1e-3),
                       d0=rng.uniform(0.05, 1), d1=rng.uniform(0, 0.05), o0=rng.uniform(0, 1), o1=rng.uniform(0, 0.05),
                       o2=rng.uniform(0, 0.3), o3=rng.uniform(0, 0.02))
        if trial % 2:  # draft time as a fitted model has it: h and g tabled over n
            tm = dataclasses.replace(tm, n_knots=(1.0, 2.0, 4.0, 16.0, 64.0),
                                     n_ms=tuple(np.cumsum(rng.uniform(0, 0.5, 5)).tolist()),
                                     h_ms=tuple(np.cumsum(rng.uniform(0, 0.5, 5)).tolist()))
        policy.install(tm)
        for n in (1, 3, 8, 40):
            for k in (7, 7, 3):  # the same batch size again: cached terms, another context; then fewer drafts
                kv = rng.integers(10, 2000, n)
                step = policy.begin_step("adaptive", kv, np.full(n, k), 1, k)
                assert step.best_m == _budget_by_the_formula(policy, tm, kv, k), (trial, n, k)
            if n == 1:  # a sequence's record: its level's shares (controller/history.py)
                for record in ((12.0, 12.0), (0.0, 9.0), (3.0, 6.0)):
                    step = policy.begin_step("adaptive", kv, np.full(n, 7), 1, 7, record=record)
                    assert step.best_m == _budget_by_the_formula(policy, tm, kv, 7, step.level), (trial, record)
                    levels.add(step.level)
        _teach(policy, rng.uniform(0.3, 0.95), k=7)  # new rates: the terms follow them
        for n in (1, 3, 8, 40):
            kv = rng.integers(10, 2000, n)
            assert policy.begin_step("adaptive", kv, np.full(n, 7), 1, 7).best_m == \
                _budget_by_the_formula(policy, tm, kv, 7), (trial, n)
    assert min(levels) < 0 < max(levels)
    if compiled:
        assert type(policy._one_row[0][2]).__module__ == "adaspec_cpu_ops"


@pytest.mark.parametrize("margin", [0.0, 0.05])
def test_past_the_stand_down_point_a_step_is_plain_without_the_budget_loop(margin):
    """From the context cost StepTerms.stand_down_at gives on, the budget's formula answers 0
    (a plain step), and begin_step answers so without its loop (a PlainStep; at batch 1 without
    its OneRow); just below that point the formula drafts: the point is where standing down
    begins, not a bound far past it."""
    rng = np.random.default_rng(1)
    tight = plain = 0
    for trial in range(150):
        policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=7,
                                              adaptive=AdaptiveConfig(enabled=True, batch_draft_margin=margin)))
        _teach(policy, rng.uniform(0.3, 0.95), k=7)
        policy.probes.hold()  # no probe
        tm = TimeModel(version=1, b0=rng.uniform(0.5, 5), b1=rng.uniform(0.01, 0.5), b2=rng.uniform(1e-5, 1e-3),
                       d0=rng.uniform(0.05, 1), d1=rng.uniform(0, 0.05), o0=rng.uniform(0, 1), o1=rng.uniform(0, 0.05),
                       o2=rng.uniform(0, 0.3), o3=rng.uniform(0, 0.02))
        policy.install(tm)
        n, k = int(rng.choice([1, 2, 3, 8, 40])), int(rng.choice([3, 7]))
        at = policy.terms.stand_down_at(tm, n, k)
        assert at >= 0.0
        if not np.isfinite(at):
            continue
        for x in (at, at * (1 + 1e-12), at * (1 + 1e-6), at * 1.5 + 1e-3, at * 4 + 1.0):
            assert _budget_at(policy, tm, n, k, x) == 0, (trial, x / max(at, 1e-300))
        tight += at > 0 and _budget_at(policy, tm, n, k, at * (1 - 1e-6)) > 0
        for kv in (rng.integers(10, 2000, n), np.full(n, int(at / tm.b2 / n) + 1)):
            step = policy.begin_step("adaptive", kv.tolist(), [k] * n, 1, k)
            assert step.best_m == _budget_by_the_formula(policy, tm, kv, k)
            assert isinstance(step, PlainStep) == (tm.b2 * float(kv.sum()) >= at), trial
            plain += isinstance(step, PlainStep)
    assert tight >= 20 and plain >= 40, (tight, plain)


def test_a_held_stand_down_hands_out_its_plain_step_with_each_step_s_inputs():
    """held_plain, which the runner asks first: None until a stand-down is held for the batch size,
    then the stand-down's own PlainStep at every step, carrying that step's kv and caps, counted as
    an adaptive step; None again for another batch size or time model, or once its bucket's probe is
    due (then begin_step decides)."""
    policy = _policy(k=4)
    _teach(policy, 0.6)
    tm = TimeModel(version=1, b0=1.0, b1=0.1, b2=1e-3, d0=2.0, d1=0.0)  # drafting never pays
    policy.install(tm)
    kv = [300] * 8
    assert policy.held_plain(kv, [4] * 8, 1, 4) is None
    first = policy.begin_step("adaptive", kv, [4] * 8, 1, 4)
    assert isinstance(first, PlainStep) and policy._downs.get(8) is not None
    steps = policy.adaptive_steps
    got = [policy.held_plain([300 + i] * 8, [4 - i % 2] * 8, 1, 4) for i in range(3)]
    assert got[0] is got[1] is got[2] is policy._downs[8].step and policy.adaptive_steps == steps + 3
    assert got[2].kv == [302] * 8 and got[2].max_keep.tolist() == [4] * 8 and got[2].budget == 0
    assert policy.held_plain(kv[:4], [4] * 4, 1, 4) is None and policy.held_plain(kv, [4] * 8, 2, 4) is None
    down = policy._downs[8]
    down.probe_at = down.counts[down.bucket] + 1
    assert policy.held_plain(kv, [4] * 8, 1, 4) is None


def test_a_large_batch_keeps_what_the_rule_decides_from_its_estimates():
    """A large batch's early stops and keep read path probabilities the step quantised once per
    position: keep equals decide_with over the step's own estimates, after every early stop."""
    from controller.decision import decide_with
    rng = np.random.default_rng(3)
    drafted = []
    for n in (12, 40, 96):
        policy = _policy(7)
        model = TimeModel(version=1, b0=2.0, b1=0.005, b2=1e-5, d0=0.05, d1=0.0005)
        policy.install(model)
        policy.probes.hold()  # no probe
        kv, caps = rng.integers(10, 400, n), rng.integers(0, 8, n)
        step = policy.begin_step("adaptive", kv, caps, 1, 7)
        top, margin = rng.beta(8, 1, size=(n, 7)), rng.beta(4, 1, size=(n, 7))
        m = 1
        while m < 7 and step.keep_drafting(top[:, :m], margin[:, :m], np.zeros((n, m))):
            m += 1
        step.keep(top[:, :m], top[:, :m], margin[:, :m], None)
        expected = decide_with(np.stack(step.conf[:m], 1), step._costs(), policy.cfg.adaptive.min_gain,
                               step._draft_ms(m), step.max_keep)
        assert np.asarray(step.rule_keep).tolist() == expected.tolist()
        drafted.append(m)
    assert max(drafted) > 2, drafted  # some early stops let drafting go on


def test_every_takes_evenly_spaced_sequence_steps_across_steps():
    from controller.pending import every

    steps = [(np.arange(n * 2).reshape(n, 2) + 100 * i, np.zeros((n, 2)), np.arange(n) + 100 * i, np.zeros(n),
              None if i % 2 else list(range(n)), 2) for i, n in enumerate([5, 3, 1, 6])]
    picked = every(steps, 3, 1)  # global rows 1, 4, 7, 10, 13 of 0..14
    assert [p[2].tolist() for p in picked] == [[1, 4], [102], [301, 304]]  # the step of one row has none
    assert picked[0][4] == [1, 4] and picked[1][4] is None
    assert picked[2][0].tolist() == [[302, 303], [308, 309]]


def test_a_large_batch_calibrates_on_a_sample_that_counts_for_the_whole():
    """Batch 256: a calibration batch of 8,192 sequence-steps fits on every 8th, counted 8 times.
    The counts, the logistic model's curvature and its estimates stay those of the whole batch."""
    import controller.policy as policy_module

    def taught(sample: bool) -> SpecPolicy:
        rng = np.random.default_rng(4)
        policy = _policy(k=3)
        if not sample:
            policy_module.CALIBRATE_ROWS, saved = 10**9, policy_module.CALIBRATE_ROWS
        try:
            for _ in range(3 * 32):  # four calibration batches: the cold start's two (steps 1 and 2), then every 32
                top = rng.beta(2, 2, (256, 3))
                margin = top * rng.uniform(0.2, 1.0, (256, 3))
                accepted = (rng.random((256, 3)) < top).cumprod(1).sum(1)  # each draft accepted w.p. its top prob
                policy.observe(top, margin, np.full(256, 3), accepted)
        finally:
            if not sample:
                policy_module.CALIBRATE_ROWS = saved
        return policy

    whole, sampled = taught(False), taught(True)
    assert sampled._batches == 4
    assert not np.array_equal(whole.logistic.h, sampled.logistic.h)  # the sample was taken
    # the counts (halved at HALVE_AT a bucket, so only near) and the rates they give
    assert np.allclose(sampled.calibrator.trials.sum(1), whole.calibrator.trials.sum(1), rtol=0.25)
    assert np.allclose(sampled.calibrator.position_rates(), whole.calibrator.position_rates(), atol=0.04)
    assert np.allclose(np.diagonal(sampled.logistic.h[:3], axis1=1, axis2=2), np.diagonal(whole.logistic.h[:3],
                       axis1=1, axis2=2), rtol=0.2)
    probe = np.array([[0.2, 0.5, 0.9], [0.7, 0.4, 0.3]])
    estimates = sampled.logistic.estimate(probe, probe * 0.5)
    assert np.abs(estimates - whole.logistic.estimate(probe, probe * 0.5)).max() < 0.05


def test_only_steps_that_may_stop_early_ask():
    """Static steps and probes draft their whole budget: the draft loop gets no early stop to
    call (None); adaptive and oracle steps get one."""
    policy = _policy(k=4)
    policy.install(TimeModel(version=1, b0=8.0, b1=0.01, b2=0.0, d0=0.3, d1=0.001))
    kv, cap = np.full(2, 100), np.full(2, 4)
    buffers = (np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 2), dtype=np.int64))
    assert policy.begin_step("static", kv, cap, 1, 4).early_stop(*buffers) is None
    step = policy.begin_step("adaptive", kv, cap, 1, 4)  # the first adaptive step probes
    assert step.probe and step.early_stop(*buffers) is None
    policy.cold = False
    policy.probes.hold()
    step = policy.begin_step("adaptive", kv, cap, 1, 4)
    assert not step.probe and callable(step.early_stop(*buffers))
    oracle = policy.begin_step("oracle", kv, cap, 1, 4, np.ones((2, 4), dtype=np.int64))
    assert callable(oracle.early_stop(*buffers))


def test_a_calibration_batch_of_steps_that_drafted_nothing_keeps_what_the_rates_give():
    """Steps that drafted nothing (plain decoding in an engine that also drafts, standing
    down) reach a calibration batch with nothing in it: batch 1's OneRow and the budget's
    cached terms stay as they were, where a batch that verified drafts rebuilds them."""
    policy = _policy(k=4)
    _teach(policy, 0.8)
    policy._flush()  # what _teach left pending
    tm = TimeModel(version=1, b0=2.0, b1=0.05, b2=0.0, d0=0.3, d1=0.001)
    policy.install(tm)
    policy.probes.hold()  # no probe
    policy.begin_step("adaptive", [100], [4], 1, 4)
    policy.begin_step("adaptive", [100] * 8, [4] * 8, 1, 4)
    one, terms = policy._one_row[0], dict(policy.terms._budget_cache)
    assert one is not None and terms
    from controller.policy import OBSERVE_MAX
    for _ in range(OBSERVE_MAX + 44):  # past a calibration batch
        step = policy.begin_step("static", [100], [0], 1, 0)
        policy.end_step(step, np.zeros((1, 0)), np.zeros((1, 0)), [0], [0])
    assert policy._observed == 44 and policy._one_row[0] is one and policy.terms._budget_cache == terms
    _teach(policy, 0.3)
    policy._flush()
    assert policy._one_row == {} and policy.terms._budget_cache == {}


def test_oracle_steps_teach_the_estimators_nothing():
    """An oracle step verifies the drafts that match the reference, chosen by their outcome:
    its all-accepted drafts must not reach the calibrators, or every other arm sharing the
    policy reads its estimates too high. The same outcomes from static steps do reach them."""
    def run(mode: str) -> SpecPolicy:
        policy = _policy(k=4)
        policy.install(TimeModel(version=1, b0=8.0, b1=0.01, b2=0.0, d0=0.3, d1=0.001))
        kv, cap = np.full(2, 100), np.full(2, 4)
        top = np.full((2, 4), 0.3)
        for _ in range(300):  # past several calibration batches
            step = policy.begin_step(mode, kv, cap, 1, 4, np.ones((2, 4), dtype=np.int64))
            policy.end_step(step, top, top / 2, np.full(2, 4), np.full(2, 4))
        return policy

    fresh, oracle, static = _policy(k=4), run("oracle"), run("static")
    assert oracle.logistic.weights == fresh.logistic.weights
    assert oracle.calibrator.trials.sum() == 0 and oracle.yields.buckets == {}
    assert static.calibrator.trials.sum() > 0 and static.logistic.weights != fresh.logistic.weights


def test_standing_down_step_after_step_answers_as_deciding_it_again():
    """begin_step's fast path (controller/stand_down.py) against the full path on the same
    steps: a batch whose size moves, whose sequences' contexts grow and are now and then
    swapped for short ones (down to batch 1 at times), new time models and calibration batches between. Every step gets
    the same kind of step, budget and probe, and the probe schedule counts the same, while
    most plain steps take the fast path."""
    rng = np.random.default_rng(3)
    fast, full = _policy(7), _policy(7)
    fast_steps = plain = 0
    kv = [int(x) for x in rng.integers(20, 400, 4)]
    version = 0
    for i in range(4000):
        if i % 500 == 0:  # a refit: validation's context cost moves the stand-down point
            version += 1
            tm = TimeModel(version=version, b0=1.0, b1=0.1, b2=float(rng.uniform(2e-4, 2e-3)), d0=0.2, d1=0.01)
            fast.install(tm), full.install(tm)
        if i % 700 == 350:  # a calibration batch moves the rates
            rate = float(rng.uniform(0.4, 0.9))
            _teach(fast, rate, k=7), _teach(full, rate, k=7)
        if rng.random() < 0.02:  # a sequence finishes, or one more arrives
            kv = kv[:-1] if len(kv) > 1 and rng.random() < 0.5 else kv + [int(rng.integers(5, 50))]
        if rng.random() < 0.01:  # one swapped for a shorter one: the summed context falls
            kv[int(rng.integers(len(kv)))] = int(rng.integers(5, 50))
        held = fast._downs.get(len(kv))
        full._downs.clear()
        a = fast.begin_step("adaptive", list(kv), [7] * len(kv), version, 7)
        b = full.begin_step("adaptive", list(kv), [7] * len(kv), version, 7)
        assert (type(a), a.budget, a.probe, a.best_m) == (type(b), b.budget, b.probe, b.best_m), i
        fast_steps += held is not None and fast._downs.get(len(kv)) is held and isinstance(a, PlainStep)
        plain += isinstance(a, PlainStep)
        for policy, step in ((fast, a), (full, b)):
            if step.budget:
                n = len(kv)
                policy.end_step(step, np.zeros((n, 0)), np.zeros((n, 0)), np.zeros(n, dtype=np.int64),
                                np.zeros(n, dtype=np.int64))
            else:
                policy.end_plain_step(step)
        assert fast.adaptive_steps == full.adaptive_steps and fast.probes.probes == full.probes.probes, i
        assert (fast.probes.steps, fast.probes.last, fast.probes.every) == \
            (full.probes.steps, full.probes.last, full.probes.every), i
        kv = [c + 1 for c in kv]
    assert plain > 2000 and fast_steps > 0.8 * plain and plain < 3950, (plain, fast_steps)


@pytest.mark.parametrize("seq_history", [False, True])
def test_batch_1_stands_down_on_the_fast_path_as_its_one_row_would(seq_history):
    """One sequence whose context grows past batch 1's stand-down point: before it, its OneRow
    decides and drafts; from it on, begin_step answers a PlainStep (its OneRow would say 0) and
    holds that answer step after step, probes and counts as the full path. With seq_history,
    where the next step's sequence may stand at another level, it always decides afresh."""
    policy, full = (SpecPolicy(SpeculativeConfig(num_speculative_tokens=7, adaptive=AdaptiveConfig(
        enabled=True, seq_history=seq_history))) for _ in range(2))
    tm = TimeModel(version=1, b0=1.0, b1=0.1, b2=1e-3, d0=0.2, d1=0.01)
    for p in (policy, full):
        _teach(p, 0.6, k=7)
        p.install(tm)
    at = policy.terms.stand_down_at(tm, 1, 7)
    assert 0.3 < at < 1.5  # drafting pays below about 680 tokens of context, not past it
    kinds, held = [], 0
    for kv in range(int(at / tm.b2) - 100, int(at / tm.b2) + 400):
        down = policy._downs.get(1)
        full._downs.clear()
        a = policy.begin_step("adaptive", [kv], [7], 1, 7)
        b = full.begin_step("adaptive", [kv], [7], 1, 7)
        assert (type(a), a.budget, a.probe, a.best_m) == (type(b), b.budget, b.probe, b.best_m), kv
        one = policy.one_row(tm, 7)
        if not a.probe:
            assert a.best_m == one.begin(kv, 7, 7), kv  # what the OneRow says
        kinds.append(type(a).__name__)
        held += down is not None and policy._downs.get(1) is down
        for p, step in ((policy, a), (full, b)):
            if step.budget:
                p.end_step(step, np.zeros((1, 0)), np.zeros((1, 0)), [0], [0])
            else:
                p.end_plain_step(step)
    assert kinds[0] == "OneRowStep" and kinds.count("OneRowStep") >= 100
    if seq_history:
        assert "PlainStep" not in kinds and held == 0
    else:
        assert kinds.count("PlainStep") >= 200 and held >= 200, (kinds.count("PlainStep"), held)
        assert "PlainStep" not in kinds[:100]  # below the point its OneRow decides


def test_plain_decoding_steps_without_building_a_spec_step():
    """A static step with nothing to draft (k = 0: plain decoding, or a static sequence's last
    step) is a PlainStep of its mode, answering what a SpecStep would: budget 0, no probe, the
    caps as given; asked for anything else it builds that step (in its own mode)."""
    policy = _policy(3)
    policy.install(TimeModel(version=1))
    for kv, caps in (([40], [0]), ([10, 20, 30], [0, 0, 0])):
        step = policy.begin_step("static", kv, caps, 1, 0)
        assert isinstance(step, PlainStep) and step.mode == "static" and step.model.version == 1
        assert step.budget == 0 and not step.probe and step.max_keep.tolist() == caps
        assert step.rows is None and step._full.mode == "static"  # built on demand, in its mode
        steps = policy.adaptive_steps
        policy.end_plain_step(step)
        assert policy.adaptive_steps == steps
    assert not isinstance(policy.begin_step("static", [40], [3], 1, 3), PlainStep)  # drafts: a SpecStep
    assert not isinstance(policy.begin_step("oracle", [40], [0], 1, 0), PlainStep)
