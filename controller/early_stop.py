"""The early stop: after j draft steps, is draft j+1 worth drafting?

It is if the best keep set with it beats the best without it and without its draft step,
each sequence's next draft taken at its position's observed conditional acceptance: one
step ahead, since the draft itself is not known yet. (An estimate of 1 for it, the upper
bound, never stopped a step at batch 1: adaptive verified 2.90 drafts a step where static-3
verifies 2.91.) The same arithmetic on every rank: the decision's integer path
probabilities and times, and Theta as the quotient of two integers.
"""
from __future__ import annotations

import numpy as np

from controller.decision import CONF_BITS, StepCosts, capped, decide_paths, decide_scored, draft_units, quantize


def worth_drafting(cols: list, costs: StepCosts, min_gain: float, stop_ms: float, go_ms: float, rate: float,
                   cap) -> bool:
    """cols: the acceptance estimates of the j positions drafted, one column each (Python
    lists for small batches, arrays otherwise); stop_ms, go_ms: the draft time of j and of
    j + 1 steps; rate: the next position's conditional acceptance; cap: drafts each sequence
    may verify (a list or an array, as cols)."""
    j = len(cols)  # (batch 1 with the default estimator decides in controller/one_row.py instead)
    if isinstance(cols[0], list):  # small batch: plain Python end to end
        conf = [list(row) for row in zip(*cols)]
        ahead = [row + [rate] for row in conf]
    else:
        conf = np.stack(cols, 1)
        ahead = np.concatenate([conf, np.full((len(conf), 1), rate)], 1)
    keep, go = decide_scored(ahead, costs, min_gain, go_ms, cap)
    return int(max(keep)) > j and go > decide_scored(conf, costs, min_gain, stop_ms, cap)[1]


def worth_drafting_paths(paths: list[np.ndarray], costs: StepCosts, min_gain: float, stop_ms: float, go_ms: float,
                         rate: float, cap: np.ndarray, compiled=None) -> bool:
    """worth_drafting for a large batch whose drafted positions' path probabilities are already
    quantised (path_probs' columns, before the cap): the same integers, so the same answer,
    without quantising every column again at each draft step. compiled: the CPU kernels'
    module, whose worth_drafting gives the same answer in one call."""
    j = len(paths)
    if compiled is not None:  # the same two rankings in one call (models/csrc/rank.cpp)
        ctx = costs.ctx if costs.ctx is not None else np.array(costs.ctx_list, dtype=np.int64)
        head = costs.fixed + costs.ctx_sum
        return compiled.worth_drafting(paths, cap, int(quantize(rate)), ctx, costs.f, draft_units(stop_ms) + head,
                                       draft_units(go_ms) + head, costs.per_token, min_gain, costs.uniform)
    ahead = np.stack(paths + [(paths[-1] * int(quantize(rate))) >> CONF_BITS], 1)
    ahead = capped(ahead, cap)
    keep, go = decide_paths(ahead, costs, min_gain, go_ms, refine=False, scored=True)
    return int(keep.max()) > j and go > decide_paths(ahead[:, :j], costs, min_gain, stop_ms, False, True)[1]
