"""bench.json -> the Markdown table and the PNG (throughput, acceptance, verified drafts)."""
from __future__ import annotations

from pathlib import Path

COLUMNS = [("name", "arm"), ("batch", "batch"), ("tok_per_s", "tok/s"), ("acceptance_length", "accept len"),
           ("acceptance_rate", "accept rate"), ("verified_per_seq_step", "verified/seq-step"),
           ("draft_ms_per_step", "draft ms/step"), ("validate_ms_per_step", "validate ms/step"),
           ("dispatch_ms_per_step", "dispatch ms/step"), ("tpot_ms", "TPOT ms")]


def markdown(result: dict) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " | vs best static/nospec |",
             "|" + "---|" * (len(COLUMNS) + 1)]
    for arm in result["arms"]:
        best = _best_baseline(result["arms"], arm["batch"])
        ratio = f"{arm['tok_per_s'] / best:.2f}x" if best else ""
        cells = [str(arm[key]) for key, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + f" | {ratio} |")
    notes = [f"- outputs identical to the target-only greedy reference: **{result['outputs_identical']}**"]
    notes += [f"- {a['name']}: {a['note']}" for a in result["arms"] if a.get("note")]
    if result.get("time_model"):
        tm = result["time_model"]
        notes.append(f"- validate-time model at the end: version {tm['version']}, MAPE "
                     f"{100 * tm['mape']:.1f}%" if tm.get("mape") is not None else
                     f"- validate-time model at the end: version {tm['version']}")
    notes.append(f"- machine: {result.get('machine', '')}")
    return "\n".join(lines + [""] + notes) + "\n"


def _best_baseline(arms: list[dict], batch: int) -> float:
    vals = [a["tok_per_s"] for a in arms if a["batch"] == batch and a["policy"] in ("nospec", "static")]
    return max(vals) if vals else 0.0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in result["arms"] if a["policy"] in ("nospec", "static", "adaptive", "oracle")]
    batches = sorted({a["batch"] for a in arms})
    policies = ["static", "adaptive", "oracle"]
    colors = {"static": "tab:blue", "adaptive": "tab:green", "oracle": "tab:gray"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ks = sorted({a["k"] for a in arms if a["policy"] != "nospec"})
    width = 0.8 / max(len(policies), 1)
    for ax, key, title in ((axes[0], "tok_per_s", "throughput (tok/s), relative to nospec"),
                           (axes[1], "acceptance_rate", "acceptance rate (accepted / verified)"),
                           (axes[2], "verified_per_seq_step", "verified drafts per sequence-step")):
        labels = [f"k={k}\nb={b}" for b in batches for k in ks]
        for pi, pol in enumerate(policies):
            vals = []
            for b in batches:
                base = next((a["tok_per_s"] for a in arms if a["policy"] == "nospec" and a["batch"] == b), None)
                for k in ks:
                    arm = next((a for a in arms if a["policy"] == pol and a["k"] == k and a["batch"] == b), None)
                    v = arm[key] if arm else 0.0
                    vals.append(v / base if key == "tok_per_s" and base else v)
            xs = [i + (pi - 1) * width for i in range(len(labels))]
            ax.bar(xs, vals, width, label=pol, color=colors[pol])
        if key == "tok_per_s":
            ax.axhline(1.0, color="k", lw=0.8, ls="--", label="nospec")
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
