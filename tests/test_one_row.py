"""Batch 1's compiled decisions (models/csrc/one_row.cpp) against their Python reference
(controller/one_row.py, controller/estimators.py): the same answers, bit for bit, so ranks
agree whichever of the two they run."""
from __future__ import annotations

import math

import numpy as np
import pytest

from controller.config import AdaptiveConfig, SpeculativeConfig
from controller.decision import draft_units, quantize, step_costs
from controller.estimators import logistic_estimate
from controller.one_row import OneRow, new_one_row
from controller.policy import SpecPolicy
from controller.time_model import UNITS_PER_MS, TimeModel


def test_logistic_estimate_is_the_same_double(ops):
    """Random weights and inputs, edges included (p at and past 0 and 1, tiny margins, z
    past +-60): equal doubles; a fused multiply-add or another order would differ in the last
    bit on some of these."""
    rng = np.random.default_rng(0)
    edges = [0.0, 1e-300, 1e-4, 0.5, 1 - 1e-4, 1.0, 1.5, -0.2]
    cases = [(p, m) for p in edges for m in edges] + list(zip(rng.uniform(0, 1, 5000), rng.uniform(0, 1, 5000)))
    mismatched = 0
    for i, (p, m) in enumerate(cases):
        w = (rng.normal(0, 3, 4) * (50 if i % 97 == 0 else 1)).tolist()
        mismatched += ops.logistic_estimate(w, float(p), float(m)) != logistic_estimate(w, float(p), float(m))
    assert mismatched == 0


def _random_costs(rng, k: int):
    tm = TimeModel(b0=float(rng.uniform(0.1, 20)), b1=float(rng.uniform(0.001, 5)), b2=float(rng.uniform(0, 0.01)),
                   o1=float(rng.uniform(0, 1)))
    if rng.random() < 0.5:  # a table model
        knots = (1.0, 2.0, 4.0, 8.0)
        tm = TimeModel(**{**tm.__dict__, "q_knots": knots,
                          "q_ms": tuple(float(v) for v in np.cumsum(rng.uniform(0, 3, len(knots))))})
    return step_costs(tm, [int(rng.integers(1, 500))], k + 1)


def test_compiled_one_row_decides_as_the_python_one(ops):
    """Built up a draft at a time on random steps (costs, min_gain, caps, draft times, logistic
    weights, rates), through add, add_logistic, next or next_at (reading the draft loop's
    buffers): after every draft the early stop's answer and the keep set with its score are
    equal."""
    rng = np.random.default_rng(1)
    answers, rated = [], []
    for _ in range(600):
        k = int(rng.integers(1, 8))
        costs, cap = _random_costs(rng, k), int(rng.integers(0, 8))
        min_gain = float(rng.choice([0.0, 0.01, 0.1]))
        weights = rng.normal(0, 2, (k, 4)).tolist()
        d_first, g = float(rng.uniform(0, 3)), float(rng.uniform(0, 3))
        draft = [draft_units(d_first + j * g) if j else 0 for j in range(k + 2)]
        rates = rng.uniform(0, 1, k + 1).tolist()
        how = rng.choice(["add", "add_logistic", "next", "next_at"])
        mine = new_one_row(costs, min_gain, cap, ops.LogisticWeights(weights), ops)
        ref = OneRow(costs, min_gain, cap, weights)
        told = OneRow(costs, min_gain, cap, weights)  # next_at's reference: told each draft by next
        restart = rng.random() < 0.5  # a later step of the same time model: all restarted
        # ... or begun, its early stop at the budget's rate (by_rate: begin sets the rate)
        by_rate = restart and rng.random() < 0.5
        base = float(rng.uniform(0.5, 3))
        terms = [[]] + [[(1, float(rng.uniform(1, 3)), float(rng.uniform(0.5, 4)), 1.0)] for _ in range(k)]
        ctx, cap = int(rng.integers(0, 300)), int(rng.integers(0, 8))
        inputs = np.zeros((2, k, 1))  # the draft loop's buffers, filled a row per draft
        for one in (mine, ref, told):
            if by_rate:
                one.set_budget(1e-3, base, costs.fixed, terms, 1.0, UNITS_PER_MS, True)
                one.begin(ctx, cap, k)
            elif restart:
                one.add(0.5)
                one.restart(ctx, costs.fixed + ctx, cap)
            one.set_terms(draft, rates)
            one.watch(*inputs)
        for j in range(1, k + 1):
            p, m = float(rng.uniform(0, 1)), float(rng.uniform(0, 1))
            inputs[:, j - 1, 0] = p, m
            if how == "next_at":
                answers.append(told.next(j, p, m))
                assert mine.next_at(j) == ref.next_at(j) == answers[-1]
            elif how == "next":
                answers.append(ref.next(j, p, m))
                assert mine.next(j, p, m) == answers[-1]
            else:
                getattr(mine, how)(*((p, m) if how == "add_logistic" else (p,)))
                getattr(ref, how)(*((p, m) if how == "add_logistic" else (p,)))
                answers.append(ref.worth_drafting(draft[j], draft[j + 1], rates[j]))
                assert mine.worth_drafting(draft[j], draft[j + 1], rates[j]) == answers[-1]
            assert mine.drafts == ref.drafts == j
            assert mine.best(draft[j], j) == ref.best(draft[j], j)
            assert mine.keep(j) == ref.keep(j) == ref.best(draft[j], j)[0]
        rated.append(by_rate and ref.lam > 0)
    assert 50 < sum(answers) < len(answers) - 50  # both answers were reached
    assert 100 < sum(rated) < len(rated) - 100  # at the budget's rate and at Theta


def test_keep_at_reads_the_drafts_not_yet_added_from_the_watched_buffers(ops):
    """keep_at(m) after some early-stop questions (next_at): the remaining drafts' estimates
    read from the buffers, then the keep set; equal in both, and to a OneRow told every draft."""
    rng = np.random.default_rng(2)
    kept = []
    for _ in range(300):
        k = int(rng.integers(1, 8))
        costs, cap, min_gain = _random_costs(rng, k), int(rng.integers(0, 8)), float(rng.choice([0.0, 0.01]))
        weights = rng.normal(0, 2, (k, 4)).tolist()
        draft = [draft_units(float(rng.uniform(0, 3)) * j) for j in range(k + 2)]
        rates = rng.uniform(0, 1, k + 1).tolist()
        inputs = rng.uniform(0, 1, (2, k, 1))
        mine = new_one_row(costs, min_gain, cap, ops.LogisticWeights(weights), ops)
        ref, told = OneRow(costs, min_gain, cap, weights), OneRow(costs, min_gain, cap, weights)
        for one in (mine, ref, told):
            one.set_terms(draft, rates)
        for one in (mine, ref):
            one.watch(*inputs)
        asked, m = sorted(int(x) for x in rng.integers(0, k + 1, 2))
        for j in range(1, asked + 1):
            assert mine.next_at(j) == ref.next_at(j)
        for j in range(m):
            told.add_logistic(float(inputs[0, j, 0]), float(inputs[1, j, 0]))
        kept.append(told.keep(m))
        assert mine.keep_at(m) == ref.keep_at(m) == kept[-1]
        assert mine.drafts == ref.drafts == m
    assert len(set(kept)) > 3
    with pytest.raises(IndexError, match="no such row"):
        mine.keep_at(k + 1)


def test_a_step_begun_at_a_row_of_the_slab_reads_its_drafts_there(ops):
    """begin(..., row): next_at and keep_at read the step's drafts from rows row.. of the slab
    watched once (watch_slab), as from buffers of the step's own (watch), in both twins; a row
    past the slab, or no slab, is refused; begin without a row leaves what was watched."""
    rng = np.random.default_rng(3)
    k, rows = 5, 40
    costs = _random_costs(rng, k)
    weights = [[0.0, 1.0, 0.0, 0.0]] * k
    draft = [draft_units(0.2 * j) for j in range(k + 2)]
    rates = rng.uniform(0, 1, k + 1).tolist()
    slab = rng.uniform(0, 1, (2, rows, 1))
    slab[:, :k], slab[:, 7:7 + k] = 0.999, 0.001  # confident drafts at row 0, hopeless ones at row 7
    mine = new_one_row(costs, 0.0, k, ops.LogisticWeights(weights), ops)
    ref, own = OneRow(costs, 0.0, k, weights), OneRow(costs, 0.0, k, weights)
    answers = []
    for one in (mine, ref, own):
        one.set_terms(draft, rates)
        one.set_budget(0.001, 1.0, 0, [[]] + [[(1, 1.5, 2.0, 1.0)]] * k, 1.0, 1000.0)
    for one in (mine, ref):
        with pytest.raises(IndexError, match="slab"):
            one.begin(100, k, k, 0)  # nothing watched yet
        one.watch_slab(*slab)
    for row in (0, 7, rows - k):
        for one in (mine, ref, own):
            one.begin(100, k, k, row if one is not own else -1)
        own.watch(*(a[row:row + k] for a in slab))
        got = [[one.next_at(j) for j in range(1, 3)] + [one.keep_at(k)] for one in (mine, ref, own)]
        assert got[0] == got[1] == got[2], row
        answers.append(got[0])
        mine.begin(100, k, k)  # no row: next_at reads where it read before
        ref.begin(100, k, k)
        assert mine.next_at(1) == ref.next_at(1) == got[0][0]
    assert len({tuple(a) for a in answers}) > 1  # the rows differ, and so do the answers
    for one in (mine, ref):
        with pytest.raises(IndexError, match="slab"):
            one.begin(100, k, k, rows - k + 1)


def test_draft_next_writes_a_position_and_answers_the_early_stop_as_next_at(ops):
    """OneRow.draft_next(logits, tokens, inputs, j) over a step's slab rows: draft_top2_at's
    writes, then next_at(j + 1)'s answer, the same as the two calls apart; buffers that are
    not the ones the OneRow reads are refused."""
    import torch

    rng = np.random.default_rng(4)
    k, rows = 5, 30
    costs = _random_costs(rng, k)
    weights = ops.LogisticWeights([[0.5, 1.0, -0.5, 2.0]] * k)
    draft = [draft_units(0.05 * j) for j in range(k + 2)]
    rates = rng.uniform(0.3, 1, k + 1).tolist()
    pair = []
    for _ in range(2):
        slab = np.zeros((3, rows, 1))
        one = new_one_row(costs, 0.0, k, weights, ops)
        one.set_terms(draft, rates)
        one.set_budget(0.001, 1.0, 0, [[]] + [[(1, 1.5, 2.0, 1.0)]] * k, 1.0, 1000.0)
        one.watch_slab(slab[0], slab[1])
        one.begin(100, k, k, 6)
        pair.append((one, slab))
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(1, 500, generator=gen) * s for s in (8.0, 3.0, 1.0, 0.3)]
    (fused, fslab), (apart, aslab) = pair
    ftok, atok = torch.zeros(k, 1, dtype=torch.long), torch.zeros(k, 1, dtype=torch.long)
    finputs, ainputs = torch.from_numpy(fslab)[:, 6:6 + k], torch.from_numpy(aslab)[:, 6:6 + k]
    got = []
    for j, lg in enumerate(logits):
        a = fused.draft_next(lg, ftok, finputs, j)
        ops.draft_top2_at(lg, atok, ainputs, j)
        got.append((a, apart.next_at(j + 1)))
    assert all(a == b for a, b in got) and np.array_equal(fslab, aslab) and torch.equal(ftok, atok)
    assert fused.keep_at(len(logits)) == apart.keep_at(len(logits))
    fused.begin(100, k, k, 6)
    with pytest.raises(ValueError, match="not the buffers"):
        fused.draft_next(logits[0], ftok, torch.zeros(3, k, 1, dtype=torch.float64), 0)
    with pytest.raises(IndexError, match="no such position"):
        fused.draft_next(logits[0], ftok, finputs, k)


def test_a_restarted_one_row_is_a_new_one():
    """restart (a later step of the same time model) leaves what a new OneRow for that step has."""
    a = step_costs(TimeModel(b2=0.001, o0=0.2, o1=0.1), [300], 6)
    b = step_costs(TimeModel(b2=0.001, o0=0.2, o1=0.1), [40], 6)
    one = OneRow(a, 0.01, 5, [[0.0, 1.0, 0.0, 0.0]] * 6)
    for p in (0.9, 0.8, 0.1):
        one.add_logistic(p, p / 2)
    one.add(0.0)  # a path probability of 0: no longer prefix counts
    assert one.closed
    one.restart(b.ctx_list[0], b.fixed + b.ctx_sum, 3)
    assert vars(one) == vars(OneRow(b, 0.01, 3, [[0.0, 1.0, 0.0, 0.0]] * 6))


def test_compiled_one_row_refuses_what_python_refuses(ops):
    costs = step_costs(TimeModel(), [10], 4)
    one = new_one_row(costs, 0.0, 3, None, ops)
    with pytest.raises(ValueError, match="logistic weights"):
        one.add_logistic(0.5, 0.1)
    with pytest.raises(ValueError, match="finite"):
        one.add(math.nan)
    for made in (new_one_row(costs, 0.0, 3, ops.LogisticWeights([[0.0] * 4] * 3), ops),
                 OneRow(costs, 0.0, 3, [[0.0] * 4] * 3)):
        made.set_terms([0, 10, 20, 30, 40], [0.5] * 4)
        with pytest.raises(ValueError, match="in order"):
            made.next(2, 0.5, 0.1)  # draft 1 never arrived
    for made in (one, OneRow(costs, 0.0, 3)):
        with pytest.raises(ValueError, match="equal"):
            made.watch(np.zeros((3, 1)), np.zeros((2, 1)))
    with pytest.raises(TypeError):
        one.watch(np.zeros((3, 1), dtype=np.float32), np.zeros((3, 1)))  # not copied: would miss later rows
    with pytest.raises(ValueError, match="contiguous rows"):
        one.watch(np.zeros((3, 2))[:, :1], np.zeros((3, 1)))
    for made in (one, OneRow(costs, 0.0, 3)):
        with pytest.raises(IndexError, match="no budget terms for 1 drafts"):
            made.begin(10, 3, 1)  # set_budget never called
        made.set_budget(0.001, 1.0, 0, [[], [(1, 1.5, 2.0, 1.0)]], 1.0, 1000.0)
        with pytest.raises(IndexError, match="no budget terms for 2 drafts"):
            made.begin(10, 3, 2)
    one.watch(np.zeros((3, 1)), np.zeros((3, 1)))
    with pytest.raises(IndexError, match="no such row"):
        one.next_at(4)
    with pytest.raises(ValueError, match="in fours"):
        ops.logistic_estimate([1.0, 2.0], 0.5, 0.1)


def test_the_policy_decides_batch_1_with_the_compiled_one_row(ops):
    """An adaptive batch-1 step of a policy given the kernels uses the compiled OneRow, and one
    without them the Python one; the two steps answer alike, asked directly (keep_drafting) or
    through the draft loop's buffers (early_stop)."""
    cfg = SpeculativeConfig(num_speculative_tokens=3, adaptive=AdaptiveConfig(enabled=True))
    kinds, answers = [], []
    for compiled in (ops, None):
        for ask in ("keep_drafting", "early_stop"):
            policy = SpecPolicy(cfg, compiled=compiled)
            policy.install(TimeModel(version=1, b0=5.0, b1=0.1, d0=0.05, d1=0.0))  # drafting pays
            # a warm controller (a cold one probes at every step where drafting could pay)
            policy.cold = policy.cold_alone = False
            policy.begin_step("adaptive", np.array([5]), np.array([3]), 1, 3)  # the first step probes: not this one
            step = policy.begin_step("adaptive", np.array([5]), np.array([3]), 1, 3)
            assert step.budget > 0 and not step.probe
            top, margin, tokens = np.array([[0.9], [0.0], [0.0]]), np.array([[0.85], [0.0], [0.0]]), np.full((3, 1), 7)
            if ask == "keep_drafting":
                answers.append(step.keep_drafting(top[:1].T, margin[:1].T, tokens[:1].T))
            else:
                answers.append(step.early_stop(top, margin, tokens)(1))
            kinds.append(type(step._one).__module__)
    assert kinds == ["adaspec_cpu_ops"] * 2 + ["controller.one_row"] * 2
    assert len(set(answers)) == 1


@pytest.mark.parametrize("compiled", [True, False])
def test_the_last_steps_of_a_sequence_reuse_batch_1s_one_row_and_decide_as_one_built_for_their_cap(ops, monkeypatch,
                                                                                                   compiled):
    """Near max_tokens a step may verify fewer drafts than k: the policy's OneRow, built for k,
    is restarted, not rebuilt, and answers (early stop after every draft, then the keep set)
    as a OneRow built for exactly that many drafts."""
    import controller.policy as policy_module

    cfg = SpeculativeConfig(num_speculative_tokens=7, adaptive=AdaptiveConfig(enabled=True, min_gain=0.01))
    policy = SpecPolicy(cfg, compiled=ops if compiled else None)
    tm = TimeModel(version=1, b0=1.0, b1=0.02, b2=1e-4, d0=0.02, d_first=0.01, o0=0.3, o1=0.01)  # drafting is cheap
    policy.install(tm)
    built = []
    monkeypatch.setattr(policy_module, "new_one_row", lambda *a: built.append(a) or new_one_row(*a))
    rng = np.random.default_rng(3)
    weights, rates = policy.logistic.weights, policy.next_rates
    answers = []
    for step, cap in enumerate([7, 7, 6, 4, 3, 2, 1, 7, 5]):
        kv = 100 + 3 * step
        one = policy.one_row(tm, cap)
        one.begin(kv, cap, cap)
        costs = step_costs(tm, [0], cap)
        ref = OneRow(costs, cfg.adaptive.min_gain, cap, weights)
        ctx = step_costs(tm, [kv], cap).ctx_list[0]
        ref.restart(ctx, costs.fixed + ctx, cap)
        ref.set_terms([draft_units(tm.draft_ms(1, j)) for j in range(cap + 2)], rates)
        for j in range(1, cap + 1):
            p = float(rng.uniform(0.3, 1.0))
            m = p * float(rng.uniform(0.2, 1.0))
            if j < cap:  # the early stop asks about draft j + 1
                answers.append(ref.next(j, p, m))
                assert one.next(j, p, m) == answers[-1]
            else:  # the last draft the step may make: no question after it
                ref.add_logistic(p, m)
                one.add_logistic(p, m)
            assert one.keep(j) == ref.keep(j)
    assert len(built) == 1
    assert 5 < sum(answers) < len(answers) - 5  # both answers were reached


def test_a_column_of_logistic_estimates_is_the_same_doubles(ops):
    """A large batch's position estimated by the kernels (logistic_column), from float32 and
    float64 columns, edges included: each the same double as the per-draft formula."""
    rng = np.random.default_rng(2)
    edges = np.array([0.0, 1e-300, 1e-4, 0.5, 1 - 1e-4, 1.0, 1.5, -0.2])
    top = np.concatenate([np.repeat(edges, len(edges)), rng.uniform(0, 1, 3000)])
    margin = np.concatenate([np.tile(edges, len(edges)), rng.uniform(0, 1, 3000)])
    for dtype in (np.float64, np.float32):
        p, m = top.astype(dtype), margin.astype(dtype)
        w = rng.normal(0, 3, 4).tolist()
        want = [logistic_estimate(w, float(a), float(b)) for a, b in zip(p, m)]
        assert ops.logistic_column(w, p, m).tolist() == want


@pytest.mark.parametrize("at_rate", [True, False])
@pytest.mark.parametrize("dtype,b2,n", [(np.float64, 1e-6, 40), (np.float64, 2e-5, 40), (np.float32, 1e-6, 40),
                                        (np.float64, 2e-5, 2), (np.float64, 1e-6, 5), (np.float64, 2e-5, 9)])
def test_a_batch_decides_the_same_compiled_and_not(ops, dtype, b2, n, at_rate):
    """Adaptive-7 at batch n over 60 steps of random drafts, one policy with the kernels and
    one without: the same budgets, early-stop answers and keep sets every step. float64
    buffers, as the draft loop's: the compiled policy decides in its ManyRows (from batch 2:
    below 64 candidates the one without decides in plain Python); float32: in the kernels'
    functions one by one, with Python between them. b2: the context's cost, which the keep
    set's Dinkelbach rounds weigh; at_rate: the early stop at the budget's rate, or at Theta."""
    cfg = SpeculativeConfig(num_speculative_tokens=7,
                            adaptive=AdaptiveConfig(enabled=True, early_stop_at_rate=at_rate))
    policies = [SpecPolicy(cfg, compiled=c) for c in (ops, None)]
    for policy in policies:  # drafting pays at this batch size: the step drafts and decides
        policy.install(TimeModel(version=1, b0=8.0, b1=0.01, b2=b2, d0=0.3, d1=0.001, o0=0.3))
    rng = np.random.default_rng(5)
    k, stops, kept, many = 7, 0, 0, 0
    for _ in range(60):
        kv, cap = rng.integers(100, 900, n), rng.integers(0, k + 1, n)
        top = rng.beta(2, 1, (k, n)).astype(np.float32).astype(dtype)
        margin = (top * rng.uniform(0.3, 1, (k, n))).astype(np.float32).astype(dtype)
        accepted, seen = rng.integers(0, k + 1, n), []
        for policy in policies:
            step = policy.begin_step("adaptive", kv, cap, 1, k)
            more, m, answers = step.early_stop(top, margin, np.zeros((k, n), dtype=np.int64)), 0, []
            while m < step.budget:
                m += 1
                if m == step.budget:
                    break
                answers.append(more is None or more(m))  # None: a probe drafts its whole budget
                if not answers[-1]:
                    break
            keep = np.array(step.keep(top[:m].T, top[:m].T, margin[:m].T, np.zeros((n, m), dtype=np.int64)))
            policy.end_step(step, top[:m].T, margin[:m].T, keep, np.minimum(keep, accepted))
            seen.append((step.budget, answers, keep.tolist()))
            many += step._many is not None
        assert seen[0] == seen[1]
        stops += not all(seen[0][1])
        kept += sum(seen[0][2])
    assert stops and kept  # the early stop stopped some steps, and drafts were kept
    assert (many > 0) == (dtype == np.float64)  # ManyRows decided where the buffers allow it


def test_many_rows_answers_as_the_kernels_functions_one_by_one(ops):
    """ManyRows (a large batch's step, reading the draft buffers itself) against
    logistic_column, path_column, worth_drafting and decide_cols called one by one, on 300
    random steps with context costs spread wide enough that the keep set's Dinkelbach rounds
    change it (they must, in some), half of them keeping from the last early stop's drafts.
    Its context costs, from the contexts, are step_costs' (half-way cases included)."""
    from controller.decision import REFINE_ROUNDS

    rng = np.random.default_rng(11)
    refined = uniform = 0
    for case in range(300):
        n, k = int(rng.integers(10, 90)), int(rng.integers(1, 8))
        cap = rng.integers(0, k + 1, n).astype(np.int64)
        # context costs b2 kv as step_costs makes them, half-way cases (b2 5e-5: kv / 2 units) and none (b2 0) included
        b2 = float(rng.choice([0.0, 5e-5, float(rng.uniform(1e-6, 1e-4))]))
        kv = rng.integers(0, 4000, n)
        costs = step_costs(TimeModel(1, b2=b2), kv.tolist() if case % 2 else kv, n * k)
        ctx = costs.ctx if costs.ctx is not None else np.array(costs.ctx_list, dtype=np.int64)
        f = (np.cumsum(rng.integers(20, 200, n * (k + 1) + 1)) + 5000).astype(np.int64)
        fixed = int(rng.integers(0, 20000))
        draft = [0] + [int(x) for x in np.cumsum(rng.integers(100, 3000, k + 1)) + 2000]
        heads = [d + fixed + int(ctx.sum()) for d in draft]
        rates = rng.uniform(0.2, 1.0, k).tolist()
        weights = [[float(rng.normal(0.5, 1)), float(rng.uniform(0, 2)), float(rng.uniform(-2, 0)),
                    float(rng.uniform(0, 1))] for _ in range(k)]
        top = rng.beta(2, 1, (k, n))
        margin = top * rng.uniform(0, 1, (k, n))
        per_token, min_gain = int(rng.integers(0, 500)), float(rng.choice([0.0, 0.01]))
        many = ops.ManyRows(cap, kv.tolist() if case % 2 else kv, b2, f, fixed, draft, rates, per_token, min_gain,
                            REFINE_ROUNDS, ops.LogisticWeights(weights), top, margin)
        assert many.ctx == ctx.tolist() and many.uniform == costs.uniform, case
        uniform += costs.uniform
        cols = []
        for j in range(k):
            cols.append(ops.path_column(ops.logistic_column(weights[j], top[j], margin[j]), cols[-1] if j else None))
        # half the steps stop asking at the m they keep from (the keep set then starts from the early
        # stop's ranking without draft m + 1), the others ask to the end and keep from any m
        m = int(rng.integers(1, k + 1))
        for j in range(1, k if case % 2 else m + (m < k)):
            rate_q = int(quantize(rates[j]))
            want = ops.worth_drafting(cols[:j], cap, rate_q, ctx, f, heads[j], heads[j + 1], per_token, min_gain,
                                      costs.uniform)
            assert many.next_at(j) == want, (case, j)
        keep = ops.decide_cols(cols[:m], cap, ctx, f, heads[m], per_token, min_gain, costs.uniform, REFINE_ROUNDS)[0]
        first = case % 8  # exploration's rows: first, first + 8, ..: every draft verified (SpecStep.keep)
        rule, explored = many.keep_explored(m, first, 8)
        assert rule.tolist() == keep.tolist(), case
        assert explored == [min(int(c), m) if i >= first and (i - first) % 8 == 0 else int(r)
                            for i, (c, r) in enumerate(zip(cap, keep))], case
        refined += keep.tolist() != ops.decide_cols(cols[:m], cap, ctx, f, heads[m], per_token, min_gain,
                                                     costs.uniform, 0)[0].tolist()
    assert refined  # the rounds changed some keep sets, so the test sees whether ManyRows runs them
    assert 0 < uniform < 300  # both kinds of step (b2 = 0: every sequence's context costs the same)
