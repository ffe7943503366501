"""`adaspec bench-controller`: the speculation controller's own time per step, alone.

    adaspec bench-controller --batch-sizes 1,8,32,256 --k 7 --out docs/bench-controller

Drives one SpecPolicy, with the compiled kernels where they load, through adaptive steps in
the runner's order (workers/runner.py: begin_step, the early stop after each draft step,
keep, end_step) and times each part, with no model: a time model where drafting pays at
every batch size (validation's fixed cost dominates, as for a large model on an
accelerator), draft top probabilities drawn from Beta(4, 2) (mean 0.67), each verified draft
accepted with its top probability. Between two calls it streams --stream-mb of memory, as
a forward pass would (in the engine the controller runs right after one, its code and data
out of the caches: 3x its warm time). The first third of the steps (the calibrators' cold
start) is left out. Writes controller.json, controller.md and controller.png.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cluster.bench.results import write_report
from controller.config import AdaptiveConfig, SpeculativeConfig
from controller.policy import SpecPolicy
from controller.time_model import TimeModel

PARTS = ("begin", "early_stop", "keep", "end", "total")
TIME_MODEL = TimeModel(version=1, b0=20.0, b1=0.004, b2=1e-6, d0=1.0, d1=0.004, o0=0.3, o1=0.001)


def run_batch(n: int, k: int, steps: int, stream_mb: float, seed: int = 0, compiled=None) -> dict:
    """Per part, its time in ms at each measured step, and each step's draft steps."""
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=k, adaptive=AdaptiveConfig(enabled=True)), compiled)
    policy.install(TIME_MODEL)
    rng = np.random.default_rng(seed)
    junk = np.ones(max(int(stream_mb * (1 << 20)) // 8, 1))
    kv = rng.integers(100, 800, n)
    times = {p: [] for p in PARTS}
    drafts = []
    clock = time.perf_counter
    for s in tqdm(range(steps), desc=f"controller at batch {n}", mininterval=2, leave=False):
        kv_list = (kv + 3 * s).tolist()
        junk += 1.0  # a forward pass's worth of memory through the caches
        t0 = clock()
        step = policy.begin_step("adaptive", kv_list, [k] * n, TIME_MODEL.version, k)
        begin, stops, keep_ms, m = clock() - t0, 0.0, 0.0, 0
        if step.budget:
            rows = list(range(n)) if step.rows is None else step.rows
            top, margin = np.zeros((step.budget, len(rows))), np.zeros((step.budget, len(rows)))
            tokens = np.zeros((step.budget, len(rows)), dtype=np.int64)
            t0 = clock()
            more = step.early_stop(top, margin, tokens)
            stops += clock() - t0
            for j in range(step.budget):
                junk += 1.0  # a draft forward
                m = j + 1
                top[j] = rng.beta(4.0, 2.0, len(rows))
                margin[j] = top[j] * rng.uniform(0.3, 1.0, len(rows))
                if j == step.budget - 1:
                    break
                if more is not None:
                    t0 = clock()
                    go = more(m)
                    stops += clock() - t0
                    if not go:
                        break
            full_top, full_margin = np.zeros((n, m)), np.zeros((n, m))
            full_top[rows], full_margin[rows] = top[:m].T, margin[:m].T  # DraftBlock.placed
            junk += 1.0  # the target's forward
            t0 = clock()
            keep = step.keep(full_top, full_top, full_margin, np.zeros((n, m), dtype=np.int64))
            keep_ms = clock() - t0
            hits = rng.random((n, m)) < full_top
            accepted = [int(np.argmin(np.append(hits[i, :c], False))) for i, c in enumerate(keep)]
            t0 = clock()
            policy.end_step(step, full_top, full_margin, keep, accepted)
        else:
            junk += 1.0
            t0 = clock()
            policy.end_plain_step(step)
        end = clock() - t0
        if s >= steps // 3:
            for part, value in zip(PARTS, (begin, stops, keep_ms, end, begin + stops + keep_ms + end)):
                times[part].append(value * 1e3)
            drafts.append(m)
    return {"times": {p: np.array(v) for p, v in times.items()}, "drafts": np.array(drafts)}


def summary(n: int, got: dict) -> dict:
    out = {"batch": n, "steps": len(got["drafts"]), "draft_steps_mean": round(float(got["drafts"].mean()), 3)}
    for part, v in got["times"].items():
        out[part] = {"median_ms": round(float(np.median(v)), 4), "mean_ms": round(float(v.mean()), 4)}
    return out


def markdown(result: dict) -> str:
    lines = [f"Controller time per adaptive step, k = {result['k']}, {result['steps']} steps a batch size "
             f"(the first third left out), {result['stream_mb']:g} MB streamed between calls; "
             f"compiled: {result['compiled']}. Median / mean, ms.", "",
             "| batch | draft steps | " + " | ".join(PARTS) + " |", "|---" * (len(PARTS) + 2) + "|"]
    for row in result["batches"]:
        cells = [f"{row[p]['median_ms']:.3f} / {row[p]['mean_ms']:.3f}" for p in PARTS]
        lines.append(f"| {row['batch']} | {row['draft_steps_mean']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["batches"]
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 3, 3.4))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for part in PARTS[:-1]:
        values = np.array([r[part]["mean_ms"] for r in rows])
        ax.bar(x, values, 0.6, bottom=bottom, label=part)
        bottom += values
    ax.plot(x, [r["total"]["median_ms"] for r in rows], "kD", label="total, median")
    ax.set_xticks(x, [str(r["batch"]) for r in rows])
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per step (mean, stacked)")
    ax.set_title(f"controller time per adaptive step, k = {result['k']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec bench-controller", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32,256", help="comma-separated batch sizes")
    p.add_argument("--k", type=int, default=7, help="drafts a step may make")
    p.add_argument("--steps", type=int, default=900, help="steps per batch size (the first third left out)")
    p.add_argument("--stream-mb", type=float, default=16.0, help="memory streamed between calls (0: warm caches)")
    p.add_argument("--python", action="store_true", help="the Python controller, without the compiled kernels")
    p.add_argument("--out", default="out/bench-controller", help="directory for controller.json, .md and .png")
    p.add_argument("--log-level", default="WARNING")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes {args.batch_sizes!r}: expected comma-separated integers") from None
    if not batches or min(batches) < 1 or args.k < 1 or args.steps < 3 or args.stream_mb < 0:
        raise ValueError("--batch-sizes, --k and --steps must be positive (--steps at least 3), --stream-mb >= 0")
    compiled = None
    if not args.python:
        from models import kernels

        compiled = kernels.controller_ops()
    rows = [summary(n, run_batch(n, args.k, args.steps, args.stream_mb, compiled=compiled)) for n in batches]
    result = {"k": args.k, "steps": args.steps, "stream_mb": args.stream_mb, "compiled": compiled is not None,
              "time_model": TIME_MODEL.__dict__, "batches": rows}
    table = markdown(result)
    write_report(Path(args.out), "controller", result, table)
    plot(result, Path(args.out) / "controller.png")
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
