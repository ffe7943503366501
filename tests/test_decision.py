"""The pruning decision (DESIGN.md section 3): hand cases and properties."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.decision import CONF_ONE, _decide_numpy, _decide_small, decide, path_probs, quantize
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


def test_ties_break_by_position_then_sequence():
    conf = np.full((2, 1), 0.8)
    # equal a: sequence 0 is ranked first. Costly there, it stops the walk at once ...
    assert decide(conf, np.array([1000, 0]), TIE_MODEL).tolist() == [0, 0]
    # ... cheap there, it is kept, and then the costly sequence 1 is not
    assert decide(conf, np.array([0, 1000]), TIE_MODEL).tolist() == [1, 0]
    # equal a at positions 1 and 2 (confidence 1.0 at 2): position 1 of the costly sequence 1
    # comes before position 2 of the cheap sequence 0, and stops the walk there
    conf2 = np.array([[0.8, 1.0], [0.8, 0.0]])
    assert decide(conf2, np.array([0, 1000]), TIE_MODEL).tolist() == [1, 0]


def _scan_on(conf, kv, tm):
    """xLLM's merged rule, for contrast: walk the same ranking but skip (not stop at) a
    candidate that does not raise Theta."""
    n, k = conf.shape
    a = path_probs(quantize(conf)) / CONF_ONE
    keep = np.zeros(n, int)
    for neg_a, j, i in sorted((-a[i, j], j, i) for i in range(n) for j in range(k)):
        trial = keep.copy()
        trial[i] = j + 1
        if keep[i] == j and _theta(a, trial, tm, kv, 0.0) > _theta(a, keep, tm, kv, 0.0):
            keep = trial
    return keep.tolist()


def test_stop_is_causal():
    """The walk stops at the first candidate that does not pay: a later, cheaper one
    (here sequence 1's, ranked after sequence 0's equal one) cannot be verified instead,
    which scanning on would do."""
    conf, kv = np.full((2, 1), 0.8), np.array([1000, 0])
    assert _scan_on(conf, kv, TIE_MODEL) == [0, 1]
    assert decide(conf, kv, TIE_MODEL).tolist() == [0, 0]


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
    a = path_probs(quantize(conf)) / CONF_ONE
    assert ((0 <= keep) & (keep <= k)).all()
    # never below keeping nothing
    assert _theta(a, keep, tm, kv, draft_ms) >= _theta(a, np.zeros(n, int), tm, kv, draft_ms) * (1 - 1e-9)
    # per-sequence prefix: every kept position has a positive path probability
    for i in range(n):
        assert all(a[i, j] > 0 for j in range(keep[i]))
    if b2 == 0:  # equals the best over all prefixes of the ranked candidate list
        order = sorted(((-a[i, j], j, i) for i in range(n) for j in range(k)))
        best = 0.0
        prefix = np.zeros(n, int)
        for neg_a, j, i in order:
            if -neg_a <= 0:
                break
            prefix[i] = j + 1
            best = max(best, _theta(a, prefix, tm, kv, draft_ms))
        best = max(best, _theta(a, np.zeros(n, int), tm, kv, draft_ms))
        assert _theta(a, keep, tm, kv, draft_ms) >= best * (1 - 1e-6)


@settings(max_examples=300, deadline=None)
@given(conf=conf_arrays, b0=st.floats(0.1, 20), b1=st.floats(0.001, 5), b2=st.floats(0, 0.01),
       draft_ms=st.floats(0, 10), min_gain=st.sampled_from([0.0, 0.01, 0.1]), seed=st.integers(0, 1000))
def test_small_path_equals_vectorised_path(conf, b0, b1, b2, draft_ms, min_gain, seed):
    conf = np.array(conf)
    rng = np.random.default_rng(seed)
    kv = rng.integers(1, 500, conf.shape[0])
    cap = rng.integers(0, conf.shape[1] + 1, conf.shape[0])
    tm = TimeModel(b0=b0, b1=b1, b2=b2)
    for max_keep in (None, cap):
        small = _decide_small(conf.tolist(), kv.tolist(), tm, min_gain, draft_ms,
                              None if max_keep is None else max_keep.tolist())
        assert small == _decide_numpy(conf, kv, tm, min_gain, draft_ms, max_keep).tolist()
