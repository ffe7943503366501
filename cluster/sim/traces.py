"""What a step trace (cluster/engine/trace.py) gives the simulator: a pool of draft rows
whose acceptance is fully known, the measured decode throughput of every arm, and the
measured step times as profile samples.

A draft row is one sequence in one decode step of a static arm that verified all k of
its drafts: its top probability at positions 1..k and how many were accepted (the first
rejection, or k). Only such rows say what any decision over those k drafts would have
accepted; rows of adaptive or oracle steps were cut short by their own decision.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.engine.trace import read_trace
from controller.samples import StepSample


@dataclass
class DraftPool:
    top_prob: np.ndarray  # (N, k) the draft's top probability at each position
    margin: np.ndarray  # (N, k) its margin to the second largest probability
    accepted: np.ndarray  # (N,) drafts accepted (0..k)
    starts: np.ndarray  # (S,) first row of each recorded sequence: its rows are contiguous
    sizes: np.ndarray  # (S,) rows of each recorded sequence (acceptance is correlated along a sequence)
    kv: np.ndarray  # (S,) each sequence's context at its first recorded step
    source: str

    @property
    def k(self) -> int:
        return self.top_prob.shape[1]

    def __len__(self) -> int:
        return len(self.accepted)

    def draw(self, seqs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One row of each of the recorded sequences `seqs`, uniformly among its rows."""
        return self.starts[seqs] + (rng.random(len(seqs)) * self.sizes[seqs]).astype(np.int64)


def arm_of(label: str) -> tuple[str, int] | None:
    """'static-7@b8/r0' -> ('static-7', 8); a warm-up wave or a label without a batch -> None."""
    name, _, wave = label.partition("/")
    arm, at, batch = name.partition("@b")
    if wave == "warmup" or not at or not batch.isdigit():
        return None
    return arm, int(batch)


def load_pool(path: str | Path) -> DraftPool:
    """Rows of the static steps with the most drafts in the trace, every draft verified,
    grouped by sequence (a trace without sequence ids gives one group)."""
    lines = [t for t in read_trace(path) if t["mode"] == "static" and t["draft_steps"] > 0]
    if not lines:
        raise ValueError(f"{path}: no static decode step with drafts (record a bench with a static arm: "
                         f"adaspec bench --record-trace FILE)")
    k = max(t["draft_steps"] for t in lines)
    top, margin, acc, first_kv = [], [], [], {}
    rows_of: dict = defaultdict(list)
    for t in lines:
        if t["draft_steps"] != k:
            continue
        for i in range(t["batch"]):
            if t["keep"][i] == k:
                seq = t["seq"][i] if "seq" in t else 0
                rows_of[seq].append(len(acc))
                first_kv.setdefault(seq, t["kv"][i])
                top.append(t["top_prob"][i])
                margin.append(t["margin"][i])
                acc.append(t["accepted"][i])
    if not top:
        raise ValueError(f"{path}: no sequence verified all {k} drafts of a static step")
    seqs = sorted(rows_of)
    order = np.concatenate([rows_of[s] for s in seqs])  # each sequence's rows together
    sizes = np.array([len(rows_of[s]) for s in seqs], dtype=np.int64)
    return DraftPool(np.array(top, dtype=np.float64)[order], np.array(margin, dtype=np.float64)[order],
                     np.array(acc, dtype=np.int64)[order],
                     np.cumsum(sizes) - sizes, sizes, np.array([first_kv[s] for s in seqs], dtype=np.int64), str(path))


def measured(path: str | Path) -> dict[tuple[str, int], dict]:
    """Per (arm, batch): the decode throughput the trace measured (tokens the decode steps
    emitted per second of their wall time, warm-up waves left out) and the steps behind it."""
    acc = defaultdict(lambda: {"tokens": 0, "ms": 0.0, "steps": 0})
    for t in read_trace(path):
        arm = arm_of(t.get("label", ""))
        if arm is None:
            continue
        a = acc[arm]
        a["tokens"] += sum(x + 1 for x in t["accepted"]) if t["accepted"] else t["batch"]
        a["ms"] += t["step_ms"]
        a["steps"] += 1
    return {arm: {"decode_tok_per_s": 1e3 * a["tokens"] / a["ms"], "steps": a["steps"]} for arm, a in acc.items()}


def samples(path: str | Path) -> list[StepSample]:
    """Every decode step of the trace as a profile sample (validate, draft and the rest of
    the step, as the engine records them online; the controller's own time is left out of
    the rest, see control_times)."""
    out = []
    for t in read_trace(path):
        q = [x + 1 for x in t["keep"]] if t["keep"] else [1] * t["batch"]
        emitted = sum(x + 1 for x in t["accepted"]) if t["accepted"] else t["batch"]
        other = max(t["step_ms"] - t["draft_ms"] - t["validate_ms"] - t.get("control_ms", 0.0), 1e-3)
        out.append(StepSample(t["batch"], sum(q), sum(a * b for a, b in zip(q, t["kv"])), t["validate_ms"],
                              t["draft_steps"], t["draft_ms"], other, emitted, draft_seqs=t.get("draft_seqs", 0)))
    return out


def control_times(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per policy (the arm's, from the label; else the step's mode): the batch size and
    the controller's measured time of every decode step that recorded it."""
    got: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for t in read_trace(path):
        if "control_ms" not in t:
            continue
        arm = arm_of(t.get("label", ""))
        policy = arm[0].split("-")[0] if arm else t["mode"]
        got[policy][0].append(t["batch"])
        got[policy][1].append(t["control_ms"])
    return {p: (np.array(n, dtype=np.float64), np.array(ms)) for p, (n, ms) in got.items()}


KEPT = ("label", "mode", "batch", "draft_steps", "draft_ms", "validate_ms", "control_ms", "step_ms", "seq", "kv",
        "keep", "accepted", "top_prob", "margin")  # what the simulator reads


def trim(src: str | Path, dst: str | Path) -> int:
    """Copy a trace keeping only what the simulator reads (KEPT): per-position
    probabilities and margins only on the static steps with the most drafts (the pool), the step-level
    fields everywhere (the measured throughput and profile). Returns the lines written.

        python -m cluster.sim.traces SRC DST
    """
    import json

    lines = list(read_trace(src))
    k = max((t["draft_steps"] for t in lines if t["mode"] == "static"), default=0)
    with Path(dst).open("w") as f:
        for t in lines:
            t = {key: t[key] for key in KEPT if key in t}
            if not (t["mode"] == "static" and t["draft_steps"] == k):
                t["top_prob"], t["margin"] = [], []
            f.write(json.dumps(t, separators=(",", ":")) + "\n")
    return len(lines)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m cluster.sim.traces SRC DST (trim a step trace for the simulator)")
    print(f"{trim(sys.argv[1], sys.argv[2])} lines -> {sys.argv[2]}")
