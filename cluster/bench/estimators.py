"""`adaspec estimators`: the acceptance estimators scored on a recorded step trace.

    adaspec bench --config yamls/bench.yaml --set 'bench.policies=[static]' --set 'bench.ks=[7]' \\
        --record-trace out/trace.jsonl
    adaspec estimators --trace out/trace.jsonl --out out/estimators

Replays the trace's decode steps in order (every arm's steps that verified drafts, the
reference runs and oracle steps excluded). Each estimator (controller/estimators.py, the code the engine
runs) predicts every verified draft's acceptance before it learns that step's outcome, as
in the engine. Scored on the second half of the drafts (nothing was fitted to them
beforehand): AUC (how well the estimate ranks), Brier score and log-loss (how well it is
calibrated: the decision uses the number, not only the order). Writes estimators.json and
estimators.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cluster.bench.results import write_report
from cluster.engine.trace import read_trace
from controller.estimators import Calibrator, LogisticCalibrator, outcomes

ESTIMATORS = ("top_prob", "top_prob_calibrated", "top_prob_logistic")


def replay(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per estimator: (estimates, outcomes) of every verified draft, in trace order."""
    steps = []
    for r in read_trace(path):
        # an oracle step verified the drafts that match the reference, chosen by their outcome: the
        # engine's calibrators skip it (SpecPolicy.end_step), and so does this replay
        if r["label"] != "reference" and r.get("mode") != "oracle" and r["draft_steps"] > 0 and any(r["keep"]):
            steps.append(r)
    if not steps:
        raise ValueError(f"{path}: no decode step verified any draft (record a static-k arm)")
    k = max(s["draft_steps"] for s in steps)
    bucket, logistic = Calibrator(k), LogisticCalibrator(k)
    preds: dict[str, list] = {name: [] for name in ESTIMATORS}
    labels = []
    for s in steps:
        top = np.array(s["top_prob"], dtype=np.float64).reshape(len(s["keep"]), -1)
        if "margin" not in s:
            raise ValueError(f"{path}: step {s.get('step')} has no 'margin' (a trace from an older adaspec)")
        margin = np.array(s["margin"], dtype=np.float64).reshape(top.shape)
        keep, acc = np.array(s["keep"]), np.array(s["accepted"])
        trial, hit = outcomes(top.shape[1], keep, acc)
        estimates = {"top_prob": top, "top_prob_calibrated": bucket.estimate(top),
                     "top_prob_logistic": logistic.estimate(top, margin)}
        for name in ESTIMATORS:
            preds[name].append(estimates[name][trial])
        labels.append(hit[trial])
        bucket.update(top, keep, acc)
        logistic.update(top, margin, keep, acc)
    y = np.concatenate(labels).astype(np.float64)
    return {name: (np.concatenate(p), y) for name, p in preds.items()}


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Probability that an accepted draft scores above a rejected one (ties count half)."""
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    mid_rank = (ends - (counts - 1) / 2.0)[inverse]  # 1-based average rank of each value
    pos = y.sum()
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    return float((mid_rank[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def scores(estimate: np.ndarray, y: np.ndarray) -> dict:
    p = np.clip(estimate, 1e-6, 1 - 1e-6)
    return {"auc": auc(estimate, y), "brier": float(np.mean((estimate - y) ** 2)),
            "log_loss": float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))), "drafts": int(len(y))}


def evaluate(path: Path) -> dict:
    result = {}
    for name, (estimate, y) in replay(path).items():
        half = len(y) // 2
        result[name] = scores(estimate[half:], y[half:])
    return result


def markdown(result: dict, trace: str) -> str:
    lines = ["| estimator | AUC | Brier | log-loss | held-out drafts |", "|---|---|---|---|---|"]
    best = min(result, key=lambda n: result[n]["log_loss"])
    for name, r in result.items():
        mark = " (best log-loss)" if name == best else ""
        lines.append(f"| {name}{mark} | {r['auc']:.3f} | {r['brier']:.4f} | {r['log_loss']:.4f} | {r['drafts']} |")
    return "\n".join(lines) + f"\n\nTrace: `{trace}`; scored on the second half of its verified drafts.\n"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec estimators", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="a step trace (adaspec bench --record-trace FILE)")
    p.add_argument("--out", default="out/estimators", help="directory for estimators.json and estimators.md")
    p.add_argument("--log-level", default="WARNING")
    return p


def run(args: argparse.Namespace) -> int:
    trace = Path(args.trace)
    if not trace.is_file():
        raise FileNotFoundError(f"--trace {trace}: no such file")
    result = evaluate(trace)
    table = markdown(result, str(trace))
    write_report(Path(args.out), "estimators", {"trace": str(trace), "estimators": result}, table)
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
