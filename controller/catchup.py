"""What a draft's catch-up past a steady step's costs, and its share in a step's price.

Before its first draft position a step's draft forward catches up on every token its
sequences emitted since they last drafted (workers/proposer.py). In steady drafting that is
the last step's accepted tokens and the bonus one, which h(n) prices (time_model.py). A
sequence that stood down is behind by far more: in a served run at 100-120% of saturation
batch 2 switched into drafting 13 times in 115 drafting steps with 23-493 tokens to catch up,
9.6 ms a step, and ran 16% slower than plain decoding. Here a catch-up token costs about
0.025 ms (one layer's forward over it), so a switch costs as much as several plain steps.

The catch-up is a one-off that buys every later step's drafting, so a step does not pay all
of it: each row's excess (tokens behind past k + 1) is spread over the tokens it may still
emit, and a step that emits e tokens a row is charged e times the sum of the rows' excess per
token left (`switch_cost`). A row with few tokens left and a long way behind stays plain.
The runner counts a row's distance from where its draft last ran or its prompt ends,
whichever is later (workers/runner.py `_behind`): a prompt's catch-up is not priced (with
it, batch 1 stood down for new requests where drafting paid net of it; DESIGN.md section 4).
The cost per token is fitted from every long catch-up, prompts' included.
"""
from __future__ import annotations

import numpy as np

SWEEP_CATCHUP = 2  # tokens per sequence the sweep's draft points catch up on (workers/timing.py): what h(n) holds
CATCHUP_WINDOW = 256  # the latest catch-up steps the cost per token is fitted on ...
CATCHUP_MIN_SAMPLES = 4  # ... once there are this many


def catchup_ms(model, n: np.ndarray, steps: np.ndarray, tokens: np.ndarray, ms: np.ndarray) -> float | None:
    """ms per catch-up token, from steps that drafted after a long catch-up (n: the sequences
    each drafted for; steps: its draft steps; tokens: its catch-up tokens; ms: its draft time):
    over the latest CATCHUP_WINDOW of them, the least-squares slope through 0 of their draft
    time past what `model` predicts for steady draft steps against their tokens past
    SWEEP_CATCHUP per sequence; None with fewer than CATCHUP_MIN_SAMPLES of them."""
    if len(n) < CATCHUP_MIN_SAMPLES:
        return None
    n, steps, tokens, ms = (a[-CATCHUP_WINDOW:] for a in (n, steps, tokens, ms))
    extra = ms - model.draft_ms_at(n, steps)
    past = np.maximum(tokens - SWEEP_CATCHUP * n, 0.0)
    scale = float(past @ past)
    return max(float(past @ extra) / scale, 0.0) if scale > 0 else None


def switch_cost(behind, left, k: int) -> float:
    """Sum over rows of their tokens behind past k + 1 per token they may still emit: what a
    step charges per token it emits a row, in catch-up tokens. behind, left: per row (left
    None: not known, not charged)."""
    cost = 0.0
    for b, n in zip(behind, left):
        if n is not None and b > k + 1:
            cost += (b - k - 1) / max(n, 1)
    return cost
