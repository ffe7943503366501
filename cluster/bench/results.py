"""The offline bench's result: arm summaries, ratios with intervals, the control check,
and the files (bench.json, bench.md, bench.png)."""
from __future__ import annotations

import json
from pathlib import Path

from cluster.bench.arms import Arm
from cluster.bench.stats import contains_one, ratio_summary


def ratios(arms: list[Arm], seed: int = 0) -> list[dict]:
    """Per batch: every arm to nospec (the control among them), adaptive-k to the best
    static and to oracle-k, our nospec to vLLM's, and our best arm to vLLM's best."""
    out = []

    def add(kind: str, arm: Arm, to: Arm) -> None:
        if any(r["arm"] == arm.name and r["to"] == to.name for r in out):
            return  # our best arm may be nospec, and vLLM's best its nospec
        med, ci = ratio_summary(arm.tok_per_s_rounds(), to.tok_per_s_rounds(), seed)
        out.append({"arm": arm.name, "to": to.name, "batch": arm.batch, "kind": kind, "median": round(med, 4),
                    "ci": [round(ci[0], 4), round(ci[1], 4)], "no_difference": contains_one(ci)})

    for batch in sorted({a.batch for a in arms}):
        group = [a for a in arms if a.batch == batch]
        nospec = next((a for a in group if a.policy == "nospec" and not a.control), None)
        if nospec is None:
            continue
        statics = [a for a in group if a.policy == "static"]
        best_static = max(statics, key=Arm.median_tok_per_s) if statics else None
        for a in group:
            if a is nospec:
                continue
            add("control" if a.control else "to nospec", a, nospec)
            if a.policy == "adaptive" and best_static is not None:
                add("to best static", a, best_static)
            oracle = next((o for o in group if o.policy == "oracle" and o.k == a.k), None)
            if a.policy == "adaptive" and oracle is not None:
                add("to oracle", a, oracle)
        peers = [a for a in group if a.policy.startswith("vllm")]
        if peers:
            add("vs vLLM nospec", nospec, next(a for a in peers if a.policy == "vllm-nospec"))
            ours = [a for a in group if a.policy in ("nospec", "static", "adaptive") and not a.control]
            add("best vs vLLM best", max(ours, key=Arm.median_tok_per_s), max(peers, key=Arm.median_tok_per_s))
    return out


def build_result(cfg, arms: list[Arm], time_model: dict | None, waves_per_round: dict, elapsed_s: float,
                 vllm: dict | None) -> dict:
    seed = cfg.bench.seed
    rs = ratios(arms, seed)
    control = [r for r in rs if r["kind"] == "control"]
    return {"config": cfg.to_dict(), "outputs_identical": all(a.identical for a in arms),
            "engine_outputs_identical": all(a.identical for a in arms if a.ours),
            "control_ok": bool(control) and all(r["no_difference"] for r in control),
            "rounds": cfg.bench.rounds, "min_round_s": cfg.bench.min_round_s,
            "waves_per_round": {str(b): w for b, w in waves_per_round.items()},
            "arms": [a.summary(seed) for a in arms], "ratios": rs, "time_model": time_model,
            "vllm": vllm or {"skipped": "bench.vllm_python is not set"},
            "machine": machine_note(cfg.parallel.device), "elapsed_s": round(elapsed_s, 1)}


def machine_note(device: str) -> str:
    import os
    import platform

    import torch

    where = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else device
    return (f"{platform.machine()} {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"torch {torch.__version__} on {where}")


def write_report(out_dir: Path, stem: str, result: dict, table: str) -> None:
    """result as STEM.json and its Markdown table as STEM.md, in out_dir (made if missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{stem}.md").write_text(table)


def write_outputs(result: dict, out_dir: Path) -> None:
    from cluster.bench.report import markdown, plot

    write_report(out_dir, "bench", result, markdown(result))
    plot(result, out_dir / "bench.png")
