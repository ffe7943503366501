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

A switch buys drafting only until the batch grows past the point where drafting pays, which
under load comes long before the row has nothing left to emit. So a row's catch-up is spread
over the smaller of what it may still emit and what drafting has lasted of late, a row's
tokens in a stretch of steps whose budget would draft (`DraftStretches.horizon`).
"""
from __future__ import annotations

import numpy as np

SWEEP_CATCHUP = 2  # tokens per sequence the sweep's draft points catch up on (workers/timing.py): what h(n) holds
CATCHUP_WINDOW = 256  # the latest catch-up steps the cost per token is fitted on ...
CATCHUP_MIN_SAMPLES = 4  # ... once there are this many
STRETCH_DECAY = 0.9  # a stretch's weight against the next one's (DraftStretches): the horizon follows the load


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


def switch_cost(behind, left, k: int, horizon: float | None = None) -> float:
    """Sum over rows of their tokens behind past k + 1 per token they may still emit, or per token
    drafting is expected to last where that is fewer (horizon, DraftStretches.horizon): what a step
    charges per token it emits a row, in catch-up tokens. behind, left: per row (left None: not
    known; not charged but where a horizon is known)."""
    cost = 0.0
    for b, n in zip(behind, left):
        if b > k + 1:
            if horizon is not None:
                n = horizon if n is None or n > horizon else n
            if n is not None:
                cost += (b - k - 1) / max(n, 1)
    return cost


class DraftStretches:
    """How long drafting stays worth it once a row switches into it: a stretch is a run of adaptive
    steps whose budget would draft, its rows' catch-up left out (the steps' `wants`), and its
    length what a row emitted over it (each step's tokens over its rows). It ends at the first
    step whose budget would not draft. At 100-120% of saturation a batch dips to one or two
    sequences for a few steps, and rows that had stood down switched there, catching up on
    tens to hundreds of tokens for a few steps' drafting; the horizon read 19-23 tokens a
    row after warm-ups that ended at 120%. Every step counts, whether a row switched or not,
    so a horizon that prices switches out still learns when stretches grow long again
    (counted over the runs of rows that switched, a horizon that had priced switches out
    would never move). Taking lengths as exponential, the mean is the tokens of all
    stretches, the open one's included, over the stretches that ended, each weighing
    STRETCH_DECAY times the next. The same steps on every rank give the same horizon."""

    __slots__ = ("tokens", "ended", "open")

    def __init__(self):
        self.tokens = self.ended = 0.0  # the ended stretches' weighted tokens a row, and their weight
        self.open = 0.0  # tokens a row in the stretch going on (0: none)

    def horizon(self) -> float | None:
        """Tokens a row drafting is expected to last; None before any stretch ended (no bound)."""
        return (self.tokens + self.open) / self.ended if self.ended else None

    def extend(self, per_row: float) -> None:
        """A step whose budget would draft, where a row emitted `per_row` tokens on average."""
        self.open += per_row

    def end(self) -> None:
        """A step whose budget would not draft: the stretch going on, if any, ends."""
        if self.open:
            self.tokens = self.tokens * STRETCH_DECAY + self.open
            self.ended = self.ended * STRETCH_DECAY + 1.0
            self.open = 0.0
