"""Batch 1's OneRowStep (controller/one_row_step.py) decides as the general SpecStep does."""
from __future__ import annotations

import numpy as np
import pytest

from controller import history
from controller.config import AdaptiveConfig, SpeculativeConfig
from controller.one_row_step import OneRowStep
from controller.policy import SpecPolicy
from controller.step import SpecStep
from controller.time_model import TimeModel

PAYS = dict(b0=5.0, b1=0.1, b2=2e-5, d0=0.05, d1=0.0, o0=0.2, o1=0.01)  # drafting pays at batch 1
# it does not: the budget stands down (drafting could pay only were nearly every draft accepted), probes still draft
COSTLY = dict(b0=1.0, b1=0.5, d0=0.9, d1=0.0)


def _drive(policy: SpecPolicy, step_no: int, version: int, kv: int, cap: int, k: int, top, margin, hits,
           record=None, lend: bool = True, alone: bool = False):
    """One adaptive batch-1 step in the runner's order; what it decided (and, last, the drafts
    it verified and accepted). lend: the draft loop writes where the step says (draft_inputs:
    a OneRowStep's rows of the policy's draft slab), as the runner's does; else into buffers
    of its own. alone: begun as the runner begins a step of one sequence with nothing to catch
    up on (begin_alone), else by begin_step."""
    if alone:
        assert record is None
        step = policy.begin_alone([kv], [cap], version, k)
    else:
        step = policy.begin_step("adaptive", [kv], [cap], version, k, record=record)
    budget = step.budget
    answers, m = [], 0
    if budget:
        given = step.draft_inputs(budget) if lend else None
        buf_top, buf_margin = (np.zeros((budget, 1)), np.zeros((budget, 1))) if given is None else given[:2]
        tokens = np.zeros((budget, 1), np.int64)
        more = step.early_stop(buf_top, buf_margin, tokens)
        for j in range(budget):
            buf_top[j], buf_margin[j], m = top[j], margin[j], j + 1
            if j == budget - 1:
                break
            if more is not None:
                answers.append(bool(more(m)))
                if not answers[-1]:
                    break
        keep = step.keep(buf_top[:m].T, buf_top[:m].T, buf_margin[:m].T, tokens[:m].T)
        accepted = [int(np.argmin(np.append(hits[:keep[0]], False)))]
        policy.end_step(step, buf_top[:m].T, buf_margin[:m].T, keep, accepted)
    else:
        keep, accepted = [0], [0]
        policy.end_plain_step(step)
    return (type(step).__name__, budget, step.best_m, step.probe, step.rows, answers, keep, step.rule_keep,
            step.level, (keep[0], accepted[0]))


@pytest.mark.parametrize("compiled,lend", [(True, True), (False, True), (True, False)])
def test_one_row_steps_decide_as_the_general_step(ops, compiled, lend, monkeypatch):
    """500 steps of one sequence on two policies alike but for OneRowStep (one_row_steps off
    in the other, whose SpecSteps decide in decide_small and worth_drafting): the same budgets,
    early-stop answers, keep sets and rule choices every step, through a cold start's probes,
    plain probes, exploration, caps below k and, where drafting stops paying, stand-down
    probes, with the sequence's record (controller/history.py) at levels either side of 0;
    and the two policies' calibration stays the same (the OneRowSteps' drafts read from the
    draft slab where they were lent it, held there until their calibration batch)."""
    monkeypatch.setattr("controller.policy.ALONE_COLD_TRIALS", 64)  # a short cold start: the warm cases fit in 500
    cfg = SpeculativeConfig(num_speculative_tokens=7, adaptive=AdaptiveConfig(enabled=True, seq_history=True))
    fast, slow = (SpecPolicy(cfg, compiled=ops if compiled else None) for _ in range(2))
    slow.one_row_steps = False
    for policy in (fast, slow):
        for version, terms in ((1, PAYS), (2, COSTLY), (3, PAYS)):
            policy.install(TimeModel(version=version, **terms))
        policy.probes.plain_every = 16  # plain probes' stretches within these steps (8 in every 128 that would draft)
    rng = np.random.default_rng(7)
    seen, record = [], (0.0, 0.0)
    for s in range(500):
        version = 1 if s < 200 else 2 if s < 320 else 3
        kv, cap = 100 + 3 * s, int(rng.choice([7, 7, 7, 5, 2, 0]))
        top = rng.beta(3.0, 1.5, 7)[:, None]
        margin = top * rng.uniform(0.2, 1.0, (7, 1))
        hits = rng.random(7) < (top[:, 0] if s % 100 < 50 else top[:, 0] ** 3)  # good stretches, bad ones
        got = [_drive(p, s, version, kv, cap, 7, top, margin, hits, record, lend) for p in (fast, slow)]
        assert got[0][0] == "OneRowStep" and got[1][0] == "SpecStep"
        assert got[0][1:] == got[1][1:], (s, got)
        seen.append(got[0])
        if got[0][-1][0]:
            record = history.record(*record, *got[0][-1])
    assert fast.logistic.weights == slow.logistic.weights and fast.next_rates == slow.next_rates
    probes = [g for g in seen if g[3]]
    assert len(probes) > 20 and any(g[4] == [0] for g in probes)  # probes, stand-down ones among them
    assert any(not g[3] and g[1] == 0 and g[2] > 0 for g in seen)  # a plain probe (drafting paid)
    assert any(False in g[5] for g in seen) and any(True in g[5] for g in seen)  # both early-stop answers
    assert any(g[7] is not None and g[6][0] > g[7][0] for g in seen)  # exploration verified past the rule
    assert min(g[8] for g in seen) < 0 < max(g[8] for g in seen)  # records below and above the pooled rate


@pytest.mark.parametrize("compiled", [True, False])
def test_begin_alone_begins_the_step_begin_step_would(ops, compiled, monkeypatch):
    """The runner's entry for a step of one sequence (begin_alone) against begin_step on two
    policies alike, 600 steps: the same kind of step, budgets, early-stop answers, keep sets and
    rule choices, through the cold start (which begin_alone hands to begin_step), probes, plain
    probes, caps below k, the stand-down begin_step holds (held_plain) where drafting stops
    paying, and no probes where it could not pay were every draft accepted."""
    monkeypatch.setattr("controller.policy.ALONE_COLD_TRIALS", 64)
    cfg = SpeculativeConfig(num_speculative_tokens=7, adaptive=AdaptiveConfig(enabled=True))
    fast, slow = (SpecPolicy(cfg, compiled=ops if compiled else None) for _ in range(2))
    for policy in (fast, slow):
        # drafting pays, stops paying, pays again, then could not pay were every draft accepted
        for version, terms in ((1, PAYS), (2, COSTLY), (3, PAYS), (4, COSTLY | dict(d0=9.0))):
            policy.install(TimeModel(version=version, **terms))
        policy.probes.plain_every = 16
    rng = np.random.default_rng(11)
    seen = []
    for s in range(800):
        version = 1 + s // 200
        kv, cap = 100 + 5 * s, int(rng.choice([7, 7, 7, 5, 2]))
        top = rng.beta(3.0, 1.5, 7)[:, None]
        margin = top * rng.uniform(0.2, 1.0, (7, 1))
        hits = rng.random(7) < top[:, 0]
        got = [_drive(p, s, version, kv, cap, 7, top, margin, hits, alone=p is fast) for p in (fast, slow)]
        assert got[0] == got[1], (s, got)
        seen.append(got[0])
    assert fast.logistic.weights == slow.logistic.weights and fast.adaptive_steps == slow.adaptive_steps
    kinds = {g[0] for g in seen}
    assert kinds == {"OneRowStep", "PlainStep"}  # drafting steps, and held stand-downs
    assert any(g[3] for g in seen[100:]) and any(not g[3] and g[1] == 0 and g[2] > 0 for g in seen)  # probes, plain ones
    assert any(False in g[5] for g in seen) and any(True in g[5] for g in seen)


def test_a_step_of_one_sequence_is_a_one_row_step_only_on_the_logistic_estimate():
    for estimator, kind in (("top_prob_logistic", OneRowStep), ("top_prob_calibrated", SpecStep)):
        policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=3,
                                              adaptive=AdaptiveConfig(enabled=True, estimator=estimator)))
        policy.install(TimeModel(version=1, **PAYS))
        assert type(policy.begin_step("adaptive", [50], [3], 1, 3)) is kind
        assert type(policy.begin_step("adaptive", [50], [3], 1, 0)) is SpecStep  # nothing to draft
        assert type(policy.begin_step("static", [50], [3], 1, 3)) is SpecStep
