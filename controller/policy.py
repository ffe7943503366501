"""Speculation control on one rank: the time models plans name, each step's decisions
(`begin_step` -> SpecStep: draft budget, early stop, the keep decision; controller/step.py),
and calibration from the outcomes (`end_step`). Everything here is a deterministic
function of what every rank holds (the gathered draft distributions, validation outcomes,
the plan's mode, step and time-model version), so all ranks reach the same answers
without talking to each other.

Modes (chosen per step by the plan):
  static    draft k, verify every draft
  adaptive  draft budget, early stop and the keep decision (DESIGN.md section 3)
  oracle    verify exactly the drafts that match a known reference continuation (benchmark
            floor on validate cost; needs the reference tokens in the plan)
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from controller.catchup import SWEEP_CATCHUP
from controller.config import SpeculativeConfig
from controller.decision import draft_units, step_costs
from controller.estimators import PRIOR_WEIGHT, Calibrator, LogisticCalibrator
from controller.history import bounds, level_in, shifted, shifted_shares
from controller.one_row import new_one_row
from controller.one_row_step import OneRowStep
from controller.pending import every, joined, stacked
from controller.probes import ProbeSchedule
from controller.stand_down import PlainStep, StandDown
from controller.step import SpecStep
from controller.terms import StepTerms
from controller.time_model import UNITS_PER_MS, TimeModel
from controller.yields import YieldsByBatch, batch_bucket, prior_rates

MODES = ("static", "adaptive", "oracle")
OBSERVE_EVERY = 32  # validation outcomes reach the calibrators in batches of at least this many steps ...
OBSERVE_ROWS = 512  # ... and of at least this many sequence-steps (small batches wait longer) ...
OBSERVE_MAX = 512  # ... but never more steps than this
CALIBRATE_ROWS = 1024  # a batch of more sequence-steps fits on an evenly spaced sample of about this many
COLD_TRIALS = 64  # until the calibrator has verified this many first drafts, every adaptive step probes and
# its outcomes reach the calibrators soon (a cold start: see begin_step) ...
ALONE_COLD_TRIALS = 512  # ... and every step of one sequence until this many: several requests' worth, where one
# request's drafts are no sample of the workload's (64 had ended it on one: DESIGN.md section 8) ...
COLD_BATCH = 16  # ... in batches of sequence-steps at least 1/COLD_BATCH of the first drafts held (the first at once)


def probe_price(step: SpecStep, catchup_tokens: int) -> float:
    """What a probe that drafted cost beyond a plain step of its batch, in such steps, as its time
    model prices them (the same on every rank): its draft forwards, their catch-up past a steady
    step's (catchup_tokens: all its rows'), and a drafting step's rest. A stand-down probe drafts
    for one row, which first catches up on all it emitted standing down: in the tail of a
    batch-capped round (4-15 sequences) 150-280 tokens, about 18 ms against a 4.3 ms step."""
    n = len(step.kv)
    total = sum(step.kv_list) if step.kv_list is not None else int(step.kv.sum())
    return _price(step.model, n, total, n if step.rows is None else len(step.rows), step.budget, catchup_tokens)


def stand_down_price(tm: TimeModel, n: int, total: int, lag: int) -> float:
    """probe_price of a stand-down probe of n sequences (summed context total) were it run now: one
    row drafting one position, first catching up on `lag` tokens (RowsBehind.least_lag: the row it
    would draft for). What the probe schedule waits on before a bucket's probe (ProbeSchedule.due's
    `price`), its first one included."""
    return _price(tm, n, total, 1, 1, lag)


def _price(tm: TimeModel, n: int, total: int, rows: int, steps: int, catchup_tokens: int) -> float:
    plain = tm.validate_ms_from(n, total) + tm.other_ms(n)
    extra = (tm.draft_ms(rows, steps) + tm.drafting_extra_ms(rows)
             + tm.catchup_ms * max(catchup_tokens - SWEEP_CATCHUP * rows, 0))
    return extra / plain if plain > 0.0 else 1.0


class SpecPolicy:
    def __init__(self, cfg: SpeculativeConfig, compiled=None):
        """compiled: the CPU kernels' module (models/kernels.py), whose compiled OneRow batch 1
        decides with (the same answers as controller/one_row.py's); None: the Python one."""
        self.cfg = cfg
        self.compiled = compiled
        # read at every step: held here, one attribute away (each lookup costs batch 1 time, caches cold)
        self.early_stop_on = cfg.adaptive.early_stop
        self.logistic_estimates = cfg.adaptive.estimator == "top_prob_logistic"
        # adaptive steps of one sequence on the logistic estimate as OneRowSteps (False: SpecSteps, which
        # decide alike in more Python; tests compare the two)
        self.one_row_steps = self.logistic_estimates
        self.fused_drafts = True  # ... whose draft loop asks the early stop in the draft kernel's call (draft_next)
        self._one_row: dict[int, tuple] = {}  # batch 1, per level (controller/history.py): (time model, extra, OneRow)
        self.seq_history = cfg.adaptive.seq_history  # batch 1: the sequence's own record shifts its rates
        self._compiled_weights: tuple | None = None  # (logistic weights, as the kernels take them)
        self.calibrator = Calibrator(max(cfg.num_speculative_tokens, 1))  # also the yields' prior
        self.logistic = LogisticCalibrator(max(cfg.num_speculative_tokens, 1))
        self.models: dict[int, TimeModel] = {0: TimeModel()}
        self.in_use = 0  # the newest version a plan has named
        self._lock = threading.Lock()
        self.adaptive_steps = 0  # counted identically on every rank (every rank runs every plan)
        self.probes = ProbeSchedule()  # when adaptive steps probe, per batch size (controller/probes.py)
        self.cold = True  # fewer than COLD_TRIALS first drafts verified so far (set by every calibration batch)
        self.cold_alone = True  # fewer than ALONE_COLD_TRIALS (batch 1's cold start)
        self._first_drafts = 0  # first drafts the calibrator had verified at the last calibration batch
        self._pending: list[tuple] = []  # (top_prob, margin, verified, accepted, rule_keep) not yet in the calibrators
        self._observed = self._pending_rows = 0  # steps and sequence-steps since the last batch
        self.calibrations = 0  # calibration batches run (the runner leaves steps with one out of the rest's fit)
        self._counts: list[tuple] = []  # ((max_keep, drafts made), verified, accepted) for the draft yields, as many
        self._batches = 0  # calibration batches so far (the large batches' sample offset rotates with them)
        self.yields = YieldsByBatch(max(cfg.num_speculative_tokens, 1))
        # the time terms steps read (controller/terms.py)
        self.terms = StepTerms(cfg.adaptive.min_gain, self.shares, cfg.adaptive.batch_draft_margin)
        self._caps_cache: dict[tuple, np.ndarray] = {}  # full_caps'
        # batch 1's draft loops write their confidence inputs here (draft_row), a step's rows after the last
        # one's, and the calibration batch reads them where they lie; its OneRows watch it once (one_row)
        self.draft_slab = np.zeros((3, (OBSERVE_MAX + 1) * max(cfg.num_speculative_tokens, 1), 1))
        self._slab_used = 0  # rows lent since the last calibration batch
        self._set_rates()

    # ------------------------------------------------------------------ time models
    def install(self, model: TimeModel) -> int:
        # Installs may arrive on another thread than steps (Ray Compiled Graph): lock.
        with self._lock:
            self.models[model.version] = model
            self._evict()
        return model.version

    def model(self, version: int) -> TimeModel:
        """The model a plan names. Plans name non-decreasing versions, so older ones go."""
        if version == self.in_use:  # the usual step: no lock (only older versions are ever evicted)
            model = self.models.get(version)
            if model is not None:
                return model
        with self._lock:
            if version not in self.models:
                raise KeyError(f"time model version {version} is not on this rank (never installed, or older "
                               f"than v{self.in_use}, which plans already use)")
            if version > self.in_use:
                self.in_use = version
                self._evict()
            return self.models[version]

    def _evict(self) -> None:
        """Drop versions older than the one plans use now; never that one or newer ones
        (the Engine may still be on it however many refits arrive before it moves)."""
        for old in [v for v in self.models if v < self.in_use]:
            del self.models[old]

    def latest(self) -> TimeModel:
        with self._lock:
            return self.models[max(self.models)]

    # ------------------------------------------------------------------ one step
    def begin_step(self, mode: str, kv, max_keep, version: int, k: int,
                   oracle: np.ndarray | None = None, catchup=None, record: tuple | None = None) -> SpecStep:
        """The step's decisions (controller/step.py): kv, max_keep: (n,) context length and
        drafts each sequence may verify, lists of ints (or arrays; a list spares a small batch
        numpy's calls, each several microseconds between two forward passes, when the caches
        are cold); k: drafts the step may make (0: none); oracle: (n, k)
        reference tokens after the last emitted one (-1 past the end), oracle mode only;
        catchup: None, or a callable k -> the rows' catch-up past a steady step's per token
        they may still emit (catchup.switch_cost), asked only where it may change the budget, whose
        `cheapest(start)` may also name the row a stand-down probe drafts for (the runner's RowsBehind);
        record: a batch-1 step's sequence's draft record (hits, trials; controller/history.py),
        whose level shifts the rates its budget and early stop expect (None, or seq_history off:
        the pooled rates).

        Probe steps: without them, positions the budget calls hopeless would never be
        drafted, and the estimates could never learn that they are not. A probe drafts one
        position past the budget; the exploration in `keep` verifies it for a rotating share of
        the sequences. (Drafting all k at a probe was tried: DESIGN.md section 8, probes.) Past
        the cold start, no step probes where drafting could not pay were every draft verified
        and accepted (`could_pay`): no rate a probe could teach would change the budget there,
        and a probe where it stands down catches its row up on everything since it last drafted
        (in a batch-capped run at 32 sequences, one probe cost 5-7 ms against a 2.2 ms step).
        During the cold start those steps keep their probe schedule: their first drafts help end
        it (without them, an engine at 32 sequences had probed at every step of its rounds' last
        few sequences, where drafting could pay, for twice as many rounds).

        A cold start (the calibrator has verified fewer than COLD_TRIALS first drafts, or for a
        step of one sequence ALONE_COLD_TRIALS) probes at every adaptive step where drafting
        could pay were every draft accepted (`could_pay`),
        and the probes' outcomes reach the calibrators soon (the first ones at the end of their
        step, then in batches of about 1/COLD_BATCH of the first drafts held). Started on the
        prior (every draft accepted half the time), batch 1 stood down, its probes backed off
        before their outcomes had reached the rates (calibration batches came every 256 steps
        there), and adaptive-7 verified 1-3 drafts in its first 250 steps where the drafts
        were accepted 80% of the time. Ended after 64 first drafts, one request's at batch 1, a
        request whose drafts were accepted less than the workload's stood batch 1 down for good;
        at larger batches a probe's row turns, so 64 are many requests' (512 there had kept an
        engine at batch 32 probing at every step through its warm-up and after: 0.961 of plain
        decoding in pairs).

        An adaptive step first asks `held_plain` (standing down as the step before did); the rest
        is `decide_step`, which the runner calls itself once it has asked held_plain."""
        if mode == "adaptive":
            held = self.held_plain(kv, max_keep, version, k)
            if held is not None:
                return held
        return self.decide_step(mode, kv, max_keep, version, k, oracle, catchup, record)

    def decide_step(self, mode: str, kv, max_keep, version: int, k: int,
                    oracle: np.ndarray | None = None, catchup=None, record: tuple | None = None) -> SpecStep:
        """begin_step without its held_plain: for a caller that asked held_plain already (the runner,
        which builds the catch-up callable only where that said None)."""
        if mode not in MODES:
            raise ValueError(f"unknown speculation mode {mode!r}; expected one of {MODES}")
        if not k and mode == "static":  # plain decoding: nothing to decide (a SpecStep had cost it 2-3 us a step)
            return PlainStep(self, self.model(version), kv, max_keep, 0, mode)
        probe = learning = False
        model = self.model(version)
        total = None  # the batch's summed context, where the budget needs it
        if mode == "adaptive":
            self.adaptive_steps += 1
            n = len(kv)
            cold = self.cold_alone if n == 1 else self.cold
            # batch 1's cold start probes a row no further behind than a steady step (catchup None) only: one
            # that stood down at a larger batch would first catch up on all it emitted since (DESIGN.md section 8,
            # cold start)
            learning = cold and k > 0 and (n > 1 or catchup is None) and self.terms.could_pay(model, n, k)
            # where no acceptance rate could make drafting pay, a probe could learn nothing the budget reads (but
            # for the first drafts that end a cold start: DESIGN.md section 8, probes); asked only where one is due.
            # From two sequences on a probe also waits on what it would cost (its row's catch-up): stand_down_price
            price, lag = None, getattr(catchup, "least_lag", None)
            if n > 1 and k and lag is not None:
                total = sum(kv) if isinstance(kv, list) else int(kv.sum())
                price = functools.cache(lambda: stand_down_price(model, n, total, lag()))  # asked twice at most
            probe = self.probes.due(n, cold=learning, allowed=None if cold else lambda: k > 0 and
                                    self.terms.could_pay(model, n, k), price=price)
            cheapest = getattr(catchup, "cheapest", None)  # (the row a stand-down probe drafts for)
            if catchup is not None and not (model.catchup_ms and k):
                catchup = None  # nothing to price
            at = level_in(*record, self.pooled_rate, self._bounds) if n == 1 and record and self.seq_history else 0
            one = None
            if n == 1 and k and self.one_row_steps and (catchup is None or not catchup(k)):
                # behind by no more than a steady step: its OneRow decides (a drafting step asks nothing more)
                one = OneRowStep(self, probe, kv, max_keep, model, k, cold_start=learning, level=at)
                if one.best_m or probe or self.seq_history:
                    return one
            if k and (n > 1 or not self.seq_history):
                if total is None:
                    total = sum(kv) if isinstance(kv, list) else int(kv.sum())
                step = None if probe else self._stand_down(model, kv, max_keep, version, k, total, cold, price)
                if step is not None:
                    return step
            if one is not None:
                return one
        else:
            catchup = cheapest = None
            at = 0
        return SpecStep(self, mode, probe, kv, max_keep, model, oracle, k, cold_start=learning, kv_total=total,
                        catchup=catchup, level=at, cheapest=cheapest)

    def _stand_down(self, model: TimeModel, kv, max_keep, version: int, k: int, total: int, cold: bool,
                    price=None):
        """decide_step's PlainStep past the context where no draft budget beats a plain step, without the
        budget's loop (at batch 1 once its OneRow said 0, and before the rows' catch-up, which only makes
        drafting dearer; not with seq_history, where the next step's sequence may stand at another
        level), held for the next steps of this batch size (held_plain); else None. total: sum(kv);
        price: the probe schedule's (ProbeSchedule.due), which the held stand-down's next probe waits on."""
        n = len(kv)
        start = self.terms.stand_down_at(model, n, k)
        if start is None or model.b2 * float(total) < start:
            return None
        step = PlainStep(self, model, kv, max_keep, k)
        pays = self.terms.could_pay(model, n, k)
        # a cold start's steps may probe at any step where drafting could pay (not held); where it could not,
        # they probe on the schedule alone, as a held stand-down does (an engine that never drafts stays cold:
        # unheld, each of its steps had gone this way, 10 us a step served at 75% of saturation)
        if not cold or not pays:
            may_probe = pays or cold
            down = self._downs[n] = StandDown(version, model, k, start, self.probes, batch_bucket(n), may_probe,
                                              price() if may_probe and price is not None else 1.0)
            down.step = step
        return step

    def begin_alone(self, kv: list, max_keep: list, version: int, k: int) -> SpecStep:
        """begin_step for the runner's usual step of one sequence: adaptive, k > 0, its row no further
        behind than a steady step (no catch-up to price) and no record to read (seq_history off). The
        same step, decision for decision (tests/test_one_row_step.py), in fewer calls where the cold
        start is over and no stand-down is held: between two forward passes, which leave the caches
        cold, held_plain, the runner's catch-up check and decide_step had cost such a step 14 us (median)."""
        if self.cold_alone or not self.one_row_steps or 1 in self._downs:
            return self.begin_step("adaptive", kv, max_keep, version, k)
        model = self.models.get(version) if version == self.in_use else None
        if model is None:
            model = self.model(version)
        self.adaptive_steps += 1
        probe = self.probes.due(1, allowed=lambda: self.terms.could_pay(model, 1, k))
        one = OneRowStep(self, probe, kv, max_keep, model, k)
        if one.best_m or probe:
            return one
        held = self._stand_down(model, kv, max_keep, version, k, kv[0], False)
        return one if held is None else held

    def held_plain(self, kv, max_keep, version: int, k: int, counted: bool = False):
        """begin_step's fast path for an adaptive step, which the runner asks first: the step's PlainStep
        where this batch size's last stand-down (controller/stand_down.py) still holds, else None (then
        begin_step decides). Counted as begin_step counts it. The PlainStep is the stand-down's own,
        handed out again at each such step with this step's kv and caps: the step reads it until
        end_plain_step and keeps nothing of it (a new one each step, and the runner's catch-up
        callable, had cost a standing-down step about 1.5 us more). counted: the step's end is counted
        here too, as end_plain_step would count it (a held step is no probe), and the caller does not
        call that: the runner's steps standing down, where the second call, cold after the forward, had
        cost about 2 us a step."""
        down = self._downs.get(len(kv))
        # held for k drafts, it holds for fewer (a round's last sequences, their caps falling to their last token):
        # the budget's terms of m <= k' are the first k' of those for k, so its stand-down point and could_pay
        # for k' are at most those for k (an exact subset: tests/test_policy.py)
        if down is None or version != down.version or k > down.k:
            return None
        counts, b = down.counts, down.bucket
        count = counts[b] + 1
        if count >= down.probe_at or down.b2 * float(sum(kv) if isinstance(kv, list) else int(kv.sum())) < down.start:
            return None
        counts[b] = count
        self.adaptive_steps += 1
        step = down.step
        step.kv, step.max_keep_list, step.k, step._full = kv, max_keep, k, None
        if counted:
            self._count_step(0)
        return step

    def draft_row(self, k: int) -> int | None:
        """The first of k rows of the draft slab for a batch-1 step's draft loop, or None where they
        do not fit. Rows are lent in order and taken back at the calibration batch, which has read
        every step that drafted into them (at most OBSERVE_MAX steps end between two batches)."""
        row = self._slab_used
        if row + k > self.draft_slab.shape[1]:
            return None
        self._slab_used = row + k
        return row

    def full_caps(self, n: int, cap: int) -> np.ndarray:
        """[cap] * n as a read-only array, made once per (n, cap): a large batch's caps, which are
        usually all the step's k (converting the list cost a step a numpy call)."""
        key = (n, cap)
        held = self._caps_cache.get(key)
        if held is None:
            if len(self._caps_cache) > 64:
                self._caps_cache.clear()
            held = self._caps_cache[key] = np.full(n, cap, dtype=np.int64)
            held.flags.writeable = False
        return held

    def end_step(self, step: SpecStep, top_prob: np.ndarray, margin: np.ndarray, verified, accepted,
                 catchup_tokens: int = 0) -> None:
        """The step's outcomes (as `observe`; verified, accepted: lists or arrays), and the probe
        back-off: the interval doubles while probes keep finding that drafting does not pay, times
        what the last one cost from two sequences on (catchup_tokens: what its draft caught up on;
        `probe_price`), and starts over when one finds it does.

        An oracle step teaches nothing: it verified the drafts that match the reference, chosen
        by their outcome, so nearly every one it verified was accepted. In the benchmark, where
        the oracle arms share the policy with the adaptive ones, their outcomes had made the
        logistic estimate 0.03-0.06 too high for every other arm's drafts (replay of a recorded
        benchmark trace, per position at batch 1 and 8; calibrated without them)."""
        if step.mode == "oracle":
            return
        if step.probe and not step.cold_start:
            n, pays = len(step.kv), step.best_m > 0
            # (batch 1 backs off by doubling alone: where drafting pays most, a stand-down is re-examined soonest)
            self.probes.found(n, pays, 1.0 if pays or n == 1 else probe_price(step, catchup_tokens))
        counted = None
        if step.rows is not None and step.rule_keep is not None:
            # a stand-down probe's rows, all verified by exploration, stand for what the rule would have verified
            # at that position: a sample of the rule's yield for the budget (they are the only rows that drafted)
            rule = np.asarray(step.rule_keep, dtype=np.int64)
            counted = (rule, np.minimum(accepted, rule))
        self.observe(top_prob, margin, verified, accepted, step.rule_keep, counted, step.drafted)

    def end_plain_step(self, step: SpecStep) -> None:
        """end_step for a step that drafted nothing (plain decoding, standing down): the same
        bookkeeping without the outcome arrays it would have been handed empty."""
        if step.mode == "oracle":
            return
        if step.probe and not step.cold_start:
            self.probes.found(len(step.kv), step.best_m > 0)
        self._count_step(0)

    def one_row(self, tm: TimeModel, extra: int, at: int = 0):
        """Batch 1's OneRow (controller/one_row.py), deciding on the logistic estimate, for steps
        that may decide on `extra` drafts; each step starts it with `begin`, which also answers
        the draft budget. It is kept across steps and rebuilt only when the time model changes,
        a calibration batch moves the logistic weights and the rates (`_set_rates` drops it),
        or a step may decide on more drafts than it was built for: the compiled one's per-step
        cost is a call. It is built
        for at least the policy's k, as its terms for m drafts do not depend on how many more
        it holds and a step's cap bounds what it decides on: the last steps of a sequence, which
        may verify fewer drafts (max_tokens is near), had rebuilt it at 14% of batch 1's
        adaptive steps, about 18 us a step on average. One per level (`at`, controller/history.py)
        of the sequences' records: their rates and budget terms are the level's."""
        held = self._one_row.get(at)
        if held is None or held[0] is not tm or held[1] < extra:
            weights, rates = self.logistic.weights, self.rates_at(at)
            extra = max(extra, self.cfg.num_speculative_tokens)
            costs = step_costs(tm, [0], extra, self.terms.f_values(tm, "decide", 1, extra))
            compiled = self.compiled
            one = new_one_row(costs, self.cfg.adaptive.min_gain, extra,
                              weights if compiled is None else self.compiled_weights(), compiled)
            one.set_terms([draft_units(tm.draft_ms(1, j)) for j in range(extra + 2)], rates)
            base = self.terms.budget_terms(tm, 1, 1, at=at)[0]
            terms = [[]] + [self.terms.budget_terms(tm, 1, k, at=at)[1] for k in range(1, extra + 1)]
            one.set_budget(tm.b2, base, costs.fixed, terms, 1.0 + self.cfg.adaptive.min_gain, UNITS_PER_MS,
                           self.cfg.adaptive.early_stop_at_rate)
            one.watch_slab(self.draft_slab[0], self.draft_slab[1])
            held = self._one_row[at] = (tm, extra, one)
        return held[2]

    def compiled_weights(self):
        """The logistic weights as the kernels take them (LogisticWeights), converted once per
        calibration batch (the weights are a new list after each)."""
        weights = self.logistic.weights
        if self._compiled_weights is None or self._compiled_weights[0] is not weights:
            self._compiled_weights = (weights, self.compiled.LogisticWeights(weights))
        return self._compiled_weights[1]

    def shares(self, n: int, at: int = 0) -> tuple[list[float], list[float]]:
        """The draft yields' (accepted, verified) shares per position for steps of n sequences,
        as of the last calibration batch; at: a sequence's record's level (history.shifted_shares)."""
        key = (batch_bucket(n), at)
        held = self._shares.get(key)
        if held is None:
            accepted, verified = self.yields.shares(n, self._rates) if not at else self.shares(n)
            held = self._shares[key] = (shifted_shares(accepted, verified, at) if at else accepted, verified)
        return held

    def rates_at(self, at: int) -> list[float]:
        """The early stop's rates for a draft not yet made (next_rates) at a record's level."""
        held = self._level_rates.get(at)
        if held is None:
            held = self._level_rates[at] = shifted(self.next_rates, at)
        return held

    # ------------------------------------------------------------------ calibration
    def observe(self, top_prob: np.ndarray, margin: np.ndarray, verified, accepted, rule=None,
                counted: tuple | None = None, drafted: tuple | None = None) -> None:
        """Validation outcomes (top_prob, margin: (n, m) of the drafts made, of which the first
        max(verified) columns are read, at the calibration batch; verified, accepted: (n,)
        lists or arrays; rule: what the keep rule chose, None where it did not decide; counted:
        the (verified, accepted) the draft yields count, when not these; drafted: the step's
        (max_keep, drafts made), which they count with them, given with rule).
        They reach the calibrators in batches of at least OBSERVE_EVERY steps and
        OBSERVE_ROWS sequence-steps (at most OBSERVE_MAX steps): one fixed cost per batch
        instead of per step (at batch 1 a batch costs about 1.5 ms in the engine), and the
        same batches on every rank. The draft yields' counts wait for the batch too: counted
        per step, they cost batch 1 about 6 us a step (cold caches between forward passes)."""
        # the drafts some sequence verified (never more than it drafted)
        width = max(verified, default=0) if isinstance(verified, list) else int(verified.max(initial=0))
        if width:
            self._pending.append((top_prob, margin, verified, accepted, rule, width))
            self._pending_rows += len(verified)
        if rule is not None:  # what the step verified (the rule's choice and exploration's) and got accepted
            self._counts.append((drafted, verified, accepted) if counted is None else (drafted, *counted))
        self._count_step(width)

    def _count_step(self, width: int) -> None:
        """One more step observed (width: drafts some sequence verified); a calibration batch when due."""
        self._observed += 1
        rows = self._pending_rows
        if (self.cold_alone and width and rows * COLD_BATCH > self._first_drafts) or self._observed >= OBSERVE_MAX or \
                (self._observed >= OBSERVE_EVERY and rows >= OBSERVE_ROWS):
            self._flush()

    def _flush(self) -> None:
        self.calibrations += 1
        self._slab_used = 0  # the steps that drafted into the slab are all read below
        counts, self._counts = self._counts, []
        self.yields.count_steps(counts)
        self.yields.fold()
        if not self._pending:
            self._observed = self._pending_rows = 0
            if counts:  # the draft yields moved; nothing else did
                self._set_rates()
            # a batch of steps that drafted nothing (plain decoding, standing down, oracle steps) changes
            # no rate: the budget's terms and batch 1's OneRow stay (rebuilt, they had cost the next
            # drafting step at batch 1 about 0.5 ms)
            return
        # A large batch's calibration batch (batch 256: 8,000 sequence-steps, about 5 ms) fits on
        # every r-th sequence-step, each counted r times: the same sums in expectation, at 1/r of
        # the cost. The sample's offset rotates with the batches, so every row position takes turns.
        r = -(-self._pending_rows // CALIBRATE_ROWS)
        pending = every(self._pending, r, self._batches % r) if r > 1 else self._pending
        self._batches += 1
        top, margin, weights = stacked(pending)
        verified, accepted = joined([p[2] for p in pending]), joined([p[3] for p in pending])
        steps = len(self._pending)  # steps that verified something: the evidence fades once per such step
        self._pending, self._observed, self._pending_rows = [], 0, 0
        self.calibrator.update(top, verified, accepted, repeat=r)
        self._first_drafts = int(self.calibrator.trials[0].sum())
        self.cold, self.cold_alone = self._first_drafts < COLD_TRIALS, self._first_drafts < ALONE_COLD_TRIALS
        if self.cfg.adaptive.estimator == "top_prob_logistic":
            self.logistic.update(top, margin, verified, accepted, steps=steps, weights=weights * r)
        self._set_rates()

    def _set_rates(self) -> None:
        """What the budget and the early stop read, as of the last calibration batch."""
        self._rates = rates = prior_rates(self.calibrator)
        self._shares = {}  # the budget's, per batch-size bucket (shares)
        self.terms.forget_budget()  # the budget's terms follow the shares
        self._downs: dict[int, StandDown] = {}  # ... and where it stands down, per batch size (begin_step)
        self.next_rates = rates.tolist()  # the early stop's guess at a draft not yet made
        self._level_rates = {0: self.next_rates}  # rates_at's, per level of a sequence's record
        hits, trials = self.calibrator.hits.sum(), self.calibrator.trials.sum()
        self.pooled_rate = float((hits + 0.5 * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT))  # the records' reference
        self._bounds = bounds(self.pooled_rate)  # where a record's level steps up (history.level_in)
        self._one_row = {}  # batch 1's OneRows hold the rates and the logistic weights: rebuilt on next use
