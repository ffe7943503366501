"""bench.json -> the Markdown tables and the PNG (median tok/s with intervals, per batch)."""
from __future__ import annotations

from pathlib import Path

COLUMNS = [("decode_tpot_ms", "decode TPOT ms"), ("acceptance_length", "accept len"),
           ("acceptance_rate", "accept rate"), ("verified_per_seq_step", "verified/seq-step"),
           ("draft_ms_per_step", "draft ms/step"), ("validate_ms_per_step", "validate ms/step"),
           ("control_ms_per_step", "control ms/step")]
COLORS = {"nospec": "black", "static": "tab:blue", "adaptive": "tab:green", "oracle": "tab:gray",
          "hf-target": "tab:purple", "hf-assisted": "tab:purple", "vllm-nospec": "tab:red", "vllm-draft": "tab:red"}


def _interval(ci: list[float]) -> str:
    return f"[{ci[0]:g}, {ci[1]:g}]"


def markdown(result: dict) -> str:
    lines = ["| arm | batch | tok/s (median) | 95% interval | " + " | ".join(h for _, h in COLUMNS) + " | identical |",
             "|" + "---|" * (len(COLUMNS) + 5)]
    for a in result["arms"]:
        cells = ["" if a.get(key) is None else str(a[key]) for key, _ in COLUMNS]
        same = "yes" if a["outputs_identical"] else f"no (from position {a.get('first_difference')})"
        lines.append(f"| {a['name']} | {a['batch']} | {a['tok_per_s']} | {_interval(a['tok_per_s_ci'])} | "
                     + " | ".join(cells) + f" | {same} |")
    lines += ["", "| ratio | batch | median | 95% interval | |", "|---|---|---|---|---|"]
    for r in result["ratios"]:
        verdict = "no difference" if r["no_difference"] else ""
        lines.append(f"| {r['arm']} / {r['to']} | {r['batch']} | {r['median']:.3f} | {_interval(r['ci'])} | {verdict} |")
    notes = [f"- {result['rounds']} interleaved rounds per batch, every arm at least {result['min_round_s']} s per "
             f"round (waves per round by batch: {result['waves_per_round']}); median over rounds, 95% bootstrap "
             f"interval; a ratio is the median of per-round ratios",
             f"- control (nospec-again / nospec) interval contains 1.0 at every batch: **{result['control_ok']}**",
             f"- our outputs identical to the target-only greedy reference: **{result['engine_outputs_identical']}**"]
    for a in result["arms"]:
        if not a["outputs_identical"]:
            notes.append(f"- {a['name']}: {a.get('differing_outputs')} outputs differ from the reference, the first "
                         f"at position {a.get('first_difference')} (greedy ties broken in another floating-point order)")
    notes += [f"- {a['name']}: {a['note']}" for a in result["arms"] if a.get("note") and a["batch"] == _first_batch(result)]
    vllm = result.get("vllm") or {}
    notes.append(f"- vLLM peer: {vllm['skipped']}" if "skipped" in vllm else
                 f"- vLLM peer: vllm {vllm.get('version')}, {vllm.get('settings')}; start-up s {vllm.get('start_s')}")
    tm = result.get("time_model")
    if tm:
        mape = f", MAPE {100 * tm['mape']:.1f}%" if tm.get("mape") is not None else ""
        held = tm.get("held_out_mape") or {}
        held = ("; held-out MAPE (fit on every other measured step, scored on the rest): "
                + ", ".join(f"{k} {100 * v:.1f}%" for k, v in held.items())) if held else ""
        kind = f" ({tm['kind']})" if tm.get("kind") else ""
        rest = tm.get("rest_ms")
        rest = (f"; a step's rest {rest[0]:.3f} + {rest[1]:.4f} ms a token emitted "
                f"(+ {rest[2]:.3f} + {rest[3]:.4f} ms a sequence where it drafts)"
                + (f"; a drafting step's validation {rest[4]:.3f} ms dearer" if len(rest) > 4 else "")) if rest else ""
        notes.append(f"- validate-time model at the end: version {tm['version']}{kind}{mape}{held}{rest}")
    notes.append(f"- machine: {result.get('machine', '')}; the whole run took {result.get('elapsed_s')} s")
    return "\n".join(lines + [""] + notes) + "\n"


def _first_batch(result: dict) -> int:
    return min(a["batch"] for a in result["arms"])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({a["batch"] for a in result["arms"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 0.28 * max(
        sum(a["batch"] == b for a in result["arms"]) for b in batches) + 1.6), squeeze=False)
    for ax, b in zip(axes[0], batches):
        arms = [a for a in result["arms"] if a["batch"] == b]
        ys = range(len(arms))
        med = [a["tok_per_s"] for a in arms]
        err = [[m - a["tok_per_s_ci"][0] for m, a in zip(med, arms)], [a["tok_per_s_ci"][1] - m for m, a in zip(med, arms)]]
        ax.barh(list(ys), med, xerr=err, color=[COLORS.get(a["policy"], "tab:orange") for a in arms], capsize=2)
        ax.set_yticks(list(ys), [a["name"].split("@")[0] for a in arms], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"batch {b}: output tok/s (median, 95% interval)", fontsize=10)
        nospec = next((a["tok_per_s"] for a in arms if a["policy"] == "nospec"), None)
        if nospec:
            ax.axvline(nospec, color="k", lw=0.8, ls="--")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
