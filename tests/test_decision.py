"""The pruning decision (DESIGN.md section 3): hand cases and properties."""
from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from controller.decision import (CONF_ONE, SMALL, _decide_numpy, capped, decide_small, decide, path_probs, quantize,
                                 step_costs)
from controller.time_model import TimeModel

CHEAP = TimeModel(b0=10.0, b1=0.01, b2=0.0)  # validation nearly free per token: keep confident drafts
COSTLY = TimeModel(b0=1.0, b1=100.0, b2=0.0)  # each token costs far more than it can return


def test_all_pruned_when_tokens_cost_too_much():
    conf = np.full((4, 5), 0.9)
    assert decide(conf, np.full(4, 100), COSTLY).tolist() == [0, 0, 0, 0]


def test_confident_sequences_keep_everything():
    conf = np.full((3, 5), 0.99)
    assert decide(conf, np.full(3, 100), CHEAP).tolist() == [5, 5, 5]


def test_zero_confidence_is_never_kept():
    conf = np.array([[0.9, 0.0, 0.9], [0.0, 0.9, 0.9]])
    assert decide(conf, np.array([10, 10]), CHEAP).tolist() == [1, 0]


def test_min_gain_prunes_marginal_drafts():
    # step of 1 ms + 0.01 ms per token; the second draft (path probability 0.09) raises
    # throughput by 3.7% only.
    tm = TimeModel(b0=1.0, b1=0.01, b2=0.0)
    conf = np.array([[0.9, 0.1]])
    assert decide(conf, np.array([10]), tm, min_gain=0.0).tolist() == [2]
    assert decide(conf, np.array([10]), tm, min_gain=0.05).tolist() == [1]


# Two candidates with equal path probability 0.8 whose costs differ: with b1=0.5, b2=0.001,
# a context of 1000 makes a token cost 1.5 ms (0.8 / 1.5 is below the starting Theta of 2/3)
# and a context of 0 makes it cost 0.5 ms (0.8 / 0.5 is above it).
TIE_MODEL = TimeModel(b0=1.0, b1=0.5, b2=0.001)


def test_cheaper_candidate_ranks_first_whatever_the_order():
    conf = np.full((2, 1), 0.8)
    assert decide(conf, np.array([1000, 0]), TIE_MODEL).tolist() == [0, 1]
    assert decide(conf, np.array([0, 1000]), TIE_MODEL).tolist() == [1, 0]


def test_equal_costs_break_ties_by_position_then_sequence():
    # two sequences: a third validated token costs 0.5 ms, a fourth 1.5 ms; one draft of 0.8 pays, two do not
    tm = TimeModel(q_knots=(2.0, 3.0, 4.0), q_ms=(3.0, 3.5, 5.0))
    conf = np.full((2, 1), 0.8)
    assert decide(conf, np.array([5, 5]), tm).tolist() == [1, 0]


# f(Q): the second validated token costs 1.5 ms, each one after it 0.08 ms (a CPU's falling
# cost per token). Theta does not rise at the first draft but does by the seventh.
FALLING = TimeModel(q_knots=(1.0, 2.0, 8.0), q_ms=(3.0, 4.5, 5.0))


def test_keeps_the_best_prefix_not_the_first_that_stops_improving():
    conf = np.array([[0.5] + [0.95] * 6])
    assert decide(conf, np.array([10]), FALLING).tolist() == [7]


def test_context_length_term_prunes_long_sequences_first():
    tm = TimeModel(b0=1.0, b1=0.05, b2=0.002)
    conf = np.full((2, 4), 0.7)
    keep = decide(conf, np.array([10, 2000]), tm)
    assert keep[0] > keep[1]


def _theta(a_float, keep, tm, kv, draft_ms):
    e = len(keep) + sum(a_float[i, :keep[i]].sum() for i in range(len(keep)))
    return e / (draft_ms + tm.validate_ms(np.asarray(keep) + 1, kv))


conf_arrays = st.integers(1, 6).flatmap(lambda n: st.integers(1, 7).flatmap(
    lambda k: st.lists(st.lists(st.floats(0, 1), min_size=k, max_size=k), min_size=n, max_size=n)))


@settings(max_examples=300, deadline=None)
@given(conf=conf_arrays, b0=st.floats(0.1, 20), b1=st.floats(0.001, 5), b2=st.floats(0, 0.01),
       draft_ms=st.floats(0, 10), seed=st.integers(0, 1000))
def test_properties(conf, b0, b1, b2, draft_ms, seed):
    conf = np.array(conf)
    n, k = conf.shape
    kv = np.random.default_rng(seed).integers(1, 500, n)
    tm = TimeModel(b0=b0, b1=b1, b2=b2)
    keep = decide(conf, kv, tm, draft_ms=draft_ms)
    a = path_probs(quantize(conf))  # the decision's integer path probabilities
    assert ((0 <= keep) & (keep <= k)).all()
    # Theta in the decision's own arithmetic (times in 100 ns units): exact. In float ms the
    # rounding of the times to units can reverse a near tie by up to ~1e-4 of Theta.
    theta = lambda keep: _theta_units(a, keep, tm, kv, draft_ms)  # noqa: E731
    assert theta(keep) >= theta(np.zeros(n, int))  # never below keeping nothing
    # per-sequence prefix: every kept position has a positive path probability
    for i in range(n):
        assert all(a[i, j] > 0 for j in range(keep[i]))
    if b2 == 0:  # equals the best over all prefixes of the ranked candidate list
        order = sorted(((-a[i, j], j, i) for i in range(n) for j in range(k)))
        best = theta(np.zeros(n, int))
        prefix = np.zeros(n, int)
        for neg_a, j, i in order:
            if -neg_a <= 0:
                break
            prefix[i] = j + 1
            best = max(best, theta(prefix))
        assert theta(keep) == best


@settings(max_examples=300, deadline=None)
@given(conf=conf_arrays, b0=st.floats(0.1, 20), b1=st.floats(0.001, 5), b2=st.floats(0, 0.01),
       draft_ms=st.floats(0, 10), min_gain=st.sampled_from([0.0, 0.01, 0.1]), seed=st.integers(0, 1000))
def test_small_path_equals_vectorised_path(conf, b0, b1, b2, draft_ms, min_gain, seed):
    conf = np.array(conf)
    rng = np.random.default_rng(seed)
    kv = rng.integers(1, 500, conf.shape[0])
    cap = rng.integers(0, conf.shape[1] + 1, conf.shape[0])
    tm = TimeModel(b0=b0, b1=b1, b2=b2)
    costs = step_costs(tm, kv, conf.size)
    for max_keep in (None, cap):
        small = decide_small(conf.tolist(), costs, min_gain, draft_ms, None if max_keep is None else max_keep.tolist())
        assert small == _decide_numpy(conf, costs, min_gain, draft_ms, max_keep).tolist()


@settings(max_examples=300, deadline=None)
@given(row=st.integers(1, 7).flatmap(lambda k: st.lists(st.floats(0, 1), min_size=k, max_size=k)),
       b0=st.floats(0.1, 20), b1=st.floats(0.001, 5), b2=st.floats(0, 0.01), o1=st.floats(0, 1),
       draft_ms=st.floats(0, 10), min_gain=st.sampled_from([0.0, 0.01, 0.1]), kv=st.integers(1, 500),
       cap=st.integers(0, 7))
def test_one_sequence_path_equals_vectorised_path(row, b0, b1, b2, o1, draft_ms, min_gain, kv, cap):
    """best_one (batch 1's hot path, once per draft step) decides as the general rule."""
    from controller.decision import best_one

    costs = step_costs(TimeModel(b0=b0, b1=b1, b2=b2, o1=o1), [kv], len(row))
    for max_keep in (None, min(cap, len(row))):
        one = best_one(row, costs, min_gain, draft_ms, max_keep)[0]
        cap_arr = None if max_keep is None else np.array([max_keep])
        assert one == _decide_numpy(np.array([row]), costs, min_gain, draft_ms, cap_arr)[0]



@settings(max_examples=300, deadline=None)
@given(row=st.integers(1, 7).flatmap(lambda k: st.lists(st.floats(0, 1), min_size=k, max_size=k)),
       b0=st.floats(0.1, 20), b1=st.floats(0.001, 5), b2=st.floats(0, 0.01), o1=st.floats(0, 1),
       d_first=st.floats(0, 3), g=st.floats(0, 3), min_gain=st.sampled_from([0.0, 0.01, 0.1]),
       kv=st.integers(1, 500), cap=st.integers(0, 7), rate=st.floats(0, 1),
       lam=st.one_of(st.none(), st.floats(0, 2)))
@example(row=[1.0], b0=1.0, b1=1.0, b2=0.0, o1=0.0, d_first=2.0, g=0.0, min_gain=0.1, kv=1, cap=2, rate=0.5,
         lam=None)
def test_one_row_built_up_a_draft_at_a_time_decides_as_best_one(row, b0, b1, b2, o1, d_first, g, min_gain, kv,
                                                               cap, rate, lam):
    """OneRow (batch 1, prefixes added as drafts arrive) answers the early stop and the keep
    rule exactly as worth_drafting and best_one do, after every draft; the early stop at a
    rate lam (as begin sets it) or at Theta (None)."""
    from controller.decision import best_one, draft_units
    from controller.early_stop import worth_drafting
    from controller.one_row import OneRow

    costs = step_costs(TimeModel(b0=b0, b1=b1, b2=b2, o1=o1), [kv], len(row) + 1)  # (the draft after the last)
    one = OneRow(costs, min_gain, cap)
    one.lam = -1.0 if lam is None else lam
    draft_ms = [d_first + j * g if j else 0.0 for j in range(len(row) + 2)]
    for j, c in enumerate(row, 1):
        one.add(c)
        assert one.best(draft_units(draft_ms[j]), j) == best_one(row[:j], costs, min_gain, draft_ms[j], cap)
        expected = worth_drafting([[x] for x in row[:j]], costs, min_gain, draft_ms[j], draft_ms[j + 1], rate, [cap],
                                  lam)
        assert one.worth_drafting(draft_units(draft_ms[j]), draft_units(draft_ms[j + 1]), rate) == expected


def _theta_units(a, keep, tm, kv, draft_ms):
    """Theta in the decision's own arithmetic (integer path probabilities and time units)."""
    from controller.decision import UNITS_PER_MS, context_units, f_array

    n = len(keep)
    e = n * CONF_ONE + sum(int(a[i, :keep[i]].sum()) for i in range(n))
    ctx = context_units(tm, kv)
    t = (int(round(draft_ms * UNITS_PER_MS)) + int(round(tm.o0 * UNITS_PER_MS))
         + int(f_array(tm, n, int(sum(keep)))[-1]) + sum((keep[i] + 1) * ctx[i] for i in range(n))
         + ((int(round(tm.o1 * UNITS_PER_MS)) * e) >> 12))
    return e / max(t, 1)


def _random_table(rng) -> TimeModel:
    knots = (1.0, 2.0, 4.0, 8.0, 16.0)
    values = np.cumsum(rng.uniform(0.0, 3.0, len(knots)))  # non-decreasing, any shape
    return TimeModel(q_knots=knots, q_ms=tuple(float(v) for v in values))


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 4), k=st.integers(1, 5), table=st.booleans(),
       context=st.booleans())
def test_equals_exhaustive_optimum(seed, n, k, table, context):
    """Against every combination of per-sequence prefixes: the optimum, whether the cost
    depends only on the total number of validated tokens or also on each sequence's
    context (the ratio order alone reached 0.987 of it on some of these instances; the
    Dinkelbach rounds close the gap)."""
    import itertools

    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.0, 1.0, (n, k)) ** rng.uniform(0.2, 2.0)
    kv = rng.integers(1, 2000, n)
    b2 = float(rng.uniform(0.0, 0.003)) if context else 0.0
    tm = _random_table(rng) if table else TimeModel(b0=float(rng.uniform(0.1, 10)), b1=float(rng.uniform(0.01, 3)))
    # the rest of the step: fixed and per emitted token
    tm = TimeModel(**{**tm.__dict__, "b2": b2, "o0": float(rng.uniform(0, 1)), "o1": float(rng.uniform(0, 0.3))})
    draft_ms = float(rng.uniform(0, 5))
    keep = decide(conf, kv, tm, draft_ms=draft_ms)
    a = path_probs(quantize(conf))
    best = max(_theta_units(a, np.array(c), tm, kv, draft_ms) for c in itertools.product(range(k + 1), repeat=n))
    got = _theta_units(a, keep, tm, kv, draft_ms)
    assert got >= best * (1 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(conf=conf_arrays, draft_ms=st.floats(0, 10), min_gain=st.sampled_from([0.0, 0.01, 0.1]),
       seed=st.integers(0, 1000))
def test_small_path_equals_vectorised_path_with_tables(conf, draft_ms, min_gain, seed):
    conf = np.array(conf)
    rng = np.random.default_rng(seed)
    kv = rng.integers(1, 500, conf.shape[0])
    tm = TimeModel(**{**_random_table(rng).__dict__, "b2": float(rng.uniform(0, 0.002)),
                      "o0": float(rng.uniform(0, 1)), "o1": float(rng.uniform(0, 0.3))})
    costs = step_costs(tm, kv, conf.size)
    small = decide_small(conf.tolist(), costs, min_gain, draft_ms, None)
    assert small == _decide_numpy(conf, costs, min_gain, draft_ms, None).tolist()


@settings(max_examples=100, deadline=None)
@given(b2=st.floats(0, 0.01), seed=st.integers(0, 1000))
def test_context_costs_are_the_same_integers_for_large_batches(b2, seed):
    """Large batches compute the per-sequence context costs vectorised: the same
    integers (round half to even) as the small path's Python arithmetic."""
    kv = np.random.default_rng(seed).integers(0, 100_000, 3 * SMALL)
    tm = TimeModel(b2=b2)
    small = [step_costs(tm, kv[i:i + SMALL], SMALL).ctx_list for i in range(0, len(kv), SMALL)]
    assert step_costs(tm, kv, 1).ctx.tolist() == [x for part in small for x in part]


def test_a_tie_keeps_the_shorter_prefix():
    """Theta with the draft equals Theta without it (4096 / 1000 = 6144 / 1500): both paths
    keep nothing, so every rank breaks the tie the same way."""
    from controller.decision import StepCosts, best_one

    costs = StepCosts(n=1, ctx=None, ctx_list=[0], ctx_sum=0, uniform=True, fixed=0, per_token=0,
                      f=np.array([1000, 1500]), f_list=(1000, 1500))
    assert best_one([0.5], costs, 0.0, 0.0, None) == (0, 4.096)
    assert _decide_numpy(np.array([[0.5]]), costs, 0.0, 0.0, None).tolist() == [0]
    from controller.one_row import OneRow

    one = OneRow(costs, 0.0, 1)
    assert not one.worth_drafting(0, 0, 0.5)  # the early stop: a draft that only ties is not drafted
    one.add(0.5)
    assert one.best(0, 1) == (0, 4.096)


def test_early_stop_from_kept_path_probabilities_equals_the_rule():
    """A large batch's early stop reads the path probabilities its step quantised once per
    position (worth_drafting_paths): the same answer as worth_drafting from the estimates,
    on random batches, context costs, caps and min_gain, drafting paying and not, at Theta and
    at a rate near the step's own."""
    from controller.decision import decide_scored
    from controller.early_stop import worth_drafting, worth_drafting_paths

    rng = np.random.default_rng(7)
    answers, rated = [], []
    for _ in range(300):
        n, j = int(rng.integers(16, 70)), int(rng.integers(1, 7))
        tm = TimeModel(1, b0=float(rng.uniform(1, 5)), b1=float(rng.uniform(0.001, 0.2)),
                       b2=float(rng.choice([0.0, 1e-5, 1e-4])))
        costs = step_costs(tm, rng.integers(10, 500, n), n * 8)
        conf = rng.beta(float(rng.uniform(0.5, 5)), 1.0, size=(n, j))
        cap, rate = rng.integers(0, 8, n), float(rng.uniform(0.3, 1.0))
        stop_ms = float(rng.uniform(0, 2))
        go_ms = stop_ms + float(rng.choice([0.001, 0.05, 0.5]))
        min_gain = float(rng.choice([0.0, 0.01]))
        paths = path_probs(quantize(conf))
        lam = None if rng.random() < 0.5 else decide_scored(conf, costs, min_gain, stop_ms, cap)[1] * rng.uniform(0.6, 1)
        got = worth_drafting_paths([paths[:, c] for c in range(j)], costs, min_gain, stop_ms, go_ms, rate, cap,
                                   lam=lam)
        assert got == worth_drafting([conf[:, c] for c in range(j)], costs, min_gain, stop_ms, go_ms, rate, cap, lam)
        answers.append(got)
        if lam is not None:
            rated.append(got)
    assert 10 < sum(answers) < 290, sum(answers)  # both answers were reached (24 True here)
    assert 5 < sum(rated) < len(rated) - 5, sum(rated)  # ... at a rate too


def test_compiled_ranking_is_the_numpy_one_bit_for_bit(ops):
    """models/csrc/rank.cpp's rank_best against decision.py's: every key (plain, ratio,
    Dinkelbach), min_gain, ties (few distinct confidences), drafts that may not be kept, and
    context lengths of 0; the same keep, count, score (the same double), E and T."""
    from controller.decision import rank_best

    rng = np.random.default_rng(3)
    for case in range(400):
        n, k = int(rng.integers(1, 300)), int(rng.integers(1, 9))
        tm = TimeModel(1, b0=float(rng.uniform(1, 5)), b1=float(rng.uniform(0.001, 0.2)),
                       b2=float(rng.choice([0.0, 1e-5, 1e-4])), o1=float(rng.choice([0.0, 0.05])))
        kv = rng.integers(0, 500, n)
        costs = step_costs(tm, kv, n * k)
        levels = rng.choice([0.0, 0.25, 0.5, 0.9, 1.0], size=(n, k)) if case % 2 else rng.beta(2, 1, (n, k))
        a = capped(path_probs(quantize(levels)), rng.integers(0, k + 1, n))
        mode = case % 3
        ctx = costs.ctx if costs.ctx is not None else np.array(costs.ctx_list, dtype=np.int64)
        args = (a, mode, int(rng.integers(1, 1000)), int(rng.integers(-10**6, 10**9)), int(rng.integers(0, 10**6)),
                ctx, costs.f, int(rng.integers(0, 10**5)), costs.per_token, float(rng.choice([0.0, 0.01, 0.1])))
        want, got = rank_best(*args), ops.rank_best(*args)
        assert np.array_equal(got[0], want[0]) and got[1:] == want[1:], case


def test_the_rule_and_the_early_stop_decide_the_same_compiled(ops):
    """The large batch's keep set from its columns (decide_paths with its Dinkelbach rounds)
    and its early stop give the same answers compiled as with numpy."""
    from controller.decision import decide_cols, decide_paths
    from controller.early_stop import worth_drafting_paths

    rng = np.random.default_rng(11)
    answers, rated = [], []
    for _ in range(200):
        n, j = int(rng.integers(16, 260)), int(rng.integers(1, 8))
        tm = TimeModel(1, b0=float(rng.uniform(1, 5)), b1=float(rng.uniform(0.001, 0.2)),
                       b2=float(rng.choice([0.0, 1e-5, 1e-4])), o1=float(rng.choice([0.0, 0.05])))
        costs = step_costs(tm, rng.integers(10, 900, n), n * 8)
        paths = path_probs(quantize(rng.beta(float(rng.uniform(0.5, 5)), 1.0, size=(n, j))))
        cap, min_gain = rng.integers(0, 8, n), float(rng.choice([0.0, 0.01]))
        a = capped(paths, cap)
        cols = [paths[:, c] for c in range(j)]
        assert np.array_equal(decide_cols(cols, cap, costs, min_gain, 0.5, ops), decide_paths(a, costs, min_gain, 0.5))
        go_ms = 0.3 + float(rng.choice([0.001, 0.05, 0.5]))
        args = ([paths[:, c] for c in range(j)], costs, min_gain, 0.3, go_ms, float(rng.uniform(0.3, 1.0)), cap)
        # at Theta, and at a rate near the step's own (the early stop's default)
        lam = None if rng.random() < 0.5 else decide_paths(a, costs, min_gain, 0.3, False, True)[1] * rng.uniform(0.6, 1)
        answers.append(worth_drafting_paths(*args, lam=lam))
        assert worth_drafting_paths(*args, compiled=ops, lam=lam) == answers[-1]
        if lam is not None:
            rated.append(answers[-1])
    assert 5 <= sum(answers) <= 195, sum(answers)  # both answers were reached (10 True here)
    assert 3 <= sum(rated) <= len(rated) - 3, sum(rated)  # ... at a rate too


def test_compiled_path_columns_are_path_probs(ops):
    """The kernels' path_column, position by position, equals quantize then path_probs on
    estimates at and past 0 and 1 and at the rounding's half-way points."""
    rng = np.random.default_rng(4)
    halves = (np.arange(40) + 0.5) / CONF_ONE
    conf = np.concatenate([[0.0, 1.0, -0.1, 1.3, 1e-9], halves, rng.uniform(0, 1, 955)])
    conf = np.stack([rng.permutation(conf) for _ in range(5)], 1)  # (1000, 5)
    want, prev = path_probs(quantize(conf)), None
    for j in range(conf.shape[1]):
        prev = ops.path_column(conf[:, j], prev)
        assert np.array_equal(prev, want[:, j])
