"""`adaspec bench`: ShareGPT throughput of nospec, static-k, adaptive-k and oracle-k arms
(and the Hugging Face peers at batch 1), interleaved in one process.

    adaspec bench --config yamls/bench.yaml --out out/bench
    ray job submit --working-dir . -- python -m cluster.bench --config yamls/bench.yaml --out out/bench

Prompts: first human turns of held-out ShareGPT V3 conversations (never trained on),
shuffled with bench.seed and cut to min..max_prompt_len tokens. Every arm emits exactly
bench.output_len tokens per prompt (EOS ignored) and must reproduce the target-only
greedy reference token for token; `outputs_identical` records that. Arms run wave by
wave (bench.batch_sizes concurrent sequences per wave), each wave through every arm in
turn, so machine drift hits every arm alike. Writes bench.json, bench.md and bench.png.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cluster.common import add_config_args, config_from_args
from cluster.engine import Engine
from cluster.request import RequestParams


@dataclass
class Arm:
    name: str
    policy: str  # nospec | static | adaptive | oracle | hf-target | hf-assisted
    k: int
    batch: int
    output_tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    seq_steps: int = 0  # sum over sequences of their decode steps
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    validate_ms: float = 0.0
    dispatch_ms: float = 0.0
    tpot_sum_ms: float = 0.0
    outputs: int = 0
    note: str = ""
    identical: bool = True

    def summary(self) -> dict:
        per_step = max(self.steps, 1)
        return {
            "name": self.name, "policy": self.policy, "k": self.k, "batch": self.batch,
            "output_tokens": self.output_tokens, "wall_s": round(self.wall_s, 4),
            "tok_per_s": round(self.output_tokens / max(self.wall_s, 1e-9), 2), "steps": self.steps,
            "acceptance_length": round((self.output_tokens - self.outputs) / self.seq_steps, 4) if self.seq_steps else 0.0,
            "acceptance_rate": round(self.accepted / max(self.verified, 1), 4),
            "verified_per_seq_step": round(self.verified / max(self.seq_steps, 1), 4),
            "draft_ms_per_step": round(self.draft_ms / per_step, 4),
            "validate_ms_per_step": round(self.validate_ms / per_step, 4),
            "dispatch_ms_per_step": round(self.dispatch_ms / per_step, 4),
            "tpot_ms": round(self.tpot_sum_ms / max(self.outputs, 1), 4) if self.tpot_sum_ms else
            round(1e3 * self.wall_s / max(self.output_tokens, 1), 4),
            "outputs_identical": self.identical, "note": self.note,
        }


def arm_name(policy: str, k: int, batch: int, several: bool) -> str:
    base = policy if policy in ("nospec", "hf-target", "hf-assisted") else f"{policy}-{k}"
    return f"{base}@b{batch}" if several else base


def load_prompts(engine: Engine, bench) -> list[list[int]]:
    from models.data import heldout_prompts

    out = []
    for text in heldout_prompts(seed=bench.seed):
        ids = engine.encode(text)
        if len(ids) >= bench.min_prompt_len:
            out.append(ids[: bench.max_prompt_len])
        if len(out) == bench.num_prompts:
            return out
    raise ValueError(f"only {len(out)} held-out prompts have >= {bench.min_prompt_len} tokens")


def run_wave(engine: Engine, prompts: list[list[int]], output_len: int, arm: Arm,
             refs: list[list[int]] | None) -> list[list[int]]:
    """Run prompts to completion under the engine's current mode; accumulate into `arm`."""
    params = RequestParams(max_tokens=output_len, ignore_eos=True)
    before = _counters(engine)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params, oracle_ids=refs[i] if refs and arm.policy == "oracle" else None)
            for i, p in enumerate(prompts)]
    done = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    arm.wall_s += time.perf_counter() - t0
    after = _counters(engine)
    for key in ("drafted", "verified", "accepted", "draft_ms", "validate_ms", "dispatch_ms"):
        setattr(arm, key, getattr(arm, key) + after[key] - before[key])
    arm.steps += after["decode_steps"] - before["decode_steps"]
    outs = [done[r] for r in rids]
    for o in outs:
        arm.output_tokens += len(o.token_ids)
        arm.seq_steps += o.steps - 1  # the first token comes from the prefill
        arm.outputs += 1
        arm.tpot_sum_ms += o.tpot_ms
    return [o.token_ids for o in outs]


def _counters(engine: Engine) -> dict:
    st = engine.stats
    return {"drafted": st.drafted, "verified": st.verified, "accepted": st.accepted, "draft_ms": st.draft_ms,
            "validate_ms": st.validate_ms, "dispatch_ms": st.dispatch_ms, "decode_steps": st.decode_steps}


def configure(engine: Engine, arm: Arm) -> None:
    engine.set_num_speculative_tokens(0 if arm.policy == "nospec" else arm.k)
    engine.set_mode({"nospec": "static", "static": "static", "adaptive": "adaptive", "oracle": "oracle"}[arm.policy])


def run_bench(cfg, out_dir: Path) -> dict:
    bench = cfg.bench
    several = len(bench.batch_sizes) > 1
    engine = Engine(cfg)
    try:
        prompts = load_prompts(engine, bench)
        engine.set_mode("static")
        engine.set_num_speculative_tokens(0)
        ref_arm = Arm("reference", "nospec", 0, max(bench.batch_sizes))
        refs = []
        for s in tqdm(range(0, len(prompts), ref_arm.batch), desc="reference", mininterval=2):
            refs += run_wave(engine, prompts[s:s + ref_arm.batch], bench.output_len, ref_arm, None)
        arms: list[Arm] = []
        for b in bench.batch_sizes:
            group = [Arm(arm_name(p, k, b, several), p, k, b) for p in bench.policies
                     for k in ([0] if p == "nospec" else bench.ks)]
            arms += group
            waves = [list(range(s, min(s + b, len(prompts)))) for s in range(0, len(prompts), b)]
            bar = tqdm(total=len(waves) * len(group), desc=f"batch {b}", mininterval=2)
            for w, idx in enumerate(waves):
                for arm in group[w % len(group):] + group[: w % len(group)]:  # rotate the order per wave
                    configure(engine, arm)
                    got = run_wave(engine, [prompts[i] for i in idx], bench.output_len, arm, [refs[i] for i in idx])
                    arm.identical &= got == [refs[i] for i in idx]
                    bar.update()
            bar.close()
        if bench.hf_peer:
            from cluster.bench_hf import hf_arms

            arms += hf_arms(cfg, prompts[: bench.hf_prompts], refs[: bench.hf_prompts], several)
        time_model = engine.profile.report() if engine.profile else None
    finally:
        engine.shutdown()
    result = {"config": cfg.to_dict(), "outputs_identical": all(a.identical for a in arms),
              "time_model": time_model, "arms": [a.summary() for a in arms],
              "machine": machine_note(cfg.parallel.device)}
    write_outputs(result, out_dir)
    return result


def machine_note(device: str) -> str:
    import os
    import platform

    import torch

    where = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else device
    return (f"{platform.machine()} {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"torch {torch.__version__} on {where}")


def write_outputs(result: dict, out_dir: Path) -> None:
    from cluster.bench_report import markdown, plot

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    (out_dir / "bench.md").write_text(markdown(result))
    plot(result, out_dir / "bench.png")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec bench", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--out", default="out/bench", help="directory for bench.json, bench.md and bench.png")
    return p


def run(args: argparse.Namespace) -> int:
    from cluster.ray_env import ensure_ray

    cfg = config_from_args(args)
    if not cfg.speculative.enabled or not cfg.speculative.adaptive.enabled:
        raise ValueError("bench needs speculative.enabled=true and speculative.adaptive.enabled=true")
    if cfg.speculative.num_speculative_tokens < max(cfg.bench.ks):
        raise ValueError(f"speculative.num_speculative_tokens={cfg.speculative.num_speculative_tokens} is below "
                         f"max(bench.ks)={max(cfg.bench.ks)}")
    started = False if cfg.parallel.in_process else ensure_ray(cfg)  # a TP=1 in-process run needs no Ray
    try:
        result = run_bench(cfg, Path(args.out))
    finally:
        if started:
            import ray

            ray.shutdown()
    print(Path(args.out, "bench.md").read_text())
    if not result["outputs_identical"]:
        print("adaspec bench: outputs differ from the target-only reference", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
