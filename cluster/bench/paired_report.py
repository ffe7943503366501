"""bench-paired's report: paired.md (each arm's tok/s and each comparison's ratio per rate) and paired.png."""
from __future__ import annotations

import math
from pathlib import Path


def _cell(r: dict) -> str:
    return f"{r['median']:.4f} [{r['interval'][0]:.4f}, {r['interval'][1]:.4f}]"


def rate_label(frac: float) -> str:
    return f"{frac:.0%}" if math.isfinite(frac) else "all at once"


def markdown(result: dict) -> str:
    arms, points = result["arms"], result["points"]
    lines = [f"Output tok/s on each engine's own clock, the engines stepped in turn ({result['rounds']} rounds a "
             f"rate, {result['requests']} requests a round, after {result['warm_rounds']} warm-up round(s) at each "
             f"of {result['warm_rates']} of saturation; saturation {result['saturation_rps']} req/s):", "",
             "| of saturation | " + " | ".join(f"{a} tok/s" for a in arms) + " |",
             "|---|" + "---|" * len(arms)]
    lines += [f"| {rate_label(p['rate_fraction'])} | " + " | ".join(str(t) for t in p["tok_s"]) + " |" for p in points]
    names = [f"{r['arm']} / {r['over']}" for r in points[0]["ratios"]] if points else []
    best = points and "over_best_fixed" in points[0]
    if best:
        names += [f"{r['arm']} / best fixed" for r in points[0]["over_best_fixed"]]
    pairs = "each pair of arms stepped on its own" if result.get("schedule") == "pairs" else "all arms stepped together"
    lines += ["", f"Per-round ratios ({pairs}): median [95% interval]" +
              (", and each adaptive arm over the fixed arm it compares worst with (best fixed, named)" if best else "")
              + ":", "", "| of saturation | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for p in points:
        cells = [_cell(r) for r in p["ratios"]] + [f"{_cell(r)} ({r['over']})" for r in p.get("over_best_fixed", [])]
        lines.append(f"| {rate_label(p['rate_fraction'])} | " + " | ".join(cells) + " |")
    if points and "drafting" in points[0]:
        lines += ["", "Decode steps that drafted, of every decode step, and their draft forwards' time (each arm's "
                  "engines, the measured rounds):", "", "| of saturation | " + " | ".join(arms) + " |",
                  "|---|" + "---|" * len(arms)]
        for p in points:
            cells = [f"{d['drafting_steps']:,} / {d['decode_steps']:,} ({d['draft_ms']:,.0f} ms)"
                     for d in (p["drafting"][a] for a in arms)]
            lines.append(f"| {rate_label(p['rate_fraction'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    x = list(range(len(pts)))  # one place per rate, named below (`inf`, every request at once, has no place on a scale)
    series = [(f"{r['arm']} / {r['over']}", i, "ratios") for i, r in enumerate(pts[0]["ratios"])]
    series += [(f"{r['arm']} / best fixed", i, "over_best_fixed")
               for i, r in enumerate(pts[0].get("over_best_fixed", []))]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.axhline(1.0, color="grey", lw=0.8)
    for j, (label, i, key) in enumerate(series):
        rs = [p[key][i] for p in pts]
        shift = [v + 0.06 * (j - (len(series) - 1) / 2) for v in x]  # side by side, not on top of each other
        ax.errorbar(shift, [r["median"] for r in rs], yerr=[[r["median"] - r["interval"][0] for r in rs],
                                                             [r["interval"][1] - r["median"] for r in rs]],
                    fmt="o-" if key == "ratios" else "s--", capsize=3, ms=4, label=label,
                    lw=2 if key == "over_best_fixed" else 1)
    ax.set_xticks(x, [rate_label(p["rate_fraction"]) for p in pts])
    ax.set_xlim(-0.5, len(pts) - 0.5)
    ax.set_xlabel("request rate, of saturation")
    ax.set_ylabel("output tok/s ratio (median, 95% interval)")
    ax.set_title("engines stepped in turn", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
