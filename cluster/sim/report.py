"""Simulated results -> bench.json's shape, the Markdown tables and the PNG."""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [("decode_tpot_ms", "decode TPOT ms"), ("acceptance_length", "accept len"),
           ("verified_per_seq_step", "verified/seq-step"), ("draft_ms_per_step", "draft ms/step"),
           ("validate_ms_per_step", "validate ms/step"), ("control_ms_per_step", "control ms/step")]


def summarise(arms: list[dict]) -> dict:
    """Per batch: nospec, the best static arm, every adaptive arm against both and against
    its oracle; and the crossover: the largest batch where some speculative arm beats plain
    decoding."""
    by_batch: dict[int, dict[str, dict]] = {}
    for a in arms:
        by_batch.setdefault(a["batch"], {})[a["name"].split("@")[0]] = a
    rows, crossover = [], {}
    for b, named in sorted(by_batch.items()):
        nospec = named.get("nospec", {}).get("tok_per_s")
        statics = [a for n, a in named.items() if n.startswith("static-")]
        best = max(statics, key=lambda a: a["tok_per_s"]) if statics else None
        for name, a in named.items():
            if name == "nospec" or not nospec:
                continue
            if a["tok_per_s"] > nospec:
                crossover[name] = b
            if not name.startswith("adaptive-"):
                continue
            oracle = named.get(name.replace("adaptive", "oracle"))
            rows.append({"batch": b, "arm": name, "tok_per_s": a["tok_per_s"], "vs_nospec": a["tok_per_s"] / nospec,
                         "best_static": best["name"].split("@")[0] if best else None,
                         "vs_best_static": a["tok_per_s"] / best["tok_per_s"] if best else None,
                         "vs_same_k_static": (a["tok_per_s"] / named[name.replace("adaptive", "static")]["tok_per_s"]
                                              if name.replace("adaptive", "static") in named else None),
                         "vs_oracle": a["tok_per_s"] / oracle["tok_per_s"] if oracle else None})
    return {"adaptive": rows, "crossover": crossover}


LOAD_COLUMNS = [("tpot_p50_ms", "TPOT p50 ms"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
                ("mean_batch", "mean batch"), ("acceptance_length", "accept len"),
                ("verified_per_seq_step", "verified/seq-step")]


def markdown_load(result: dict) -> str:
    """Poisson load: per arm and rate, throughput (prefill included) and latency."""
    lines = [f"Simulated Poisson load (trace replay through the project's own controller): trace "
             f"`{result['trace']}`, cost model: {result['cost_model']}; at most {result['max_batch']} sequences "
             f"at once, {result['num_seqs']} requests of {result['output_len']} tokens per arm and rate.", "",
             "| arm | rate req/s | tok/s | vs nospec | " + " | ".join(h for _, h in LOAD_COLUMNS) + " |",
             "|" + "---|" * (len(LOAD_COLUMNS) + 4)]
    nospec = {a["rate"]: a["tok_per_s"] for a in result["arms"] if a["policy"] == "nospec"}
    for a in result["arms"]:
        ratio = f"{a['tok_per_s'] / nospec[a['rate']]:.3f}" if a["rate"] in nospec else ""
        lines.append(f"| {a['name'].split('@')[0]} | {a['rate']:g} | {a['tok_per_s']} | {ratio} | "
                     + " | ".join(str(a.get(key, "")) for key, _ in LOAD_COLUMNS) + " |")
    return "\n".join(lines + ["", f"- {result['notes']}"]) + "\n"


def markdown(result: dict) -> str:
    if result.get("mode") == "poisson":
        return markdown_load(result)
    lines = [f"Simulated (trace replay through the project's own controller): trace `{result['trace']}`, "
             f"cost model: {result['cost_model']}.", "",
             "| arm | batch | decode tok/s | vs nospec | " + " | ".join(h for _, h in COLUMNS)
             + (" | measured tok/s | error |" if result.get("validation") else " |"),
             "|" + "---|" * (len(COLUMNS) + 4 + (2 if result.get("validation") else 0))]
    nospec = {a["batch"]: a["tok_per_s"] for a in result["arms"] if a["policy"] == "nospec"}
    measured = {(v["arm"], v["batch"]): v for v in result.get("validation") or []}
    for a in result["arms"]:
        cells = [str(a.get(key, "")) for key, _ in COLUMNS]
        ratio = f"{a['tok_per_s'] / nospec[a['batch']]:.3f}" if a["batch"] in nospec else ""
        line = f"| {a['name']} | {a['batch']} | {a['tok_per_s']} | {ratio} | " + " | ".join(cells) + " |"
        if result.get("validation"):
            v = measured.get((a["name"].split("@")[0], a["batch"]))
            line += f" {v['measured_tok_per_s']} | {100 * v['error']:+.1f}% |" if v else " | |"
        lines.append(line)
    lines += ["", "| batch | adaptive arm | tok/s | / nospec | / best static (which) | / static, same k | / oracle |",
              "|---|---|---|---|---|---|---|"]
    for r in result["summary"]["adaptive"]:
        f = (lambda x: "" if x is None else f"{x:.3f}")
        lines.append(f"| {r['batch']} | {r['arm']} | {r['tok_per_s']} | {f(r['vs_nospec'])} | "
                     f"{f(r['vs_best_static'])} ({r['best_static']}) | {f(r['vs_same_k_static'])} | {f(r['vs_oracle'])} |")
    cross = result["summary"]["crossover"]
    lines += ["", "- largest batch where the arm beats plain decoding: "
              + (", ".join(f"{k} {v}" for k, v in sorted(cross.items())) or "none")]
    if result.get("validation"):
        worst = max(abs(v["error"]) for v in result["validation"])
        lines.append(f"- against the decode throughput the trace measured, per arm and batch: largest error "
                     f"{100 * worst:.1f}%")
    lines.append(f"- {result['notes']}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    if result.get("mode") == "poisson":
        return plot_load(result, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cluster.bench.report import COLORS

    names = sorted({a["name"].split("@")[0] for a in result["arms"]})
    nospec = {a["batch"]: a["tok_per_s"] for a in result["arms"] if a["policy"] == "nospec"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = {"3": ":", "5": "--", "7": "-"}
    for name in names:
        pts = sorted((a["batch"], a["tok_per_s"]) for a in result["arms"] if a["name"].split("@")[0] == name)
        policy, _, k = name.partition("-")
        kw = dict(color=COLORS.get(policy, "tab:orange"), ls=styles.get(k, "-"), marker="o", ms=3, label=name)
        axes[0].plot([b for b, _ in pts], [t for _, t in pts], **kw)
        axes[1].plot([b for b, _ in pts], [t / nospec[b] for b, t in pts if b in nospec], **kw)
    for ax, title in zip(axes, ("decode tok/s", "relative to plain decoding")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"simulated: {result['cost_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(markdown(result))
    plot(result, out / "bench.png")


def plot_load(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cluster.bench.report import COLORS

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = {"3": ":", "5": "--", "7": "-"}
    for name in sorted({a["name"].split("@")[0] for a in result["arms"]}):
        pts = sorted((a["rate"], a["tok_per_s"], a["tpot_p50_ms"]) for a in result["arms"]
                     if a["name"].split("@")[0] == name)
        policy, _, k = name.partition("-")
        kw = dict(color=COLORS.get(policy, "tab:orange"), ls=styles.get(k, "-"), marker="o", ms=3, label=name)
        axes[0].plot([r for r, _, _ in pts], [t for _, t, _ in pts], **kw)
        axes[1].plot([r for r, _, _ in pts], [m for _, _, m in pts], **kw)
    for ax, title in zip(axes, ("output tok/s", "TPOT p50 ms")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"simulated Poisson load: {result['cost_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
