"""When an adaptive step probes: one schedule per batch-size bucket (yields.batch_bucket).

A probe drafts one position past what the budget found worth drafting, so that positions
the budget calls hopeless still get verified now and then (SpecPolicy.begin_step). Where
probes keep finding that drafting does not pay, the bucket's interval doubles up to
PROBE_MAX_EVERY; a probe that finds it pays starts the interval over.

Why per bucket: whether drafting pays depends on the batch. With one schedule, a server
whose load moves between a few sequences (drafting pays) and 8-16 (it does not) had its
interval started over at every stretch of small batches, and its steps at 8 probed every
32-128 steps: in a served Poisson run at 75% of saturation, probes at batch 5-8 were 66 of
its 1,200 steps there and about 2.5% of its time.

A bucket counts its own steps: a probe is amortised over the steps of its batch size, which
it costs most at (a probe past a budget of 0 drafts for one row, which first catches up on
every token since it last drafted: 30-360 tokens, 2.5-11.6 ms over a plain step, in a
served run at 120%).
Counted in all adaptive steps, every bucket a server's load passes through probed once per
interval, and at the longest interval a load spread over five buckets still probed five
times per 1,024 steps.
The longest interval was 1,024 steps. A bucket standing down still spent about 0.4% of a
served run's time at 50% of saturation on its probes (8 probes at two or more sequences,
each catching one row up on hundreds of tokens: 4-6.7 ms of drafting against a 1-2 ms step).
Two adaptive-7 engines stepped in turn on the same arrivals, one backing off to 4,096, read
1.0003 [0.9994, 1.0007] / 1.0019 [0.9992, 1.0050] / 1.0033 [1.0002, 1.0055] of the other at
25 / 50 / 75% of saturation (8 rounds a rate); a bucket where drafting starts to pay waits
at most 4,096 of its steps to find out.

A probe that finds nothing backs off by its price as well: the next one waits the doubled
interval times what this one cost beyond a plain step, in plain steps at its batch
(policy.probe_price, priced by the time model: the same on every rank), so a bucket's probes
spend about 1/32, 1/64, .. of its time however dear each is. A stand-down probe's row first
catches up on all it emitted standing down; at the tail of a batch-capped round (4-15
sequences) 200-370 tokens, 3-6 plain steps, and doubling alone had a young engine probe there
every round or two. Beside an engine backing off by doubling alone (nospec, both, 8 rounds
after 2, batch capped at 32): 2-4 probes in the measured rounds against 6-7, 0.9967 / 0.9941
of plain decoding against 0.9919 / 0.9900. Deferring a probe until its row is less far behind
would starve batch 1, whose one row is always far behind after standing down; the price only
stretches the interval the probe sets, so the next one still comes. From two sequences on, a
probe also waits `base` times what it would cost if run now (`due`'s price: its row's catch-up,
policy.stand_down_price), so a bucket's first probe, which no earlier price had stretched, keeps
to the same share; and its row is the one cheapest to catch up (SpecStep's rows: in a steady
flow of requests a young row, which costs a draft step, where the row in turn had caught up on
hundreds of tokens). Batch 1 is not priced:
there drafting pays most, and a served engine that had stood batch 1 down probed it every 608
of its steps priced (its row 280 tokens behind, 9.5 plain steps) where doubling alone gave 64.

Past the cold start, a step where drafting could not pay were every draft verified and
accepted (StepTerms.could_pay) never probes (`due`'s `allowed`): no rate a probe could teach
would change the budget there. At 32 sequences such probes had still come every round or two
of a batch-capped run, each catching one row up on 88-370 tokens (4.9-7.3 ms against a 2.2 ms
step). During the cold start they keep their schedule: their first drafts help end it.

A plain probe is the other way round: every PLAIN_EVERY-th adaptive step that would draft
(and is no probe) runs as a plain step. The time model prices what a step that drafts costs
outside drafting and validation beyond a plain one (time_model.py, o2 + o3 n), and can tell
the two apart only from steps of both kinds: a batch that always drafted (batch 1 and 2
offline) had none of the plain ones, o0 took the extra in, a plain step looked as dear as
a drafting one, and the budget drafted at batch 2 where plain decoding was faster.
One step in 128 gives up what drafting gains there (about 0.1% at batch 1) and keeps 32
plain steps in the registry's window.

Until the registry has priced a plain step from settled plain steps of its own (the model's
`plain_measured`: PLAIN_MIN_SAMPLES of them in its window at some refit, registry.py), plain
probes come YOUNG_SHARE times as often. A young engine at batch 1 that drafted nearly every step
had 7 settled plain steps in its window after two rounds of 48 requests: it could measure neither
how much dearer a drafting step validates (v_drafted, kept at 0) nor the machine's speed for plain
steps (taken from its drafting steps instead), so it priced a drafting step's validation 14-20%
too cheap and a plain one 9% too dear, and read drafting 3 as 1.21-1.28x a plain step's
throughput where drafting broke even (on a machine where drafting 3 costs about 0.47 ms a step against
a 0.33 ms target forward). With plain probes 8 times as often its model measured v_drafted at 0.098
ms and read 1.06-1.10x. In the offline benchmark, where plain decoding runs in the same engine and
gives the registry settled plain steps in plenty, adaptive stood batch 1 down there (0.0085
verified drafts a step).

A plain probe is a stretch of PLAIN_RUN plain steps: the last PLAIN_RUN of every
PLAIN_EVERY * PLAIN_RUN steps that would draft (the same share). A plain step right after
drafting validates dearer than plain decoding's (samples.SETTLE_STEPS), so single plain
probes had priced a plain step at what it costs among drafting steps; the stretch's steps
past the first SETTLE_STEPS say what it costs once the step stops drafting.
"""
from __future__ import annotations

import math

from controller.yields import BUCKETS, batch_bucket

PROBE_EVERY = 32  # a bucket's steps probe every 32 adaptive steps ...
PROBE_MAX_EVERY = 4096  # ... backing off (doubling) while its probes keep finding that drafting does not pay
PLAIN_EVERY = 128  # one in 128 adaptive steps that would draft runs plain (a plain probe) ...
PLAIN_RUN = 8  # ... in stretches of this many (more than samples.SETTLE_STEPS)
YOUNG_SHARE = 8  # ... and 8 times as often until the time model has priced a plain step (TimeModel.plain_measured)


class ProbeSchedule:
    """Each bucket counts its adaptive steps, the same on every rank (every rank runs every
    plan), so every rank probes at the same steps."""

    def __init__(self):
        self.every = [PROBE_EVERY] * BUCKETS  # steps between a bucket's probes: `base` times the last one's price
        self.base = [PROBE_EVERY] * BUCKETS  # ... where probes cost a plain step: 32, doubling as they find nothing
        self.steps = [0] * BUCKETS  # adaptive steps per bucket
        self.last = [-PROBE_EVERY] * BUCKETS  # each bucket's first adaptive step probes
        self.probes = 0
        self.drafting = 0  # adaptive steps that would draft, no probe among them
        self.plain = 0  # plain probes
        self.plain_every = PLAIN_EVERY

    def due(self, n: int, cold: bool = False, allowed=None, price=None) -> bool:
        """Does the next adaptive step, of n sequences, probe? (Counted as one if so.)
        cold: it does (a cold start's probe), and the schedule starts from it; allowed: None, or
        a callable asked where the schedule would probe, whose False (no acceptance rate could
        make drafting pay: StepTerms.could_pay) says it does not, however long since the last
        (its step is counted all the same); price: None, or a callable asked there too, what the
        probe would cost now beyond a plain step, in plain steps (policy.stand_down_price): it
        also waits `base` times that since the last (`next_at`)."""
        b = batch_bucket(n)
        step = self.steps[b] = self.steps[b] + 1
        if not cold:
            since = step - self.last[b]
            if since < self.every[b] or (allowed is not None and not allowed()):
                return False
            if price is not None and since < self.base[b] * price():
                return False
        self.last[b], self.probes = step, self.probes + 1
        return True

    def next_at(self, bucket: int, price: float = 1.0) -> float:
        """The bucket's step count at which `due` next says True, a probe costing `price` then."""
        return self.last[bucket] + max(self.every[bucket], self.base[bucket] * price)

    def plain_due(self, measured: bool = True) -> bool:
        """An adaptive step that would draft (no probe): does it run plain? (Counted if so.) The last
        PLAIN_RUN of every PLAIN_EVERY * PLAIN_RUN such steps do; until the time model in use has priced
        a plain step from settled plain steps (`measured`: TimeModel.plain_measured), of every
        PLAIN_EVERY // YOUNG_SHARE * PLAIN_RUN."""
        self.drafting += 1
        every = self.plain_every if measured else max(1, self.plain_every // YOUNG_SHARE)
        if (self.drafting + PLAIN_RUN - 1) % (every * PLAIN_RUN) >= PLAIN_RUN:
            return False
        self.plain += 1
        return True

    def found(self, n: int, pays: bool, price: float = 1.0) -> None:
        """A probe at n sequences found that drafting pays (its budget drafted) or not; price: what
        it cost beyond a plain step, in plain steps at its batch (policy.probe_price). Where it
        found nothing, the next probe waits `base` steps (doubled) times that price: the bucket's
        probes spend about 1/base of its time, whatever each costs."""
        b = batch_bucket(n)
        if pays:
            self.every[b] = self.base[b] = PROBE_EVERY
            return
        self.base[b] = base = min(PROBE_MAX_EVERY, self.base[b] * 2)
        self.every[b] = min(PROBE_MAX_EVERY, max(base, math.ceil(base * price)))

    def every_at(self, n: int) -> int:
        """Steps between probes at n sequences now."""
        return self.every[batch_bucket(n)]

    def hold(self) -> None:
        """No probe, nor plain probe, for a very long time (tests that decide without them)."""
        self.last = [10**9] * BUCKETS
        self.plain_every = 10**9
