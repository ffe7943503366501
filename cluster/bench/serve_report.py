"""serve.json -> the Markdown table and the PNG (throughput and TPOT p50 against the
request rate, one line per arm)."""
from __future__ import annotations

from pathlib import Path


def _p(lat: dict) -> str:
    return " / ".join("" if lat[q] is None else f"{lat[q]:.1f}" for q in ("p50", "p90", "p99"))


def markdown(result: dict) -> str:
    lines = ["| arm | rate (req/s) | of saturation | output tok/s | req/s | TTFT ms p50/p90/p99 | "
             "TPOT ms p50/p90/p99 | ITL ms p50/p90/p99 | errors |", "|" + "---|" * 9]
    for arm in result["arms"]:
        for p in (p for p in result["points"] if p["arm"] == arm):
            frac = "" if p["rate_fraction"] is None else f"{100 * p['rate_fraction']:.0f}%"
            lines.append(f"| {arm} | {p['rate']} | {frac} | {p['output_tok_per_s']} | {p['request_per_s']} | "
                         f"{_p(p['ttft_ms'])} | {_p(p['tpot_ms'])} | {_p(p['itl_ms'])} | {p['errors']} |")
    lines += adaptive_table(result["points"])
    lines += clients_table(result.get("client_points") or [])
    s = result["saturation"]
    vllm = result.get("vllm") or {}
    rounds = max([len(p.get("rounds") or [1]) for p in result["points"]] or [1])
    notes = [f"- {result['requests']} held-out ShareGPT requests per point (mean max_tokens "
             f"{result['mean_max_tokens']}), greedy, EOS honoured, streamed; Poisson arrivals, seeded; "
             f"{rounds} interleaved round(s) per rate, throughput and latency percentiles their medians"
             + (f"; each of our arms on {result['replicas']} servers (processes), round j on server "
                f"j % {result['replicas']}" if result.get("replicas", 1) > 1 else ""),
             f"- saturation ({s['arm']}, every request at once): {s['request_per_s']} req/s, "
             f"{s['output_tok_per_s']} output tok/s",
             f"- our arms streamed the same greedy text as the saturation run: **{result['outputs_identical']}**; "
             f"per arm: " + ", ".join(f"{a} {'same' if v['identical'] else str(v['differing']) + ' differ'}"
                                     for a, v in result["texts_vs_base"].items()),
             f"- vLLM: {vllm['skipped']}" if "skipped" in vllm else f"- vLLM servers started in (s): {vllm['servers']}",
             f"- machine: {result['machine']}; the sweep took {result['elapsed_s']} s"]
    return "\n".join(lines + [""] + notes) + "\n"


def _ratio_text(got: tuple[float, float, float] | None, rounds: int) -> str:
    if got is None:
        return ""
    return f"{got[0]:.3f}" + (f" [{got[1]:.3f}, {got[2]:.3f}]" if rounds > 1 else "")


def adaptive_table(points: list[dict]) -> list[str]:
    """Poisson points: each adaptive arm's throughput over every fixed arm of ours (plain
    decoding, static-K) at the same rate, and over the best of them (the highest median),
    as the median over rounds of the per-round ratio, [min, max] where there were several; and
    over the best fixed arm, the 95% bootstrap interval of that median (cluster/bench/stats.py)."""
    from cluster.bench.clients import round_ratio, round_ratios
    from cluster.bench.stats import bootstrap_ci

    adaptive = sorted({p["arm"] for p in points if p["arm"].startswith("adaptive")})
    fixed = sorted({p["arm"] for p in points if p["arm"] == "nospec" or p["arm"].startswith("static")})
    if not adaptive or not fixed:
        return []
    rounds = max(len(p.get("rounds") or [1]) for p in points)
    lines = ["", f"Adaptive over the fixed arms at each rate (median over {rounds} round(s) of the per-round "
             "ratio of output tok/s, [min, max]):", "",
             "| arm | of saturation | " + " | ".join(f"/ {f}" for f in fixed) + " | / best fixed | "
             "/ best fixed: 95% interval of the median |",
             "|" + "---|" * (len(fixed) + 4)]
    for arm in adaptive:
        for p in (p for p in points if p["arm"] == arm):
            at = {q["arm"]: q for q in points if q["rate_fraction"] == p["rate_fraction"]}
            refs = [at[f] for f in fixed if f in at]
            if not refs:
                continue
            best = max(refs, key=lambda q: q["output_tok_per_s"])
            cells = [_ratio_text(round_ratio(p, at[f]), rounds) if f in at else "" for f in fixed]
            to_best = round_ratios(p, best)
            ci = "[{:.3f}, {:.3f}]".format(*bootstrap_ci(to_best)) if len(to_best) > 1 else ""
            lines.append(f"| {arm} | {100 * p['rate_fraction']:.0f}% | " + " | ".join(cells) +
                         f" | {_ratio_text(round_ratio(p, best), rounds)} ({best['arm']}) | {ci} |")
    return lines


def clients_table(points: list[dict]) -> list[str]:
    """Closed-loop points: throughput per arm and client count, with its ratio to vLLM's
    plain server and to the offline engine at the same count (median over rounds of the
    per-round ratio, [min, max] where there were several rounds)."""
    from cluster.bench.clients import round_ratio

    if not points:
        return []
    by = {(p["arm"], p["clients"]): p for p in points}

    def ratio(p: dict, arm: str) -> str:
        ref = by.get((arm, p["clients"]))
        got = None if ref is None or ref is p else round_ratio(p, ref)
        if got is None:
            return ""
        return f"{got[0]:.2f}" + (f" [{got[1]:.2f}, {got[2]:.2f}]" if len(p.get("rounds") or []) > 1 else "")

    rounds = max(len(p.get("rounds") or [1]) for p in points)
    lines = ["", f"Closed-loop clients (each sends its next request when its last one finished; {rounds} "
             f"interleaved round(s) per point, medians over rounds):", "",
             "| arm | clients | output tok/s | / vllm-nospec | / offline-nospec | TTFT ms p50/p90/p99 | "
             "TPOT ms p50/p90/p99 | errors |", "|" + "---|" * 8]
    for p in sorted(points, key=lambda p: (p["arm"], p["clients"])):
        lines.append(f"| {p['arm']} | {p['clients']} | {p['output_tok_per_s']} | {ratio(p, 'vllm-nospec')} | "
                     f"{ratio(p, 'offline-nospec')} | {_p(p['ttft_ms'])} | {_p(p['tpot_ms'])} | {p['errors']} |")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = result.get("client_points") or []
    fig, axes = plt.subplots(1, 3 if clients else 2, figsize=(18 if clients else 12, 4.4))
    for arm in result["arms"]:
        pts = sorted((p for p in result["points"] if p["arm"] == arm), key=lambda p: p["rate"])
        rates = [p["rate"] for p in pts]
        style = "--" if arm.startswith("vllm") else "-"
        axes[0].plot(rates, [p["output_tok_per_s"] for p in pts], style, marker="o", label=arm)
        axes[1].plot(rates, [p["tpot_ms"]["p50"] for p in pts], style, marker="o", label=arm)
    for arm in sorted({p["arm"] for p in clients}):
        pts = sorted((p for p in clients if p["arm"] == arm), key=lambda p: p["clients"])
        style = "--" if arm.startswith("vllm") else ":" if arm.startswith("offline") else "-"
        axes[2].plot([p["clients"] for p in pts], [p["output_tok_per_s"] for p in pts], style, marker="o", label=arm)
    if clients:
        axes[2].set(xlabel="closed-loop clients", ylabel="output tok/s", title="throughput by clients", xscale="log")
    axes[0].set(xlabel="request rate (req/s)", ylabel="output tok/s", title="throughput")
    axes[1].set(xlabel="request rate (req/s)", ylabel="ms", title="TPOT p50")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
