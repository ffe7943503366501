"""Speculation control on one rank: draft budget, early stop, the keep decision, and
calibration. Everything here is a deterministic function of what every rank holds (the
gathered draft distributions, validation outcomes, the plan's mode, step and time-model
version), so all ranks reach the same answers without talking to each other.

Modes (chosen per step by the plan):
  static    draft k, verify every draft
  adaptive  draft budget, early stop and the keep decision (DESIGN.md section 3)
  oracle    verify exactly the drafts that match a known reference continuation (benchmark
            floor on validate cost; needs the reference tokens in the plan)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from controller.config import SpeculativeConfig
from controller.decision import SMALL, StepCosts, decide_small, decide_with, f_table, step_costs
from controller.early_stop import worth_drafting
from controller.estimators import Calibrator, LogisticCalibrator
from controller.time_model import TimeModel
from controller.yields import DraftYields, prior_rates

MODES = ("static", "adaptive", "oracle")
PROBE_EVERY = 32  # an adaptive step explores one draft position past the budget every 32 steps ...
PROBE_MAX_EVERY = 1024  # ... backing off (doubling) while probes keep finding that drafting does not pay ...
EXPLORE_EVERY = 8  # at every adaptive step, every 8th sequence (rotating) verifies everything drafted
OBSERVE_EVERY = 32  # validation outcomes reach the calibrators in batches of at least this many steps ...
OBSERVE_ROWS = 256  # ... and of at least this many sequence-steps (small batches wait longer) ...
OBSERVE_MAX = 256  # ... but never more steps than this


@dataclass
class StepContext:
    mode: str
    probe: bool
    kv: np.ndarray  # (n,) context length of each sequence
    max_keep: np.ndarray  # (n,) drafts each sequence may verify
    model: TimeModel
    oracle: np.ndarray | None  # (n, k) reference tokens after the last emitted one (-1 past the end)
    kmax: int = 0  # max(max_keep)
    max_keep_list: list | None = None  # max_keep as Python ints (small batches)
    costs: StepCosts | None = None  # adaptive steps: the decision's time terms
    rule_keep: list | np.ndarray | None = None  # adaptive steps: what the keep rule chose (before exploration)
    conf: list | None = None  # adaptive steps: acceptance estimates of the positions drafted so far
    draft_step_ms: float | None = None  # the time model's g(n), asked once per draft step


class SpecPolicy:
    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.calibrator = Calibrator(max(cfg.num_speculative_tokens, 1))  # also the yields' prior
        self.logistic = LogisticCalibrator(max(cfg.num_speculative_tokens, 1))
        self.models: dict[int, TimeModel] = {0: TimeModel()}
        self.in_use = 0  # the newest version a plan has named
        self._lock = threading.Lock()
        self.adaptive_steps = 0  # counted identically on every rank (every rank runs every plan)
        self.probes = 0
        self.probe_every = PROBE_EVERY
        self.last_probe = -PROBE_EVERY  # the first adaptive step probes
        self.ctx: StepContext | None = None
        self._pending: list[tuple] = []  # (top_prob, margin, verified, accepted, rule_keep) not yet in the calibrators
        self._observed = self._pending_rows = 0  # steps and sequence-steps since the last batch
        self.yields = DraftYields(max(cfg.num_speculative_tokens, 1))
        self._set_rates()
        self._f_cache: dict[tuple, tuple] = {}  # f values a time model gives a batch size (see _f)

    # ------------------------------------------------------------------ time models
    def install(self, model: TimeModel) -> int:
        # Installs may arrive on another thread than steps (Ray Compiled Graph): lock.
        with self._lock:
            self.models[model.version] = model
            self._evict()
        return model.version

    def model(self, version: int) -> TimeModel:
        """The model a plan names. Plans name non-decreasing versions, so older ones go."""
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
    def begin_step(self, mode: str, kv: np.ndarray, max_keep: np.ndarray, version: int,
                   oracle: np.ndarray | None = None) -> StepContext:
        """Probe steps: without them, positions the budget calls hopeless would never be
        drafted, and the estimates could never learn that they are not. A probe drafts one
        position past the budget; the exploration in `keep` verifies it for a rotating share of
        the sequences. (Drafting all k at a probe was tried: DESIGN.md section 8, probes.)"""
        if mode not in MODES:
            raise ValueError(f"unknown speculation mode {mode!r}; expected one of {MODES}")
        probe = False
        if mode == "adaptive":
            self.adaptive_steps += 1
            probe = self.adaptive_steps - self.last_probe >= self.probe_every
            if probe:
                self.last_probe, self.probes = self.adaptive_steps, self.probes + 1
        small = len(max_keep) <= SMALL
        self.ctx = StepContext(mode, probe, kv, max_keep, self.model(version), oracle, int(max_keep.max(initial=0)),
                               max_keep.tolist() if small else None)
        return self.ctx

    def draft_budget(self, k: int) -> int:
        """How many draft steps to run: the m in 0..k that maximises the estimated
        throughput n (1 + y_1 + .. + y_m) / (T_draft(m) + T_val(n (1 + v_1 + .. + v_m)) + T_other),
        y_j and v_j the shares of drafts at position j that were accepted and that were verified
        (DraftYields), at the batch's mean context (O(k) scalar arithmetic, the same on
        every rank). 0 means a plain decode step."""
        c = self.ctx
        if c.mode != "adaptive" or k == 0:
            return k
        tm, n = c.model, len(c.kv)
        kv_ms = tm.b2 * float(c.kv.sum())  # one validated token per sequence: context cost of the batch
        f = self._f(tm, "budget", n, k)  # f(n (m + 1)) in ms for m = 0..k
        (gain, share), o0, o1, first, g = self._shares, tm.o0, tm.o1, tm.d_first, self._draft_step_ms()  # (inlined)
        best_m, best, expected, verified = 0, 1.0 / (tm.other_ms(n) + f[0] + kv_ms), 1.0, 1.0
        for m in range(1, k + 1):
            expected += gain[m - 1]
            verified += share[m - 1]  # validated tokens per sequence: f between its knots n, 2n, ..
            x = verified - 1.0
            lo = min(int(x), k - 1)
            f_val = f[lo] + (x - lo) * (f[lo + 1] - f[lo])
            theta = expected / ((o0 + o1 * (n * expected)) + (first + m * g) + f_val + verified * kv_ms)
            if theta > best * (1.0 + self.cfg.adaptive.min_gain):
                best_m, best = m, theta
        if c.probe:  # back off while probing keeps confirming that drafting does not pay
            self.probe_every = min(PROBE_MAX_EVERY, self.probe_every * 2) if best_m == 0 else PROBE_EVERY
            return min(k, best_m + 1)
        # one position of headroom: the early stop, which sees each step's drafts, decides on it
        # (at batch 1 the budget alone stopped at 2 of 3 drafts static-3 verifies to its gain)
        return min(k, best_m + 1) if best_m and self.cfg.adaptive.early_stop else best_m

    def keep_drafting(self, top_prob: list[np.ndarray], margin: list[np.ndarray], tokens: list[np.ndarray]) -> bool:
        """After j draft steps (top_prob, margin, tokens: j columns of (n,)), is draft j+1
        worth drafting? adaptive: only if the best keep set with it, each sequence's next
        draft at its position's observed conditional acceptance (one step ahead; the draft
        itself is not known yet), beats the best without it and without its draft step;
        oracle: only if some sequence still matches the reference."""
        c = self.ctx
        j = len(top_prob)
        if c.mode == "oracle":
            return bool((self._oracle_match(np.stack([np.asarray(t) for t in tokens], 1)) >= j).any())
        if c.mode != "adaptive" or c.probe or not self.cfg.adaptive.early_stop:
            return True
        cols = self._estimates(top_prob, margin, j)
        # draft times are predicted, never measured: the same on every rank
        return worth_drafting(cols, self._costs(), self.cfg.adaptive.min_gain, self._draft_ms(j), self._draft_ms(j + 1),
                              self._next_rates[j], c.max_keep_list if isinstance(cols[0], list) else c.max_keep)

    def keep(self, top_prob: np.ndarray, token_prob: np.ndarray, margin: np.ndarray,
             tokens: np.ndarray | None) -> np.ndarray:
        """(n,) drafts each sequence validates; top_prob, token_prob, margin, tokens: (n, m)."""
        c = self.ctx
        n, m = top_prob.shape
        if c.mode == "oracle":
            return np.minimum(np.minimum(self._oracle_match(tokens), c.max_keep), m)
        if c.mode == "static" or m == 0:
            return np.minimum(c.max_keep, m)
        conf = token_prob if self.cfg.adaptive.estimator == "token_prob" else _matrix(self._estimates(top_prob, margin, m))
        draft_ms = self._draft_ms(m)
        # exploration: the estimator learns only from verified drafts, and those the rule picked are
        # the confident ones; a rotating share, chosen by step and row alone, verifies everything
        # (observe weighs the drafts only it verified by EXPLORE_EVERY, their sampling rate)
        first = -self.adaptive_steps % EXPLORE_EVERY  # rows first, first + EXPLORE_EVERY, ..
        if isinstance(conf, list):
            keep = c.rule_keep = decide_small(conf, self._costs(), self.cfg.adaptive.min_gain, draft_ms, c.max_keep_list)
            self.yields.count_drafts(c.max_keep_list, m)
            out = list(keep)
            for i in range(first, n, EXPLORE_EVERY):
                out[i] = min(c.max_keep_list[i], m)
            return np.array(out)
        keep = c.rule_keep = decide_with(conf, self._costs(), self.cfg.adaptive.min_gain, draft_ms, c.max_keep)
        self.yields.count_drafts(c.max_keep, m)
        out = keep.copy()
        out[first::EXPLORE_EVERY] = np.minimum(c.max_keep[first::EXPLORE_EVERY], m)
        return out

    def _costs(self) -> StepCosts:
        """The step's decision costs, computed on first use (a step that drafts nothing never needs them)."""
        c = self.ctx
        if c.costs is None:
            extra = len(c.kv) * c.kmax
            c.costs = step_costs(c.model, c.kv, extra, self._f(c.model, "decide", len(c.kv), extra))
        return c.costs

    def _draft_step_ms(self) -> float:
        """The time model's g(n), looked up once per step."""
        c = self.ctx
        if c.draft_step_ms is None:
            c.draft_step_ms = c.model.draft_step_ms(len(c.kv))
        return c.draft_step_ms

    def _draft_ms(self, steps: int) -> float:
        """The time model's draft_ms(n, steps)."""
        return self.ctx.model.d_first + steps * self._draft_step_ms() if steps > 0 else 0.0

    def _f(self, tm: TimeModel, use: str, n: int, extra: int):
        """Values of f that steps of one batch size ask again and again, computed once per
        time model (steps repeat a batch size far more often than a model changes)."""
        key = (use, id(tm), n, extra)
        hit = self._f_cache.get(key)
        if hit is None or hit[0] is not tm:  # (an id can come back for a new model once the old one is gone)
            if len(self._f_cache) > 256:
                self._f_cache.clear()
            f = tm.q_ms_at(n * np.arange(1, extra + 2)).tolist() if use == "budget" else f_table(tm, n, extra)
            hit = self._f_cache[key] = (tm, f)
        return hit[1]

    def _oracle_match(self, tokens: np.ndarray) -> np.ndarray:
        j = tokens.shape[1]
        match = tokens == self.ctx.oracle[:, :j]
        return np.cumprod(match, axis=1).sum(axis=1)

    # ------------------------------------------------------------------ estimates
    def _estimates(self, top_prob, margin, count: int) -> list:
        """Acceptance estimates of the step's first `count` draft positions, one column
        each, computed once per position and step (the calibrators change only between
        steps); Python lists for small batches, arrays for large ones. top_prob, margin:
        lists of (n,) columns or (n, m) arrays. token_prob's early stop uses the top
        probability, an upper bound of the drafted token's."""
        c = self.ctx
        if c.conf is None:
            c.conf = []
        small = len(c.kv) * c.kmax <= SMALL
        est = self.cfg.adaptive.estimator
        for j in range(len(c.conf), count):
            col, m = _column(top_prob, j), _column(margin, j)
            if small != isinstance(col, list):
                col = col.tolist() if small else np.asarray(col, dtype=np.float64)
            if est == "top_prob_logistic":
                if small != isinstance(m, list):
                    m = m.tolist() if small else np.asarray(m, dtype=np.float64)
                col = self.logistic.estimate_column(col, m, j)
            elif est == "top_prob_calibrated":
                col = self.calibrator.estimate(np.asarray(col, dtype=np.float64)[:, None], start=j)[:, 0]
                col = col.tolist() if small else col
            c.conf.append(col)
        return c.conf[:count]

    def observe(self, top_prob: np.ndarray, margin: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """Validation outcomes (top_prob, margin: (n, m) of the drafts that could be verified).
        They reach the calibrators in batches of at least OBSERVE_EVERY steps and
        OBSERVE_ROWS sequence-steps (at most OBSERVE_MAX steps): one fixed cost per batch
        instead of per step (at batch 1 a batch costs about 0.5 ms in the engine), and the
        same batches on every rank."""
        rule = self.ctx.rule_keep if self.ctx is not None else None
        if top_prob.shape[1]:
            self._pending.append((top_prob, margin, verified, accepted, rule))
            self._pending_rows += len(verified)
        if rule is not None:  # what the step verified (the rule's choice and exploration's) and got accepted
            self.yields.count_outcomes(verified.tolist() if len(verified) <= SMALL else verified, accepted)
        self._observed += 1
        if self._observed >= OBSERVE_MAX or (self._observed >= OBSERVE_EVERY and self._pending_rows >= OBSERVE_ROWS):
            self._flush()

    def _flush(self) -> None:
        self.yields.fold()
        if not self._pending:
            self._observed = self._pending_rows = 0
            self._set_rates()
            return
        width = max(t.shape[1] for t, *_ in self._pending)
        rows = sum(len(t) for t, *_ in self._pending)
        top, margin, weights = np.zeros((rows, width)), np.ones((rows, width)), np.ones((rows, width))
        row = 0
        for t, m, _, _, w in self._pending:
            top[row:row + len(t), :t.shape[1]] = t  # past a step's width nothing was verified
            margin[row:row + len(t), :t.shape[1]] = m
            if w is not None:  # drafts verified only by exploration stand for the EXPLORE_EVERY - 1 unverified like them
                weights[row:row + len(t), :t.shape[1]][np.arange(t.shape[1])[None, :] >= np.asarray(w)[:, None]] = \
                    float(EXPLORE_EVERY)
            row += len(t)
        verified = np.concatenate([p[2] for p in self._pending])
        accepted = np.concatenate([p[3] for p in self._pending])
        steps = len(self._pending)  # steps that verified something: the evidence fades once per such step
        self._pending, self._observed, self._pending_rows = [], 0, 0
        self.calibrator.update(top, verified, accepted)
        if self.cfg.adaptive.estimator == "top_prob_logistic":
            self.logistic.update(top, margin, verified, accepted, steps=steps, weights=weights)
        self._set_rates()

    def _set_rates(self) -> None:
        """What the budget and the early stop read, as of the last calibration batch."""
        rates = prior_rates(self.calibrator)
        self._shares = self.yields.shares(rates)  # the budget's
        self._next_rates = rates.tolist()  # the early stop's guess at a draft not yet made


def _matrix(cols: list) -> list[list[float]] | np.ndarray:
    """Columns (Python lists for small batches, arrays otherwise) -> rows, as the decision takes them."""
    return [list(row) for row in zip(*cols)] if isinstance(cols[0], list) else np.stack(cols, 1)


def _column(a, j: int):
    """Column j of a list of columns or of an (n, m) array."""
    return a[:, j] if isinstance(a, np.ndarray) else a[j]
