"""The pruning decision: how many of its k drafts each sequence sends to validation.

For sequence i and draft position j, `c[i, j]` estimates P(draft j accepted | drafts
before it accepted); the path probability is `a[i, j] = prod_{l <= j} c[i, l]`, and
keeping L_i drafts gives `E_i = 1 + sum_{j <= L_i} a[i, j]` expected tokens. With the
time models (controller/time_model.py) and the draft time already spent, the step's
estimated throughput is

    Theta(L) = E / (o0 + o1 E + T_draft + f(Q) + b2 * sum_i (L_i + 1) kv_i),  E = sum_i E_i, Q = n + sum_i L_i

Rule: rank every candidate (i, j) by its gain per marginal context cost, a[i, j] / (s +
b2 kv_i) with s the average marginal cost of a token under f (by a[i, j] alone when
every sequence costs the same), ties to smaller j, then smaller i; then keep the prefix
of that ranking with the highest Theta (argmax over all prefixes, not the first one that
stops improving). Since a[i, :] is non-increasing, every sequence keeps a prefix of its
drafts. When the cost depends only on Q (b2 = 0), the best set of m candidates is the m
with the largest a, so this is the optimum; with context costs it is the greedy ratio
order, within 1% of the optimum on random instances (tests/test_decision.py).

Determinism across ranks: confidences are quantised to 2^-12, path probabilities are
integers, times are integers in TIME_UNIT_NS (time_model.py; f rounded per Q), and Theta is the float
quotient of two integers below 2^53, which IEEE-754 rounds identically everywhere; no
rank can decide differently because of a float's last bit.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from controller.time_model import UNITS_PER_MS, TimeModel

SMALL = 64  # up to this many candidates, plain Python beats numpy's per-call overhead

CONF_BITS = 12
CONF_ONE = 1 << CONF_BITS  # fixed-point 1.0 for confidences and path probabilities
RATIO_BITS = 24  # fixed-point scale of the ranking key a / cost


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


def f_array(tm: TimeModel, n: int, extra: int) -> np.ndarray:
    """f(n + m) in time units for m = 0..extra."""
    return np.rint(tm.q_ms_at(np.arange(n, n + extra + 1)) * UNITS_PER_MS).astype(np.int64)


@lru_cache(maxsize=512)
def f_units(tm: TimeModel, n: int, extra: int) -> tuple[int, ...]:
    """f_array as Python ints, cached (small batches repeat the same model, n and extra)."""
    return tuple(int(x) for x in f_array(tm, n, extra))


def _fixed_units(tm: TimeModel, draft_ms: float) -> int:
    """The step's time that does not depend on the decision: drafting done, the rest's o0."""
    return int(round(draft_ms * UNITS_PER_MS)) + int(round(tm.o0 * UNITS_PER_MS))


def _per_token_units(tm: TimeModel) -> int:
    """o1, the rest's cost per emitted token, in time units."""
    return int(round(tm.o1 * UNITS_PER_MS))


def context_units(tm: TimeModel, kv) -> list[int]:
    return [int(round(tm.b2 * float(x) * UNITS_PER_MS)) for x in kv]


def decide(confidence: np.ndarray, kv_lens: np.ndarray, time_model: TimeModel, min_gain: float = 0.0,
           draft_ms: float = 0.0, max_keep: np.ndarray | None = None) -> np.ndarray:
    """confidence: (n, k) in [0, 1]; kv_lens: (n,) context length of each sequence;
    max_keep: (n,) optional per-sequence cap; min_gain: each kept draft must raise Theta by
    more than this fraction. Returns keep: (n,) int64 in 0..k."""
    n, k = confidence.shape
    if n == 0 or k == 0:
        return np.zeros(n, dtype=np.int64)
    if n * k <= SMALL:
        return np.array(_decide_small(np.asarray(confidence).tolist(), np.asarray(kv_lens).tolist(), time_model,
                                      min_gain, draft_ms, None if max_keep is None else np.asarray(max_keep).tolist()),
                        dtype=np.int64)
    return _decide_numpy(confidence, kv_lens, time_model, min_gain, draft_ms, max_keep)


def _best_prefix(theta: np.ndarray | list[float], min_gain: float) -> int:
    """The prefix length with the highest Theta (the shortest among equals). With min_gain
    g, prefix m scores Theta_m / (1 + g)^m: each kept draft must raise Theta by more than
    the fraction g (the divisors by repeated multiplication, identical in both paths)."""
    if min_gain:
        scale, divisor = 1.0 + min_gain, 1.0
        if isinstance(theta, list):
            scored = []
            for x in theta:
                scored.append(x / divisor)
                divisor *= scale
            theta = scored
        else:
            theta = theta / np.cumprod(np.concatenate(([1.0], np.full(len(theta) - 1, scale))))
    return max(range(len(theta)), key=theta.__getitem__) if isinstance(theta, list) else int(np.argmax(theta))


def _decide_numpy(confidence: np.ndarray, kv_lens: np.ndarray, time_model: TimeModel, min_gain: float,
                  draft_ms: float, max_keep: np.ndarray | None) -> np.ndarray:
    n, k = confidence.shape
    a = path_probs(quantize(confidence))  # (n, k)
    if max_keep is not None:
        a = np.where(np.arange(k)[None, :] < np.asarray(max_keep)[:, None], a, 0)
    ctx = np.array(context_units(time_model, kv_lens), dtype=np.int64)
    live = int((a > 0).sum())
    f = f_array(time_model, n, live)
    # Ranked by key desc, then j asc, then i asc: a stable sort on -key over a j-major layout.
    a_jmajor = a.T.reshape(-1)  # index = j * n + i
    if ctx.min() == ctx.max():
        key = a_jmajor
    else:
        s = max((int(f[-1]) - int(f[0])) // max(live, 1), 1)
        key = np.where(a_jmajor > 0, (a_jmajor << RATIO_BITS) // (s + np.tile(ctx, k)), -1)
    order = np.argsort(-key, kind="stable")[:live]  # the dead (a = 0) rank last: never kept
    seq = order % n
    e = n * CONF_ONE + np.concatenate(([0], np.cumsum(a_jmajor[order])))
    t = (_fixed_units(time_model, draft_ms) + f + int(ctx.sum()) + np.concatenate(([0], np.cumsum(ctx[seq])))
         + ((_per_token_units(time_model) * e) >> CONF_BITS))
    count = _best_prefix(e / np.maximum(t, 1), min_gain)
    return np.bincount(seq[:count], minlength=n).astype(np.int64)


def _decide_small(conf: list[list[float]], kv: list[int], tm: TimeModel, min_gain: float, draft_ms: float,
                  max_keep: list[int] | None) -> list[int]:
    """The same rule and the same arithmetic as `_decide_numpy`, in plain Python (equal
    results; tests check it). Small batches decide once per draft step, so this is on the
    hot path at batch 1."""
    n = len(conf)
    ctx = context_units(tm, kv)
    uniform = min(ctx) == max(ctx)
    cands = []  # (a, j, i)
    for i, row in enumerate(conf):
        acc = CONF_ONE
        limit = len(row) if max_keep is None else min(len(row), max_keep[i])
        for j, c in enumerate(row[:limit]):
            acc = (acc * min(max(int(round(c * CONF_ONE)), 0), CONF_ONE)) >> CONF_BITS
            if acc <= 0:
                break
            cands.append((acc, j, i))
    f = f_units(tm, n, len(cands))
    if uniform:
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    else:
        s = max((f[-1] - f[0]) // max(len(cands), 1), 1)
        cands.sort(key=lambda c: (-((c[0] << RATIO_BITS) // (s + ctx[c[2]])), c[1], c[2]))
    e, t, o = n * CONF_ONE, _fixed_units(tm, draft_ms) + sum(ctx), _per_token_units(tm)
    theta = [e / max(t + f[0] + ((o * e) >> CONF_BITS), 1)]
    for m, (acc, _, i) in enumerate(cands, 1):
        e, t = e + acc, t + ctx[i]
        theta.append(e / max(t + f[m] + ((o * e) >> CONF_BITS), 1))
    keep = [0] * n
    for _, _, i in cands[:_best_prefix(theta, min_gain)]:
        keep[i] += 1
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
