"""Trace replay: the project's own speculation control (controller.policy.SpecPolicy: draft
budget, early stop, keep decision, calibration) and time-model registry, run unchanged on
simulated decode steps whose drafts come from a recorded trace and whose times come from a
cost model.

One arm at one batch size runs waves of `batch` sequences, as the offline benchmark does:
every simulated sequence replays one recorded sequence (its starting context, and in each
step a draft row drawn from that sequence's rows: top probabilities and true acceptance
length), so easy and hard sequences stay easy and hard and a wave's batch thins out as in
the engine. It emits `output_len - 1` tokens by decode steps (the first comes from its
prefill, which is not simulated); a finished sequence leaves the batch. The policy decides
what to draft and verify; accepted = min(kept, true acceptance). The step's time is the
cost model's draft, validate and rest-of-step times plus the controller's: as measured in
the engine where the cost model has it (a profile fitted to a trace), else the wall time
the policy took here.
Times feed the registry as measured steps do in the engine (refits, versions); the startup
sweep runs on the cost model through cluster/engine/sweep.py's own grid.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from cluster.sim.costs import CostWorkers
from cluster.sim.traces import DraftPool
from controller.config import SpeculativeConfig
from controller.policy import SpecPolicy
from controller.registry import ProfileRegistry
from controller.samples import StepSample
from models.kernels import controller_ops


WARM_ROWS = 4096  # draft rows the calibrators see before an arm starts (see warm)
MODES = {"nospec": "static", "static": "static", "adaptive": "adaptive", "oracle": "oracle"}  # arm -> plan mode


@dataclass
class SimArm:
    policy: str  # nospec | static | adaptive | oracle
    k: int
    batch: int

    @property
    def name(self) -> str:
        return "nospec" if self.policy == "nospec" else f"{self.policy}-{self.k}"


@dataclass
class SimResult:
    arm: SimArm
    tokens: int = 0
    ms: float = 0.0
    seq_ms: float = 0.0  # sum over steps of sequences x step time (decode TPOT = seq_ms / tokens)
    steps: int = 0
    seq_steps: int = 0
    verified: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    validate_ms: float = 0.0
    other_ms: float = 0.0
    control_ms: float = 0.0
    budgets: list = field(default_factory=list)

    def add(self, n: int, tokens: int, step_ms: float, verified: int, accepted: int, draft_ms: float,
            validate_ms: float, other_ms: float, control_ms: float) -> None:
        """One decode step of n sequences."""
        self.tokens += tokens
        self.ms += step_ms
        self.seq_ms += n * step_ms
        self.steps += 1
        self.seq_steps += n
        self.verified += verified
        self.accepted += accepted
        self.draft_ms += draft_ms
        self.validate_ms += validate_ms
        self.other_ms += other_ms
        self.control_ms += control_ms

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        return {"name": f"{self.arm.name}@b{self.arm.batch}", "policy": self.arm.policy, "k": self.arm.k,
                "batch": self.arm.batch, "tok_per_s": round(1e3 * self.tokens / max(self.ms, 1e-9), 2),
                "decode_tpot_ms": round(self.seq_ms / max(self.tokens, 1), 4),
                "acceptance_length": round(self.tokens / max(self.seq_steps, 1), 4),
                "verified_per_seq_step": round(self.verified / max(self.seq_steps, 1), 4),
                "acceptance_rate": round(self.accepted / max(self.verified, 1), 4),
                "draft_ms_per_step": round(self.draft_ms / steps, 4),
                "validate_ms_per_step": round(self.validate_ms / steps, 4),
                "other_ms_per_step": round(self.other_ms / steps, 4),
                "control_ms_per_step": round(self.control_ms / steps, 4), "steps": self.steps}


def startup_model(cost, spec: SpeculativeConfig, max_num_seqs: int = 64):
    """The engine's startup sweep on the cost model, fitted as the engine fits it, for an
    engine whose largest batch is max_num_seqs."""
    from cluster.config import Config
    from cluster.engine.sweep import fit_samples, sweep

    cfg = Config()
    cfg.speculative, cfg.engine.max_num_seqs = spec, max_num_seqs
    cfg.cache.kv_tokens = max(cfg.cache.kv_tokens, 1024 * max_num_seqs)  # the grid's every point fits
    samples = sweep(CostWorkers(cost), cfg, progress=False)
    return dataclasses.replace(fit_samples(samples, spec.adaptive.time_model).model, version=1), samples


def simulate(arm: SimArm, pool: DraftPool, cost, spec: SpeculativeConfig, startup, output_len: int,
             num_seqs: int, seed: int = 0, control_time: bool = True, warm_rows: int = WARM_ROWS) -> SimResult:
    """Run `arm` over max(num_seqs, batch) sequences (whole waves); startup: (model, sweep
    samples) from startup_model."""
    run = Run.start(arm, pool, spec, startup, seed, warm_rows)
    out = SimResult(arm)
    waves = -(-max(num_seqs, arm.batch) // arm.batch)
    for _ in range(waves):
        source = run.rng.integers(0, len(pool.sizes), arm.batch)  # each sequence replays one recorded sequence
        kv = pool.kv[source].copy()
        left = np.full(arm.batch, output_len - 1, dtype=np.int64)
        while (live := np.flatnonzero(left > 0)).size:
            run.step(live, kv, left, source, cost, out, control_time)
    return out


@dataclass
class Run:
    """One arm's controller state across its steps: the policy, the registry, the time
    model in force."""

    arm: SimArm
    pool: DraftPool
    policy: SpecPolicy
    registry: ProfileRegistry
    version: int
    rng: np.random.Generator

    @classmethod
    def start(cls, arm: SimArm, pool: DraftPool, spec: SpeculativeConfig, startup, seed: int,
              warm_rows: int = WARM_ROWS) -> "Run":
        if arm.k > pool.k:
            raise ValueError(f"arm {arm.name} drafts {arm.k} tokens but the trace's static rows have {pool.k}")
        policy = SpecPolicy(spec, compiled=controller_ops())  # as a rank's (workers/worker.py)
        model, sweep_samples = startup
        registry = ProfileRegistry(spec.adaptive.refit_every, model, sweep_samples, spec.adaptive.time_model)
        run = cls(arm, pool, policy, registry, policy.install(model), np.random.default_rng(seed))
        warm(policy, pool, max(arm.k, 1), warm_rows, run.rng)
        return run

    def step(self, live, kv, left, source, cost, out: SimResult, control_time: bool) -> float:
        """One decode step of the sequences `live` (indices into kv, left, source): draft rows
        drawn, the policy run, times from `cost`, the registry fed; returns the step's ms."""
        policy, pool = self.policy, self.pool
        k = 0 if self.arm.policy == "nospec" else self.arm.k
        n, mode = len(live), MODES[self.arm.policy]
        rows = pool.draw(source[live], self.rng)
        top, margin = pool.top_prob[rows, :max(k, 1)], pool.margin[rows, :max(k, 1)]
        true_acc = np.minimum(pool.accepted[rows], k)
        ctx_kv = kv[live]
        max_keep = np.maximum(0, np.minimum(k, left[live] - 1))
        kk = int(max_keep.max(initial=0))
        tokens = np.zeros((n, kk), dtype=np.int64)  # oracle: a draft matches the reference while accepted
        oracle = np.where(np.arange(kk)[None, :] < true_acc[:, None], 0, 1) if mode == "oracle" else None
        kv_list, caps = ctx_kv.tolist(), max_keep.tolist()  # lists, as the engine's runner hands them
        t0 = time.perf_counter()
        step = policy.begin_step(mode, kv_list, caps, self.version, kk, oracle)
        # the draft loop's (budget, n) float64 buffers, a row per position, which the early stop reads as
        # in the engine (workers/runner.py; their making is the draft's time there, not the controller's)
        t1 = time.perf_counter()
        top_rows, margin_rows = np.empty((2, step.budget, n))  # (fresh: a slice's strides need not be plain)
        top_rows[:], margin_rows[:] = top[:, :step.budget].T, margin[:, :step.budget].T
        tokens_rows = tokens[:, :step.budget].T
        t0 += time.perf_counter() - t1
        m = stops = 0
        more = step.early_stop(top_rows, margin_rows, tokens_rows) if step.budget else None
        for j in range(step.budget):
            m += 1
            if j == step.budget - 1:
                break
            stops += 1
            if more is not None and not more(m):
                break
        kept = step.keep(top[:, :m], top[:, :m], margin[:, :m], tokens[:, :m])
        accepted = [min(c, a) for c, a in zip(kept, true_acc.tolist())]
        width = max(kept, default=0)
        policy.end_step(step, top[:, :width], margin[:, :width], kept, accepted)
        measured = (time.perf_counter() - t0) * 1e3
        keep, accepted = np.array(kept, dtype=np.int64), np.array(accepted, dtype=np.int64)
        control = measured if control_time else 0.0
        profiled = cost.control_ms(self.arm.policy, n) if control_time else None
        control = control if profiled is None else profiled  # as measured in the engine, where the cost model has it
        # as the engine's registry learns it: drafting's cost includes its early stops and keep decision, here
        # their share of the policy's calls (begin, early stops, keep, end), not of wall time: the same on every run
        draft_control = control * (stops + 1) / (stops + 3) if m else 0.0
        emitted = np.minimum(accepted + 1, left[live])
        drafting = ctx_kv if step.rows is None else ctx_kv[step.rows]  # a stand-down probe: its rows alone
        t_draft = cost.draft_ms(len(drafting), drafting, m) if m else 0.0
        t_val = cost.validate_ms(keep + 1, ctx_kv)
        t_other = cost.other_ms(n, int(emitted.sum()))
        step_ms = t_draft + t_val + t_other + control
        new = self.registry.add([StepSample(n, int((keep + 1).sum()), int(((keep + 1) * ctx_kv).sum()), t_val, m,
                                            t_draft + draft_control, t_other + control - draft_control,
                                            int(emitted.sum()),
                                            draft_seqs=len(drafting) if m else 0)])
        if new is not None:
            self.version = policy.install(new)
        kv[live] += accepted + 1
        left[live] -= emitted
        out.add(n, int(emitted.sum()), step_ms, int(keep.sum()), int(accepted.sum()), t_draft, t_val, t_other, control)
        return step_ms


def warm(policy: SpecPolicy, pool: DraftPool, k: int, rows: int, rng: np.random.Generator) -> None:
    """Teach the calibrators `rows` fully verified draft rows first, in steps of 8: the
    steady state of a server that has run a while (and the benchmark's, where static arms
    teach the calibrators the adaptive arms share), rather than a cold start."""
    for _ in range(rows // 8):
        pick = rng.integers(0, len(pool), 8)
        policy.observe(pool.top_prob[pick, :k], pool.margin[pick, :k], np.full(8, k), np.minimum(pool.accepted[pick], k))
