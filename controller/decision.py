"""The pruning decision: how many of its k drafts each sequence sends to validation.

For sequence i and draft position j, `c[i, j]` estimates P(draft j accepted | drafts
before it accepted); the path probability is `a[i, j] = prod_{l <= j} c[i, l]`, and
keeping L_i drafts gives `E_i = 1 + sum_{j <= L_i} a[i, j]` expected tokens. With the
validate-time model T_val(L) and the (already spent) draft time T_draft, the step's
estimated throughput is

    Theta(L) = sum_i E_i / (T_draft + T_val(L))

Rule: rank every (i, j) by a[i, j], descending (ties: smaller j, then smaller i); walk
the list and add a candidate while it raises Theta by more than `min_gain * Theta`;
**stop at the first that does not**. Since a[i, :] is non-increasing, every sequence keeps
a prefix. The stop keeps the choice causal: a later, weaker candidate never decides
whether an earlier token is verified.

Determinism across ranks: confidences are quantised to 2^-12, path probabilities are
integers, times are integers in TIME_UNIT_NS, and the Theta comparison is an exact
integer cross-multiplication, so no rank can decide differently because of a float's
last bit.
"""
from __future__ import annotations

import numpy as np

from controller.time_model import TIME_UNIT_NS, TimeModel

INT64_SAFE = 1 << 62
SMALL = 64  # up to this many candidates, plain Python beats numpy's per-call overhead

CONF_BITS = 12
CONF_ONE = 1 << CONF_BITS  # fixed-point 1.0 for confidences and path probabilities
GAIN_ONE = 1 << 10  # fixed-point 1.0 for min_gain


def quantize(confidence: np.ndarray) -> np.ndarray:
    """Confidences in [0, 1] -> int64 in [0, CONF_ONE]."""
    return np.clip(np.rint(np.asarray(confidence, dtype=np.float64) * CONF_ONE), 0, CONF_ONE).astype(np.int64)


def path_probs(conf_q: np.ndarray) -> np.ndarray:
    """(n, k) quantised confidences -> (n, k) quantised path probabilities (exact integers)."""
    a = np.empty_like(conf_q)
    acc = np.full(conf_q.shape[0], CONF_ONE, dtype=np.int64)
    for j in range(conf_q.shape[1]):
        acc = (acc * conf_q[:, j]) >> CONF_BITS
        a[:, j] = acc
    return a


def decide(confidence: np.ndarray, kv_lens: np.ndarray, time_model: TimeModel, min_gain: float = 0.0,
           draft_ms: float = 0.0, max_keep: np.ndarray | None = None) -> np.ndarray:
    """confidence: (n, k) in [0, 1]; kv_lens: (n,) context length of each sequence;
    max_keep: (n,) optional per-sequence cap. Returns keep: (n,) int64 in 0..k."""
    n, k = confidence.shape
    keep = np.zeros(n, dtype=np.int64)
    if n == 0 or k == 0:
        return keep
    if n * k <= SMALL:
        return np.array(_decide_small(np.asarray(confidence).tolist(), np.asarray(kv_lens).tolist(), time_model,
                                      min_gain, draft_ms, None if max_keep is None else np.asarray(max_keep).tolist()),
                        dtype=np.int64)
    return _decide_numpy(confidence, kv_lens, time_model, min_gain, draft_ms, max_keep)


def _decide_numpy(confidence: np.ndarray, kv_lens: np.ndarray, time_model: TimeModel, min_gain: float,
                  draft_ms: float, max_keep: np.ndarray | None) -> np.ndarray:
    n, k = confidence.shape
    a = path_probs(quantize(confidence))  # (n, k)
    if max_keep is not None:
        a = np.where(np.arange(k)[None, :] < np.asarray(max_keep)[:, None], a, 0)
    kv = np.asarray(kv_lens, dtype=np.int64)
    base_t, token_t = time_model.step_units(kv, draft_ms)  # int, (n,) int: cost of one more query token
    # Candidates ranked by a desc, then position j asc, then sequence i asc (a stable sort on -a
    # over entries laid out j-major gives exactly that order).
    a_jmajor = a.T.reshape(-1)  # index = j * n + i
    order = np.argsort(-a_jmajor, kind="stable")
    gains = a_jmajor[order]
    seq = order % n
    costs = token_t[seq]
    live = gains > 0
    # Theta before candidate s: E_prev / T_prev; after: (E_prev + gain) / (T_prev + cost).
    e_after = n * CONF_ONE + np.cumsum(gains)
    t_after = base_t + np.cumsum(costs)
    e_before = np.concatenate(([n * CONF_ONE], e_after[:-1]))
    t_before = np.concatenate(([base_t], t_after[:-1]))
    gain_q = int(round(min_gain * GAIN_ONE))
    # (e_after / t_after) > (e_before / t_before) * (1 + min_gain), in exact integers
    exact = int(e_after[-1]) * int(t_after[-1]) * (GAIN_ONE + gain_q) < INT64_SAFE
    dtype = np.int64 if exact else object  # Python ints where int64 could overflow
    lhs = e_after.astype(dtype) * t_before.astype(dtype) * GAIN_ONE
    rhs = e_before.astype(dtype) * t_after.astype(dtype) * (GAIN_ONE + gain_q)
    improves = (lhs > rhs) & live
    count = int(np.argmin(improves)) if not improves.all() else len(improves)
    return np.bincount(seq[:count], minlength=n).astype(np.int64)


def _decide_small(conf: list[list[float]], kv: list[int], tm: TimeModel, min_gain: float, draft_ms: float,
                  max_keep: list[int] | None) -> list[int]:
    """The same rule and the same integer arithmetic as `decide`, in plain Python (exactly
    equal results; tests check it). Small batches decide once per draft step, so this is
    on the hot path at batch 1."""
    n = len(conf)
    cands = []  # (-a, j, i): the ranking order
    for i, row in enumerate(conf):
        acc = CONF_ONE
        limit = len(row) if max_keep is None else min(len(row), max_keep[i])
        for j, c in enumerate(row[:limit]):
            acc = (acc * min(max(int(round(c * CONF_ONE)), 0), CONF_ONE)) >> CONF_BITS
            if acc <= 0:
                break
            cands.append((-acc, j, i))
    cands.sort()
    unit = 1_000_000 // TIME_UNIT_NS
    token_t = [int(round((tm.b1 + tm.b2 * float(x)) * unit)) for x in kv]
    e, t = n * CONF_ONE, max(int(round((draft_ms + tm.b0) * unit)) + sum(token_t), 1)
    scale = GAIN_ONE + int(round(min_gain * GAIN_ONE))
    keep = [0] * n
    for neg_a, _, i in cands:
        e2, t2 = e - neg_a, t + token_t[i]
        if e2 * t * GAIN_ONE <= e * t2 * scale:
            break  # the first candidate that does not raise Theta ends the walk
        e, t, keep[i] = e2, t2, keep[i] + 1
    return keep


if __name__ == "__main__":  # python -m controller.decision: the decision's cost per call
    import time

    tm = TimeModel(b0=2.0, b1=0.05, b2=1e-5)
    rng = np.random.default_rng(0)
    for n in (1, 8, 32, 256):
        conf, kv = rng.random((n, 7)), rng.integers(10, 500, n)
        decide(conf, kv, tm)
        t0 = time.perf_counter()
        for _ in range(200):
            decide(conf, kv, tm)
        print(f"decide n={n} k=7: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms")
