"""`adaspec profile`: the startup sweep of validate and draft times, the fit, and its plot.

    adaspec profile --config yamls/tiny.yaml --set parallel.tp_size=1 --out out/profile

The sweep times validate forwards over a grid of (sequences, q per sequence 1..k+1,
context length) and draft steps over the number of sequences; the fit is saved keyed by
(model, TP size, device, dtype) so a restart skips the sweep.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cluster.common import add_config_args, config_from_args
from cluster.config import Config
from controller.registry import ProfileRegistry, StepSample
from controller.time_model import FitReport, TimeModel

log = logging.getLogger("adaspec.profile")
GRID_SEQS = (1, 4, 16, 32)
GRID_CTX = (64, 384)
RUNS = 5


CACHE_FORMAT = 2  # bump when the step's cost changes (engine code) or the sweep's shape does


def profile_key(cfg: Config) -> str:
    """(model, TP size, device, dtype): the weights file's size and mtime stand for the model."""
    target = Path(cfg.model.target).resolve()
    stamp = [(str(p), p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(target.glob("*.safetensors"))]
    proposer = cfg.model.mtp if cfg.speculative.method == "mtp" else cfg.model.draft
    raw = json.dumps([CACHE_FORMAT, str(target), stamp, str(Path(proposer).resolve()), cfg.speculative.method,
                      cfg.parallel.tp_size, cfg.parallel.device, cfg.model.dtype])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def cache_path(cfg: Config) -> Path:
    return Path(cfg.speculative.adaptive.profile_cache).expanduser() / f"{profile_key(cfg)}.json"


def sweep(workers, cfg: Config, progress: bool = True) -> list[StepSample]:
    """Measure the grid on the worker group (all ranks together)."""
    k = cfg.speculative.num_speculative_tokens
    budget = cfg.cache.num_blocks * cfg.cache.block_size
    points = [(n, q, ctx) for n in GRID_SEQS for ctx in GRID_CTX for q in range(1, k + 2)
              if n * (ctx + q + cfg.cache.block_size) <= budget]
    samples = []
    for n, q, ctx in tqdm(points, desc="profile validate", disable=not progress, mininterval=2):
        ms = workers.call("profile", "validate", n, q, ctx, RUNS)[0]
        samples.append(StepSample(n, n * q, n * q * ctx, ms, 0, 0.0))
    if cfg.speculative.enabled:
        for n in tqdm(GRID_SEQS, desc="profile draft", disable=not progress, mininterval=2):
            if n * (GRID_CTX[0] + 2 + cfg.cache.block_size) <= budget:
                ms = workers.call("profile", "draft", n, 0, GRID_CTX[0], RUNS)[0]
                samples.append(StepSample(n, 0, 0, 0.0, 1, ms))
    return samples


def fit_samples(samples: list[StepSample]) -> tuple[ProfileRegistry, FitReport]:
    registry = ProfileRegistry()
    return registry, registry.seed(samples)


def load_or_profile(workers, cfg: Config, progress: bool = True) -> tuple[TimeModel, list[StepSample]]:
    """The cached fit for this (model, TP, device), or a fresh sweep (then cached)."""
    path = cache_path(cfg)
    if path.is_file():
        data = json.loads(path.read_text())
        samples = [StepSample(**s) for s in data["samples"]]
        return fit_samples(samples)[1].model, samples  # refit: the model's form may be newer than the file
    samples = sweep(workers, cfg, progress)
    _, report = fit_samples(samples)
    log.warning("time model fit: MAE %.3f ms, MAPE %.1f%% over %d points", report.mae_ms, 100 * report.mape,
                report.samples)
    save(path, report, samples)
    return report.model, samples


def save(path: Path, report: FitReport, samples: list[StepSample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": asdict(report.model), "mae_ms": report.mae_ms, "mape": report.mape,
                                "samples": [asdict(s) for s in samples]}, indent=1))


def plot(samples: list[StepSample], model: TimeModel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    val = [s for s in samples if s.q_tokens > 0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    measured = np.array([s.validate_ms for s in val])
    predicted = np.array([model.validate_ms_from(s.q_tokens, s.kv_tokens) for s in val])
    sc = ax1.scatter(measured, predicted, c=[s.q_tokens for s in val], cmap="viridis", s=18)
    top = max(measured.max(), predicted.max()) * 1.05
    ax1.plot([0, top], [0, top], "k--", lw=0.8)
    ax1.set(xlabel="measured validate ms", ylabel="predicted validate ms", title="validate time: measured vs fit")
    fig.colorbar(sc, ax=ax1, label="sum of q (tokens validated)")
    for n in sorted({s.num_seqs for s in val}):
        pts = sorted((s.q_tokens // s.num_seqs, s.validate_ms) for s in val if s.num_seqs == n
                     and s.kv_tokens // max(s.q_tokens, 1) == GRID_CTX[0])
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=f"{n} seqs")
    ax2.set(xlabel="q per sequence (kept drafts + 1)", ylabel="validate ms",
            title=f"validate time vs kept tokens (context {GRID_CTX[0]})")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec profile", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--out", default="out/profile", help="directory for profile.json and profile.png")
    return p


def run(args: argparse.Namespace) -> int:
    from cluster.common import open_engine

    args.overrides = list(args.overrides) + ["speculative.adaptive.profile_on_start=false"]  # the sweep runs below
    cfg = config_from_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open_engine(args, cfg) as engine:
        samples = sweep(engine.workers, cfg)
    _, report = fit_samples(samples)
    save(out / "profile.json", report, samples)
    save(cache_path(cfg), report, samples)
    plot(samples, report.model, out / "profile.png")
    m = report.model
    print(f"T_val = {m.b0:.3f} + {m.b1:.4f} * sum q + {m.b2:.2e} * sum q*kv  ms   (MAE {report.mae_ms:.3f} ms, "
          f"MAPE {100 * report.mape:.1f}% over the {report.samples} of {sum(s.q_tokens > 0 for s in samples)} "
          f"points kept)")
    print(f"T_draft = {m.d0:.3f} + {m.d1:.4f} * n  ms per draft step")
    print(f"wrote {out / 'profile.json'} and {out / 'profile.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
