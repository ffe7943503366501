"""`adaspec profile`: the startup sweep of validate and draft times, its fit, and a plot.

    adaspec profile --config yamls/tiny.yaml --set parallel.tp_size=1 --out out/profile

Also refreshes the engine's time-model cache for this configuration (cluster/engine/sweep.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cluster.engine.sweep import GRID_CTX, cache_path, fit_samples, identity, save, sweep
from cluster.entrypoints.common import add_config_args, config_from_args
from controller.registry import ProfileRegistry
from controller.samples import StepSample
from controller.time_model import TimeModel


def describe(m: TimeModel) -> str:
    if m.kind == "table":
        f = ", ".join(f"{q:g}: {ms:.3f}" for q, ms in zip(m.q_knots, m.q_ms))
        val = f"T_val = f(sum q) + {m.b2:.2e} * sum q*kv  ms, f at sum q = {{{f}}}"
    else:
        val = f"T_val = {m.b0:.3f} + {m.b1:.4f} * sum q + {m.b2:.2e} * sum q*kv  ms"
    if m.n_knots:
        hg = ", ".join(f"{n:g}: ({h:.3f}, {g:.3f})" for n, h, g in zip(m.n_knots, m.h_ms or [m.d_first] * len(m.n_knots),
                                                                      m.n_ms))
        return f"{val}\nT_draft = h(n) + m g(n) ms for m draft steps, (h, g) at n = {{{hg}}}"
    return f"{val}\nT_draft = {m.d_first:.3f} + m ({m.d0:.3f} + {m.d1:.4f} * n)  ms for m draft steps"


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
    from cluster.entrypoints.common import open_engine

    args.overrides = list(args.overrides) + ["speculative.adaptive.profile_on_start=false"]  # the sweep runs below
    cfg = config_from_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open_engine(args, cfg) as engine:
        samples = sweep(engine.workers, cfg)
    kind = cfg.speculative.adaptive.time_model
    report = fit_samples(samples, kind)
    ident = identity(cfg)
    save(out / "profile.json", report, samples, ident)
    save(cache_path(cfg), report, samples, ident)
    plot(samples, report.model, out / "profile.png")
    print(describe(report.model))
    print(f"fit: MAE {report.mae_ms:.3f} ms, MAPE {100 * report.mape:.1f}% over the {report.samples} of "
          f"{sum(s.q_tokens > 0 for s in samples)} points kept")
    held_out = ProfileRegistry(sweep=samples).held_out_mape()
    print("held-out MAPE (fit on every other point, scored on the rest): "
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in held_out.items()))
    print(f"wrote {out / 'profile.json'} and {out / 'profile.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
