"""The pruning decision: how many of its k drafts each sequence sends to validation.

For sequence i and draft position j, `c[i, j]` estimates P(draft j accepted | drafts
before it accepted); the path probability is `a[i, j] = prod_{l <= j} c[i, l]`, and
keeping L_i drafts gives `E_i = 1 + sum_{j <= L_i} a[i, j]` expected tokens. With the
time models (controller/time_model.py) and the draft time already spent, the step's
estimated throughput is

    Theta(L) = E / (o0' + o1 E + T_draft + f(Q) + b2 * sum_i (L_i + 1) kv_i),  E = sum_i E_i, Q = n + sum_i L_i

(o0' = o0 + o2 + o3 n: the rest of a step that drafted, whatever it keeps.)

Rule: rank every candidate (i, j) by its gain per marginal context cost, a[i, j] / (s +
b2 kv_i) with s the average marginal cost of a token under f (by a[i, j] alone when
every sequence costs the same), ties to smaller j, then smaller i; then keep the prefix
of that ranking with the highest Theta (argmax over all prefixes, not the first one that
stops improving). Since a[i, :] is non-increasing, every sequence keeps a prefix of its
drafts. When the cost depends only on Q (b2 = 0), the best set of m candidates is the m
with the largest a, so this is the optimum. With context costs, Dinkelbach rounds follow:
with lambda the best prefix's Theta, rank by a (1 - lambda o1) - lambda b2 kv_i (in
integers) and take that ranking's best prefix, while Theta rises; this reaches the
exhaustive optimum (tests/test_decision.py). The early stop skips the rounds (refine=False).

Determinism across ranks: confidences are quantised to 2^-12, path probabilities are
integers, times are integers in TIME_UNIT_NS (time_model.py; f rounded per Q), and Theta is the float
quotient of two integers below 2^53, which IEEE-754 rounds identically everywhere; no
rank can decide differently because of a float's last bit.
"""
from __future__ import annotations

from typing import NamedTuple

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


def context_unit(tm: TimeModel, kv: int) -> int:
    """A validated token's context cost, b2 * kv, in time units."""
    return int(round(tm.b2 * float(kv) * UNITS_PER_MS))


def context_units(tm: TimeModel, kv) -> list[int]:
    return [context_unit(tm, x) for x in kv]


class StepCosts(NamedTuple):
    """The decision's time terms for one step, in time units, computed once per step (a
    step decides once per draft position and once more for the keep set)."""

    n: int
    ctx: np.ndarray | None  # (n,) b2 * kv_i: a validated token's context cost, per sequence (None: see ctx_list)
    ctx_list: list[int]  # the same as Python ints (small batches; empty for large ones)
    ctx_sum: int
    uniform: bool  # every sequence's context cost is the same
    fixed: int  # o0 + o2 + o3 n, the rest of a drafting step's fixed cost
    per_token: int  # o1, the rest's cost per emitted token
    f: np.ndarray  # f(n + m) for m = 0..extra
    f_list: tuple[int, ...]  # its first SMALL + 1 values as Python ints (the small path)


def step_costs(tm: TimeModel, kv, extra: int, f: tuple | None = None) -> StepCosts:
    """Costs for up to `extra` validated drafts over the n = len(kv) sequences; f, when
    given, is f_table(tm, n, extra) computed before (steps of one batch size repeat it)."""
    n = len(kv)
    f_np, f_list = f_table(tm, n, extra) if f is None else f
    fixed, per_token = rest_units(tm, n)
    if n <= SMALL:  # the small path may run (n * k <= SMALL): Python ints, no numpy calls
        ctx_list = context_units(tm, kv)
        uniform = n == 0 or min(ctx_list) == max(ctx_list)
        return StepCosts(n, None, ctx_list, sum(ctx_list), uniform, fixed, per_token, f_np, f_list)
    # np.rint rounds half to even, as round() does: the same integers as context_units
    ctx = np.rint(tm.b2 * np.asarray(kv, dtype=np.float64) * UNITS_PER_MS).astype(np.int64)
    return StepCosts(n, ctx, [], int(ctx.sum()), bool(ctx.min() == ctx.max()), fixed, per_token, f_np, f_list)


def rest_units(tm: TimeModel, n: int) -> tuple[int, int]:
    """The rest of a drafting step of n sequences in time units: its fixed part (the step
    drafted, so it costs the drafting extra too, whatever the keep set) and its part per
    emitted token."""
    return int(round((tm.o0 + tm.drafting_extra_ms(n)) * UNITS_PER_MS)), int(round(tm.o1 * UNITS_PER_MS))


def f_table(tm: TimeModel, n: int, extra: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """f_array, and its first SMALL + 1 values as Python ints (the small path)."""
    f = f_array(tm, n, extra)
    return f, tuple(f[:SMALL + 1].tolist())


def decide(confidence: np.ndarray, kv_lens: np.ndarray, time_model: TimeModel, min_gain: float = 0.0,
           draft_ms: float = 0.0, max_keep: np.ndarray | None = None) -> np.ndarray:
    """confidence: (n, k) in [0, 1]; kv_lens: (n,) context length of each sequence;
    max_keep: (n,) optional per-sequence cap; min_gain: each kept draft must raise Theta by
    more than this fraction. Returns keep: (n,) int64 in 0..k."""
    n, k = np.shape(confidence)
    return decide_with(confidence, step_costs(time_model, kv_lens, n * k), min_gain, draft_ms, max_keep)


def decide_with(confidence, costs: StepCosts, min_gain: float = 0.0, draft_ms: float = 0.0,
                max_keep: np.ndarray | None = None, refine: bool = True) -> np.ndarray:
    """`decide` with the step's costs already computed; confidence is an (n, k) array or,
    for small batches, the same as a list of rows. refine=False skips the Dinkelbach
    rounds (the early stop's question, asked after every draft step, takes the ratio order)."""
    n = len(confidence)
    k = len(confidence[0]) if n else 0
    if n == 0 or k == 0:
        return np.zeros(n, dtype=np.int64)
    if n * k <= SMALL:
        conf = confidence if isinstance(confidence, list) else np.asarray(confidence).tolist()
        cap = None if max_keep is None else np.asarray(max_keep).tolist()
        return np.array(decide_small(conf, costs, min_gain, draft_ms, cap, refine), dtype=np.int64)
    return _decide_numpy(np.asarray(confidence, dtype=np.float64), costs, min_gain, draft_ms, max_keep, refine)


def _best_prefix(theta: np.ndarray | list[float], min_gain: float) -> tuple[int, float]:
    """The prefix length with the highest Theta (the shortest among equals), and its score.
    With min_gain g, prefix m scores Theta_m / (1 + g)^m: each kept draft must raise Theta
    by more than the fraction g (the divisors by repeated multiplication, identical in both
    paths)."""
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
    if isinstance(theta, list):
        best = max(range(len(theta)), key=theta.__getitem__)
        return best, theta[best]
    best = int(np.argmax(theta))
    return best, float(theta[best])


def draft_units(draft_ms: float) -> int:
    return int(round(draft_ms * UNITS_PER_MS))


REFINE_ROUNDS = 4  # Dinkelbach rounds after the ratio order (context costs only); 1-2 suffice in practice


def decide_scored(confidence, costs: StepCosts, min_gain: float, draft_ms: float,
                  max_keep: np.ndarray | list | None) -> tuple[np.ndarray | list[int], float, int]:
    """The keep set in the ratio order (refine=False), its score, Theta / (1 + min_gain)^kept, and
    its time (max(T, 1), units): the early stop compares the best it can do with and without
    another draft step."""
    n = len(confidence)
    if n * len(confidence[0]) <= SMALL:
        conf = confidence if isinstance(confidence, list) else np.asarray(confidence).tolist()
        cap = max_keep.tolist() if isinstance(max_keep, np.ndarray) else max_keep
        return decide_small(conf, costs, min_gain, draft_ms, cap, False, True)
    return _decide_numpy(np.asarray(confidence, dtype=np.float64), costs, min_gain, draft_ms, max_keep, False, True)


def _decide_numpy(confidence: np.ndarray, costs: StepCosts, min_gain: float, draft_ms: float,
                  max_keep: np.ndarray | None, refine: bool = True, scored: bool = False):
    a = path_probs(quantize(confidence))  # (n, k)
    return decide_paths(a if max_keep is None else capped(a, max_keep), costs, min_gain, draft_ms, refine, scored)


def capped(a: np.ndarray, max_keep) -> np.ndarray:
    """Path probabilities with those past each sequence's cap set to 0 (never kept)."""
    return np.where(np.arange(a.shape[1])[None, :] < np.asarray(max_keep)[:, None], a, 0)


def decide_paths(a: np.ndarray, costs: StepCosts, min_gain: float, draft_ms: float, refine: bool = True,
                 scored: bool = False):
    """The numpy rule from (n, k) quantised path probabilities, 0 where a draft may not be kept
    (a caller that keeps them across a step's decisions skips quantising them again).
    models/csrc/rank.cpp's decide_cols is the same, compiled."""
    ctx = costs.ctx if costs.ctx is not None else np.array(costs.ctx_list, dtype=np.int64)
    head = draft_units(draft_ms) + costs.fixed + costs.ctx_sum
    if costs.uniform:
        keep, _, score, e, t = rank_best(a, 0, 0, 0, 0, ctx, costs.f, head, costs.per_token, min_gain)
    else:
        live = int((a > 0).sum())
        s = max((int(costs.f[live]) - int(costs.f[0])) // max(live, 1), 1)
        keep, _, score, e, t = rank_best(a, 1, s, 0, 0, ctx, costs.f, head, costs.per_token, min_gain)
        for _ in range(REFINE_ROUNDS if refine else 0):
            d = t * CONF_ONE - e * costs.per_token
            if d <= 0:
                break
            got = rank_best(a, 2, 0, d, e, ctx, costs.f, head, costs.per_token, min_gain)
            if got[2] <= score:
                break
            keep, _, score, e, t = got
    return (keep, score, max(t, 1)) if scored else keep


def decide_cols(cols: list[np.ndarray], cap: np.ndarray, costs: StepCosts, min_gain: float, draft_ms: float,
                compiled=None) -> np.ndarray:
    """decide_paths from the drafted positions' path probabilities, one column each, before
    each sequence's cap: compiled in one call where the kernels load."""
    if compiled is None:
        return decide_paths(capped(np.stack(cols, 1), cap), costs, min_gain, draft_ms)
    ctx = costs.ctx if costs.ctx is not None else np.array(costs.ctx_list, dtype=np.int64)
    head = draft_units(draft_ms) + costs.fixed + costs.ctx_sum
    return compiled.decide_cols(cols, cap, ctx, costs.f, head, costs.per_token, min_gain, costs.uniform,
                                REFINE_ROUNDS)[0]


def rank_best(a: np.ndarray, mode: int, s: int, d: int, e0: int, ctx: np.ndarray, f: np.ndarray, head: int,
              per_token: int, min_gain: float) -> tuple[np.ndarray, int, float, int, int]:
    """Rank every candidate (i, j) with a[i, j] > 0 by its key, largest first (ties: smaller j,
    then smaller i: a stable sort over the j-major layout), and take the ranking's best
    prefix. Keys: a (mode 0), the ratio a << RATIO_BITS // (s + ctx_i) (mode 1), Dinkelbach's
    a d - e0 CONF_ONE ctx_i (mode 2). f: validation time by added tokens; head: the step's
    other time. Returns (keep per sequence, kept count, score, E and T of that prefix).
    models/csrc/rank.cpp's rank (exposed as rank_best, which the tests compare with this one)
    computes the same, bit for bit."""
    n, k = a.shape
    a_j = a.T.reshape(-1)  # index = j * n + i
    live_mask = a_j > 0
    live = int(live_mask.sum())
    if mode == 0:
        key = a_j
    else:
        ctx_j = np.tile(ctx, k)
        key = (a_j << RATIO_BITS) // (s + ctx_j) if mode == 1 else a_j * d - e0 * CONF_ONE * ctx_j
    order = np.argsort(-np.where(live_mask, key, np.iinfo(np.int64).min + 1), kind="stable")[:live]
    e = n * CONF_ONE + np.concatenate(([0], np.cumsum(a_j[order])))
    t = head + f[:live + 1] + np.concatenate(([0], np.cumsum(ctx[order % n]))) + ((per_token * e) >> CONF_BITS)
    count, score = _best_prefix(e / np.maximum(t, 1), min_gain)
    keep = np.bincount(order[:count] % n, minlength=n).astype(np.int64)
    return keep, count, score, int(e[count]), int(t[count])


def decide_small(conf: list[list[float]], costs: StepCosts, min_gain: float, draft_ms: float,
                  max_keep: list[int] | None, refine: bool = True, scored: bool = False):
    """The same rule and the same arithmetic as `_decide_numpy`, in plain Python (equal
    results; tests check it). Small batches decide once per draft step, so this is on the
    hot path at batch 1."""
    n, ctx = len(conf), costs.ctx_list
    if n == 1:
        count, score, t = best_one(conf[0], costs, min_gain, draft_ms, None if max_keep is None else max_keep[0], True)
        return ([count], score, t) if scored else [count]
    cands = []  # (a, j, i)
    for i, row in enumerate(conf):
        acc = CONF_ONE
        limit = len(row) if max_keep is None else min(len(row), max_keep[i])
        for j, c in enumerate(row[:limit]):
            acc = (acc * min(max(int(round(c * CONF_ONE)), 0), CONF_ONE)) >> CONF_BITS
            if acc <= 0:
                break
            cands.append((acc, j, i))
    f, o = costs.f_list, costs.per_token
    fixed = draft_units(draft_ms) + costs.fixed + costs.ctx_sum

    def best_of(ranked):
        e, t = n * CONF_ONE, fixed
        theta = [e / max(t + f[0] + ((o * e) >> CONF_BITS), 1)]
        totals = [(e, t + f[0] + ((o * e) >> CONF_BITS))]
        for m, (acc, _, i) in enumerate(ranked, 1):
            e, t = e + acc, t + ctx[i]
            total = t + f[m] + ((o * e) >> CONF_BITS)
            theta.append(e / max(total, 1))
            totals.append((e, total))
        count, score = _best_prefix(theta, min_gain)
        return ranked, count, score, *totals[count]

    if costs.uniform:
        ranked, count, score, e, t = best_of(sorted(cands, key=lambda c: (-c[0], c[1], c[2])))
    else:
        s = max((f[len(cands)] - f[0]) // max(len(cands), 1), 1)
        ranked, count, score, e, t = best_of(sorted(cands, key=lambda c: (-((c[0] << RATIO_BITS) // (s + ctx[c[2]])),
                                                                            c[1], c[2])))
        for _ in range(REFINE_ROUNDS if refine else 0):
            d = t * CONF_ONE - e * o
            if d <= 0:
                break
            got = best_of(sorted(cands, key=lambda c: (-(c[0] * d - e * CONF_ONE * ctx[c[2]]), c[1], c[2])))
            if got[2] <= score:
                break
            ranked, count, score, e, t = got
    keep = [0] * n
    for _, _, i in ranked[:count]:
        keep[i] += 1
    return (keep, score, max(t, 1)) if scored else keep


def best_one(conf: list[float], costs: StepCosts, min_gain: float, draft_ms: float,
             max_keep: int | None, totals: bool = False) -> tuple:
    """decide_small for a single sequence, whose path probabilities already fall with j (so
    the ranking is the drafts' order): the same arithmetic in one pass, without candidate
    lists; the keep count and its score (Theta over (1 + min_gain)^count), and with totals the
    kept prefix's time as well (max(T, 1), in units). At batch 1 the decision runs once per
    draft step, and this path costs a third."""
    f, o, ctx = costs.f_list, costs.per_token, costs.ctx_list[0]
    t = draft_units(draft_ms) + costs.fixed + costs.ctx_sum
    e = acc = CONF_ONE
    total = best_total = max(t + f[0] + ((o * e) >> CONF_BITS), 1)
    best, count = e / total, 0
    scale, divisor = 1.0 + min_gain, 1.0  # as _best_prefix: prefix m scores Theta_m / (1 + g)^m
    for m, c in enumerate(conf if max_keep is None else conf[:max_keep], 1):
        acc = (acc * min(max(int(round(c * CONF_ONE)), 0), CONF_ONE)) >> CONF_BITS
        if acc <= 0:
            break
        e, t = e + acc, t + ctx
        total = max(t + f[m] + ((o * e) >> CONF_BITS), 1)
        theta = e / total
        if min_gain:
            divisor *= scale
            theta /= divisor
        if theta > best:  # ties keep the shorter prefix
            best, count, best_total = theta, m, total
    return (count, best, best_total) if totals else (count, best)


def rate_units(rate_ms: float) -> float:
    """A throughput in tokens per ms as the decision's (CONF_ONE tokens per time unit)."""
    return rate_ms * CONF_ONE / UNITS_PER_MS


def beats_at_rate(go: float, go_t: int, stop: float, stop_t: int, lam: float) -> bool:
    """Is the keep set scoring go (Theta over (1 + min_gain)^count) in time go_t (units, at least 1)
    worth more than the one scoring stop in stop_t, at lam tokens per unit (rate_units)? Each is
    worth its expected tokens less lam times its time, E - lam T = T (Theta - lam): a subtraction
    and a product, which no compiler fuses (models/csrc keeps the same order)."""
    return (go - lam) * go_t > (stop - lam) * stop_t


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
