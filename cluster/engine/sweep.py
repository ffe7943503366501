"""The startup sweep: validate and draft step times over a grid, fitted into the first
validate-time model, and cached on disk.

The grid times validate forwards over (sequences, q per sequence 1..k+1, context length)
and a decode step's draft positions (one and k of them, after a catch-up of SWEEP_CATCHUP
tokens per sequence) over sequences and context length, and one draft position after the long
catch-up of a row that stood down (SWEEP_LONG_CATCHUP, one sequence, as a stand-down probe's):
what the first model prices a catch-up token at (TimeModel.catchup_ms), which the budget
charges a switch into drafting and a stand-down probe's back-off its price. Without them a new
engine priced neither until its own steps had measured it, and its first rounds' stand-down
probes backed off as if they had cost a fifth of a plain step (197 catch-up tokens priced
0.26 of one, where the sweep's price makes them 2.8).

A cache file is found by the checkpoints, the TP size and the device; it stores everything
its timings depend on (`identity`), and a file whose identity differs from this run's is
swept again, with a log line naming what changed. A stale file can never drive the decisions
silently.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from cluster.config import Config
from cluster.engine.executor import WorkerGroup
from controller.catchup import SWEEP_CATCHUP
from controller.registry import ProfileRegistry
from controller.samples import StepSample
from controller.time_model import FitReport, TimeModel

log = logging.getLogger("adaspec.sweep")
GRID_SEQS_STEP = 4  # sequences: 1, 4, 16, ... up to engine.max_num_seqs (which is swept too)
GRID_CTX = (64, 384)
SWEEP_LONG_CATCHUP = (32, 64, 128, 256)  # a row's catch-up tokens, timed at the longest context of GRID_CTX
RUNS = 5
CACHE_FORMAT = 6  # the file's layout and the grid's shape
CODE_PACKAGES = ("models", "workers")  # the code whose speed the timings measure
REPO_ROOT = Path(__file__).resolve().parents[2]


def identity(cfg: Config) -> dict:
    """Everything the sweep's timings depend on."""
    spec = cfg.speculative
    proposer = (cfg.model.mtp if spec.method == "mtp" else cfg.model.draft) if spec.enabled else None
    return {"format": CACHE_FORMAT, "target": checkpoint_stamp(cfg.model.target),
            "proposer": checkpoint_stamp(proposer) if proposer else None,
            "method": spec.method if spec.enabled else None, "draft_weights": spec.draft_weights,
            "tp_size": cfg.parallel.tp_size,
            "device": device_name(cfg.parallel.device), "dtype": cfg.model.dtype,
            "k": spec.num_speculative_tokens, "block_size": cfg.cache.block_size,
            "threads": cfg.parallel.threads(), "max_num_seqs": cfg.engine.max_num_seqs, "code": code_fingerprint()}


def checkpoint_stamp(path: str) -> list:
    """The checkpoint's files by name, size and modification time (hashing gigabytes of
    weights at every start would cost more than it protects)."""
    root = Path(path).resolve()
    return [str(root)] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(root.glob("*"))
                          if p.suffix in (".safetensors", ".json")]


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
    if device == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine()
    return device


def code_fingerprint() -> str:
    """Hash of the model and worker code: a change to either may change every timing."""
    h = hashlib.sha256()
    for package in CODE_PACKAGES:
        for f in sorted(p for p in (REPO_ROOT / package).rglob("*") if p.suffix in (".py", ".cpp", ".h")):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def cache_path(cfg: Config) -> Path:
    """One file per (checkpoints, TP size, device kind); what else it depends on is checked inside."""
    spec = cfg.speculative
    proposer = (cfg.model.mtp if spec.method == "mtp" else cfg.model.draft) if spec.enabled else ""
    where = json.dumps([str(Path(cfg.model.target).resolve()), str(Path(proposer).resolve()) if proposer else "",
                        cfg.parallel.tp_size, cfg.parallel.device])
    name = hashlib.sha256(where.encode()).hexdigest()[:16]
    return Path(cfg.speculative.adaptive.profile_cache).expanduser() / f"{name}.json"


def grid_seqs(max_num_seqs: int) -> list[int]:
    """Batch sizes the sweep times: powers of GRID_SEQS_STEP up to the engine's largest
    batch, and that batch (a model fitted only below it extrapolates where it matters)."""
    seqs, n = [], 1
    while n < max_num_seqs:
        seqs.append(n)
        n *= GRID_SEQS_STEP
    return seqs + [max_num_seqs]


def sweep(workers: WorkerGroup, cfg: Config, progress: bool = True) -> list[StepSample]:
    """Measure the grid on the worker group (all ranks together)."""
    k = cfg.speculative.num_speculative_tokens
    budget = cfg.cache.num_blocks * cfg.cache.block_size
    seqs = grid_seqs(cfg.engine.max_num_seqs)
    points = [(n, q, ctx) for n in seqs for ctx in GRID_CTX for q in range(1, k + 2)
              if n * (ctx + q + cfg.cache.block_size) <= budget]
    samples = []
    for n, q, ctx in tqdm(points, desc="sweep validate", disable=not progress, mininterval=2):
        samples.append(StepSample(n, n * q, n * q * ctx, workers.validate_ms(n, q, ctx, RUNS), 0, 0.0))
    if cfg.speculative.enabled:
        # one draft position and k of them: the first's extra (the catch-up) and the step after it
        drafts = [(n, ctx, m) for n in seqs for ctx in GRID_CTX for m in sorted({1, max(k, 1)})
                  if n * (ctx + m + 1 + cfg.cache.block_size) <= budget]
        for n, ctx, m in tqdm(drafts, desc="sweep draft", disable=not progress, mininterval=2):
            samples.append(StepSample(n, 0, 0, 0.0, m, workers.draft_ms(n, ctx, m, RUNS),
                                      catchup_tokens=n * SWEEP_CATCHUP))
        ctx = GRID_CTX[-1]
        long = [c for c in SWEEP_LONG_CATCHUP if c < ctx and ctx + 2 + cfg.cache.block_size <= budget]
        for c in tqdm(long, desc="sweep catch-up", disable=not progress, mininterval=2):
            samples.append(StepSample(1, 0, 0, 0.0, 1, workers.draft_ms(1, ctx, 1, RUNS, c), catchup_tokens=c))
    return samples


def fit_samples(samples: list[StepSample], kind: str = "linear") -> FitReport:
    return ProfileRegistry(kind=kind).seed(samples)


def load_or_sweep(workers: WorkerGroup, cfg: Config, progress: bool = True) -> tuple[TimeModel, list[StepSample]]:
    """The cached sweep if it was measured under this run's identity, else a fresh one
    (then cached). Either way the model is fitted anew: the fit may be newer than the file."""
    path, want = cache_path(cfg), identity(cfg)
    if path.is_file():
        stale = stale_fields(json.loads(path.read_text()), want)
        if not stale:
            samples = [StepSample(**s) for s in json.loads(path.read_text())["samples"]]
            return fit_samples(samples, cfg.speculative.adaptive.time_model).model, samples
        log.warning("time-model cache %s was measured with another %s: sweeping again", path, ", ".join(stale))
    samples = sweep(workers, cfg, progress)
    report = fit_samples(samples, cfg.speculative.adaptive.time_model)
    log.warning("time model fit: MAE %.3f ms, MAPE %.1f%% over %d points", report.mae_ms, 100 * report.mape,
                report.samples)
    save(path, report, samples, want)
    return report.model, samples


def stale_fields(data: dict, want: dict) -> list[str]:
    have = data.get("identity") or {}
    return [key for key in want if have.get(key) != want[key]]


def save(path: Path, report: FitReport, samples: list[StepSample], ident: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"identity": ident, "model": asdict(report.model), "mae_ms": report.mae_ms,
                                "mape": report.mape, "samples": [s._asdict() for s in samples]}, indent=1))
