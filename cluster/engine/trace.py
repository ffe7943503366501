"""Step traces: one JSON line per decode step, for evaluating acceptance estimators
offline and as the input of a simulator.

    adaspec bench --config yamls/bench.yaml --record-trace out/trace.jsonl
    adaspec serve --set engine.trace_path=out/trace.jsonl

A line (n sequences in the step, m draft positions drafted, m <= k):

    label                  who recorded it (the benchmark arm, or engine.trace_label)
    step, mode, version    the plan's step index, speculation mode (static | adaptive |
                           oracle) and time-model version
    batch, probe           n, and whether this was an adaptive probe step
    draft_steps            m: draft forwards run (the budget, or fewer after an early stop)
    catchup                tokens the first draft forward caught up on (a prompt, or the tokens of
                           steps that drafted nothing, make it long)
    draft_seqs             sequences that drafted (all of them, or a probe's explored rows alone)
    draft_ms, validate_ms  measured on rank 0; predicted_validate_ms and predicted_draft_ms are
                           what the time model in force predicted for them (the draft: h(n) +
                           m g(n) for its n drafting sequences, no catch-up past a steady step's)
    control_ms             rank 0's time in speculation control (budget, early stop, keep,
                           calibration), outside draft_ms and validate_ms
    step_ms                the step's wall time on the driver
    gap_ms                 from the end of the engine's previous step to this one's start (a server
                           loop's work between steps, or its idle wait; 0 for the first)
    t                      the step's start, seconds since the epoch (time.time(): lines up a
                           server's steps with its clients' requests, and tells idle time apart)
    seq[n]                 the engine's id of each sequence (stable over its steps)
    kv[n]                  context length of each sequence before the step
    num_spec[n]            drafts each sequence could verify
    top_prob[n][m]         the draft's top probability at each position
    margin[n][m]           top-1 minus top-2 probability
    entropy[n][m]          entropy of the draft distribution (nats)
    keep[n]                drafts sent to validation
    accepted[n]            of those, accepted (position j of sequence i was accepted iff
                           j < accepted[i]; positions >= keep[i] were not verified)

Probabilities are rounded to 4 decimals. `read_trace` also reads a gzipped trace (.jsonl.gz).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator

from workers.plan import StepPlan, StepStats


class TraceWriter:
    def __init__(self, path: str | Path, label: str = ""):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.label = label
        self._file = self.path.open("a", buffering=1)  # line-buffered: a killed server loses nothing

    def write(self, plan: StepPlan, stats: StepStats, step_ms: float, gap_ms: float = 0.0,
              started: float = 0.0) -> None:
        t = stats.trace
        if t is None:
            return
        line = {"label": self.label, "step": plan.step, "mode": plan.mode, "version": plan.time_model_version,
                "batch": stats.num_seqs, "probe": t.probe, "draft_steps": stats.draft_steps,
                "catchup": stats.catchup_tokens, "draft_seqs": stats.draft_seqs,
                "draft_ms": round(stats.draft_ms, 4), "validate_ms": round(stats.validate_ms, 4),
                "control_ms": round(stats.control_ms, 4),
                "predicted_validate_ms": round(stats.predicted_validate_ms, 4),
                "predicted_draft_ms": round(stats.predicted_draft_ms, 4), "step_ms": round(step_ms, 4),
                "gap_ms": round(gap_ms, 4), "t": round(started, 4),
                "seq": [p.seq_id for p in plan.seqs], "kv": t.kv, "num_spec": t.num_spec, "top_prob": t.top_prob,
                "margin": t.margin,
                "entropy": t.entropy, "keep": t.keep, "accepted": t.accepted}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_trace(path: str | Path) -> Iterator[dict]:
    """A trace's steps; a path ending in .gz is read through gzip (how the repository keeps them)."""
    path = Path(path)
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
