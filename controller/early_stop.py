"""The early stop: after j draft steps, is draft j+1 worth drafting?

It is if the best keep set with it (which must keep a draft past j) is worth more than the
best without it and without its draft step, each sequence's next draft taken at its
position's observed conditional acceptance: one step ahead, since the draft itself is not
known yet. (An estimate of 1 for it, the upper bound, never stopped a step at batch 1:
adaptive verified 2.90 drafts a step where static-3 verifies 2.91.)

Worth more at the rate the step's budget expects (lam, tokens per time unit; the default,
speculative.adaptive.early_stop_at_rate): the set's expected tokens less lam times its time.
The long run's throughput is total tokens over total time, so a draft step pays where its
tokens come cheaper than the rate the engine runs at, not than the step's own Theta: a step
of confident drafts whose Theta is already high stopped short of drafts that would have come
at better than the long run's rate, and a step of doubtful ones drafted on where its own low
Theta made the next draft look good (DESIGN.md section 8). lam None: the step's own Theta.
The same arithmetic on every rank: the decision's integer path probabilities and times,
Theta as the quotient of two integers, and lam from the budget's floats.
"""
from __future__ import annotations

import numpy as np

from controller.decision import (CONF_BITS, StepCosts, beats_at_rate, capped, decide_paths, decide_scored, draft_units,
                                 quantize)


def worth_drafting(cols: list, costs: StepCosts, min_gain: float, stop_ms: float, go_ms: float, rate: float,
                   cap, lam: float | None = None) -> bool:
    """cols: the acceptance estimates of the j positions drafted, one column each (Python
    lists for small batches, arrays otherwise); stop_ms, go_ms: the draft time of j and of
    j + 1 steps; rate: the next position's conditional acceptance; cap: drafts each sequence
    may verify (a list or an array, as cols); lam: the rate to weigh time at (decision.rate_units)."""
    j = len(cols)  # (batch 1 with the default estimator decides in controller/one_row.py instead)
    if isinstance(cols[0], list):  # small batch: plain Python end to end
        conf = [list(row) for row in zip(*cols)]
        ahead = [row + [rate] for row in conf]
    else:
        conf = np.stack(cols, 1)
        ahead = np.concatenate([conf, np.full((len(conf), 1), rate)], 1)
    keep, go, go_t = decide_scored(ahead, costs, min_gain, go_ms, cap)
    return int(max(keep)) > j and _worth(go, go_t, *decide_scored(conf, costs, min_gain, stop_ms, cap)[1:], lam)


def _worth(go: float, go_t: int, stop: float, stop_t: int, lam: float | None) -> bool:
    return go > stop if lam is None else beats_at_rate(go, go_t, stop, stop_t, lam)


def worth_drafting_paths(paths: list[np.ndarray], costs: StepCosts, min_gain: float, stop_ms: float, go_ms: float,
                         rate: float, cap: np.ndarray, compiled=None, lam: float | None = None) -> bool:
    """worth_drafting for a large batch whose drafted positions' path probabilities are already
    quantised (path_probs' columns, before the cap): the same integers, so the same answer,
    without quantising every column again at each draft step. compiled: the CPU kernels'
    module, whose worth_drafting gives the same answer in one call."""
    j = len(paths)
    if compiled is not None:  # the same two rankings in one call (models/csrc/rank.cpp)
        ctx = costs.ctx if costs.ctx is not None else np.array(costs.ctx_list, dtype=np.int64)
        head = costs.fixed + costs.ctx_sum
        return compiled.worth_drafting(paths, cap, int(quantize(rate)), ctx, costs.f, draft_units(stop_ms) + head,
                                       draft_units(go_ms) + head, costs.per_token, min_gain, costs.uniform,
                                       -1.0 if lam is None else lam)
    ahead = np.stack(paths + [(paths[-1] * int(quantize(rate))) >> CONF_BITS], 1)
    ahead = capped(ahead, cap)
    keep, go, go_t = decide_paths(ahead, costs, min_gain, go_ms, refine=False, scored=True)
    return int(keep.max()) > j and _worth(go, go_t, *decide_paths(ahead[:, :j], costs, min_gain, stop_ms, False,
                                                                   True)[1:], lam)
