"""Step costs for the simulator: a roofline of a model on an accelerator (roofline.py), or
a profile measured here (a step trace's own decode steps, or an `adaspec profile` /
startup-sweep file), and the adapter that lets the engine's startup sweep run on either.

A cost model answers, in milliseconds:
    validate_ms(q, kv)     one target forward: sequence i validates q[i] tokens at context kv[i]
    draft_ms(n, kv, steps) `steps` draft steps of n sequences
    other_ms(n, emitted)   the rest of a step (scheduling, sampling, bookkeeping)
    control_ms(policy, n)  the controller's own time, or None where the simulator measures it
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from controller.registry import STEADY_CATCHUP
from controller.samples import StepSample
from controller.time_model import doubling_knots, knot_values, nonneg_lstsq, piecewise, ramps


class ProfileCost:
    """Step times from steps measured here, fitted for their mean (least squares on
    milliseconds, every coefficient non-negative; the engine's time models fit relative
    errors and drop outliers, which suits a decision but predicts the mean step low):

        validate = f(Q) + b2 sum_i q_i kv_i       f piecewise linear, non-decreasing (time_model.ramps)
        draft    = h(n) + m g(n)                   m draft steps; h: the first step's extra (MTP reads
                                                   the hidden states of every accepted token)
        other    = a(n) + c(n) (E - n)             n sequences emit E tokens; c: the cost of a token
                                                   past the first of each sequence (accepted drafts)
    a, c, g and h are piecewise linear over the batch size, non-decreasing.
    """

    def __init__(self, q_knots, q_ms, b2: float, n_knots, g_ms, h_ms, o_knots, a_ms, c_ms, source: str,
                 control: dict | None = None):
        self.q_knots, self.q_ms, self.b2 = tuple(q_knots), tuple(q_ms), b2
        self.n_knots, self.g_ms, self.h_ms = tuple(n_knots), tuple(g_ms), tuple(h_ms)
        self.o_knots, self.a_ms, self.c_ms = tuple(o_knots), tuple(a_ms), tuple(c_ms)
        self.source = source
        self.control = control or {}  # policy -> (knots, ms): the controller's measured time per step

    def control_ms(self, policy: str, n: int) -> float | None:
        """The controller's time per step as measured here (None: not measured for this policy)."""
        if policy not in self.control:
            return None
        knots, ms = self.control[policy]
        return float(piecewise(n, knots, ms))

    @staticmethod
    def fit_control(times: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
        """Per policy, the mean controller time per step as a function of the batch size."""
        out = {}
        for policy, (n, ms) in times.items():
            if len(n) >= 2:
                knots = doubling_knots(n)
                out[policy] = (tuple(knots.tolist()), tuple(knot_values(nonneg_lstsq(ramps(n, knots), ms), knots).tolist()))
        return out

    @classmethod
    def fit(cls, samples: list[StepSample], source: str) -> "ProfileCost":
        val = [s for s in samples if s.q_tokens > 0]
        # steady draft steps: a simulated step never catches a row up on what it emitted standing down
        drafts = [s for s in samples if s.draft_steps > 0 and s.catchup_tokens <= STEADY_CATCHUP * s.drafting]
        timed = [s for s in samples if s.other_ms > 0 and s.emitted > 0]
        if len(val) < 3 or len(drafts) < 2:
            raise ValueError(f"{source}: too few measured steps to fit a profile ({len(val)} validations, "
                             f"{len(drafts)} with drafts)")
        q = np.array([s.q_tokens for s in val], dtype=np.float64)
        q_knots = doubling_knots(q)
        coef = nonneg_lstsq(np.column_stack([ramps(q, q_knots), [s.kv_tokens for s in val]]),
                            np.array([s.validate_ms for s in val]))
        n = np.array([s.drafting for s in drafts], dtype=np.float64)
        m = np.array([s.draft_steps for s in drafts], dtype=np.float64)
        n_knots = doubling_knots(n)
        r = ramps(n, n_knots)
        several = len(set(m.tolist())) > 1  # else the first step's extra cannot be told apart
        d = nonneg_lstsq(np.column_stack([r * m[:, None]] + ([r] if several else [])),
                         np.array([s.draft_ms for s in drafts]))
        g, h = d[:r.shape[1]], d[r.shape[1]:] if several else np.zeros(r.shape[1])
        if len(timed) < 3:  # a sweep times forwards only: the rest of a step counts as nothing
            timed = [StepSample(1, 1, 0, 0.0, 0, 0.0, 0.0, 1), StepSample(2, 2, 0, 0.0, 0, 0.0, 0.0, 2)]
            source += " (the rest of a step not measured: taken as 0)"
        n_o = np.array([s.num_seqs for s in timed], dtype=np.float64)
        extra = np.array([s.emitted for s in timed], dtype=np.float64) - n_o
        o_knots = doubling_knots(n_o)
        r_o = ramps(n_o, o_knots)
        o = nonneg_lstsq(np.column_stack([r_o, r_o * extra[:, None]]), np.array([s.other_ms for s in timed]))
        width = r_o.shape[1]
        return cls(q_knots.tolist(), knot_values(coef[:-1], q_knots).tolist(), float(coef[-1]), n_knots.tolist(),
                   knot_values(g, n_knots).tolist(), knot_values(h, n_knots).tolist(), o_knots.tolist(),
                   knot_values(o[:width], o_knots).tolist(), knot_values(o[width:], o_knots).tolist(), source)

    @classmethod
    def load(cls, path: str | Path) -> "ProfileCost":
        """A step trace (.jsonl, or .jsonl.gz) or a sweep file (the profile cache's JSON, with its samples)."""
        from cluster.sim.traces import control_times, samples as trace_samples

        path = Path(path)
        if path.name.endswith((".jsonl", ".jsonl.gz")):
            cost = cls.fit(trace_samples(path), f"profile fitted to the decode steps of {path}")
            cost.control = cls.fit_control(control_times(path))
            return cost
        data = json.loads(path.read_text())
        if "samples" not in data:
            raise ValueError(f"{path}: not a sweep file (no 'samples'); pass a step trace (.jsonl) or the "
                             f"profile cache's JSON")
        return cls.fit([StepSample(**s) for s in data["samples"]], f"profile sweep {path}")

    def validate_ms(self, q: np.ndarray, kv: np.ndarray) -> float:
        q, kv = np.asarray(q, dtype=np.float64), np.asarray(kv, dtype=np.float64)
        return float(piecewise(q.sum(), self.q_knots, self.q_ms)) + self.b2 * float(q @ kv)

    def draft_ms(self, n: int, kv: np.ndarray, steps: int = 1) -> float:
        return float(piecewise(n, self.n_knots, self.h_ms) + steps * piecewise(n, self.n_knots, self.g_ms))

    def other_ms(self, n: int, emitted: int) -> float:
        return float(piecewise(n, self.o_knots, self.a_ms) + (emitted - n) * piecewise(n, self.o_knots, self.c_ms))

    def describe(self) -> str:
        return self.source


class CostWorkers:
    """The worker group's timing interface (cluster/engine/sweep.py calls it) answered by
    a cost model: the startup sweep, simulated, on the same grid the engine measures."""

    def __init__(self, cost):
        self.cost = cost

    def validate_ms(self, n: int, q: int, ctx: int, runs: int) -> float:
        return self.cost.validate_ms(np.full(n, q), np.full(n, ctx))

    def draft_ms(self, n: int, ctx: int, steps: int, runs: int, catchup: int = 0) -> float:
        """(catchup: the cost models price no catch-up: a simulated step never stands down a row's draft)"""
        return self.cost.draft_ms(n, np.full(n, ctx), steps)
