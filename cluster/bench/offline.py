"""`adaspec bench`: offline ShareGPT throughput of nospec, static-k, adaptive-k and oracle-k,
against the peers users would otherwise run (Hugging Face transformers at batch 1; vLLM's
CPU build, plain and with the bundled draft, when `bench.vllm_python` is set), measured in
interleaved rounds with bootstrap intervals.

    adaspec bench --config yamls/bench.yaml --out out/bench [--record-trace out/trace.jsonl]
    ray job submit --working-dir . -- python -m cluster.bench --config yamls/bench.yaml --out out/bench

Prompts: first human turns of held-out ShareGPT V3 conversations (never trained on),
shuffled with bench.seed and cut to min..max_prompt_len tokens. Every arm emits exactly
bench.output_len tokens per prompt (EOS ignored) and is checked against the target-only
greedy reference token for token (`outputs_identical`).

Rounds: at each batch size b the prompts form waves of b concurrent sequences (of
b * bench.refill prompts, at most b decoding at once, where bench.refill > 1). One
warm-up wave per arm (not counted) sets how many waves a round holds, so that every arm
spends at least bench.min_round_s in each round; then bench.rounds rounds run, wave by
wave, every arm on the same wave in an order shuffled (seeded) every wave, so neither a
drift of the machine nor what ran just before favours an arm. Subprocess peers would keep
the cores busy after a wave (vLLM's workers poll for a second before they sleep): their
arms run back to back, then their processes are stopped (SIGSTOP) until their next wave,
and the next arm waits `settle_s` untimed. Each
arm's tok/s is the median over rounds with a 95% bootstrap interval; each ratio is the
median of per-round ratios with its interval. `nospec-again`, plain decoding measured as a second arm, is the control: its ratio to
nospec must have an interval that contains 1.0 (`control_ok`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from pathlib import Path

from tqdm import tqdm

from cluster.bench.arms import Arm, Round, WaveResult
from cluster.bench.results import build_result, write_outputs
from cluster.entrypoints.common import add_config_args, config_from_args
from cluster.engine.core import Engine
from cluster.engine.request import RequestParams


def arm_name(policy: str, k: int, batch: int, several: bool) -> str:
    base = policy if policy in ("nospec", "nospec-again", "hf-target", "hf-assisted", "vllm-nospec") else f"{policy}-{k}"
    return f"{base}@b{batch}" if several else base


def load_prompts(engine: Engine, bench) -> list[list[int]]:
    from cluster.bench.sharegpt import heldout_prompts

    out = []
    for text in heldout_prompts(seed=bench.seed):
        ids = engine.encode(text)
        if len(ids) >= bench.min_prompt_len:
            out.append(ids[: bench.max_prompt_len])
        if len(out) == bench.num_prompts:
            return out
    raise ValueError(f"only {len(out)} held-out prompts have >= {bench.min_prompt_len} tokens")


class EngineArms:
    """Our arms: one Engine, switched between modes and k without restarting its ranks."""

    settle_s = 0.0  # nothing of ours runs between waves

    def __init__(self, engine: Engine):
        self.engine = engine

    def run_wave(self, arm: Arm, prompts: list[list[int]], refs: list[list[int]], max_tokens: int,
                 label: str = "") -> WaveResult:
        engine = self.engine
        engine.set_num_speculative_tokens(0 if arm.policy == "nospec" else arm.k)
        engine.set_mode("static" if arm.policy == "nospec" else arm.policy)
        if engine.tracer is not None:
            engine.tracer.label = label
        params = RequestParams(max_tokens=max_tokens, ignore_eos=True)
        before = _counters(engine)
        cap = engine.scheduler.max_num_seqs
        engine.scheduler.max_num_seqs = min(cap, arm.batch)  # at most b at once
        try:
            t0 = time.perf_counter()
            rids = [engine.add_request(p, params, oracle_ids=refs[i] if arm.policy == "oracle" else None)
                    for i, p in enumerate(prompts)]
            done = {}
            while engine.has_work():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
            wall = time.perf_counter() - t0
        finally:
            engine.scheduler.max_num_seqs = cap
        after = _counters(engine)
        delta = {key: after[key] - before[key] for key in after}
        outs = [done[r] for r in rids]
        delta["seq_steps"] = sum(o.steps - 1 for o in outs)  # the first token comes from the prefill
        return WaveResult([o.token_ids for o in outs], wall, delta.pop("decode_seq_ms"), delta.pop("decode_tokens"),
                          delta)


def _counters(engine: Engine) -> dict:
    st = engine.stats
    return {"drafted": st.drafted, "verified": st.verified, "accepted": st.accepted, "draft_ms": st.draft_ms,
            "validate_ms": st.validate_ms, "control_ms": st.control_ms, "dispatch_ms": st.dispatch_ms,
            "steps": st.decode_steps,
            "decode_seq_ms": st.decode_seq_ms, "decode_tokens": st.decode_tokens}


def our_arms(bench, batch: int, several: bool) -> list[Arm]:
    arms = []
    for policy in bench.policies:
        for k in ([0] if policy == "nospec" else bench.ks):
            arms.append(Arm(arm_name(policy, k, batch, several), policy, k, batch))
    arms.append(Arm(arm_name("nospec-again", 0, batch, several), "nospec", 0, batch, control=True,
                    note="control: plain decoding measured as a second arm"))
    return arms


def wave_order(group: list[Arm], runners: dict, rng: random.Random) -> list[Arm]:
    """A shuffled order of the arms; the arms of a runner that needs to settle after its
    waves stay together (shuffled among themselves), so it settles once per wave."""
    blocks: dict[int, list[Arm]] = {}
    for arm in group:
        key = id(runners[arm.name]) if runners[arm.name].settle_s else id(arm)
        blocks.setdefault(key, []).append(arm)
    order = list(blocks.values())
    rng.shuffle(order)
    for block in order:
        rng.shuffle(block)
    return [arm for block in order for arm in block]


def run_rounds(group: list[Arm], runners: dict, prompts: list[list[int]], refs: list[list[int]], bench,
               batch: int) -> int:
    """Warm up, size the rounds, then run bench.rounds rounds of `group` at `batch`;
    runners[arm.name] runs the arm's waves. Returns the waves per round."""
    size = batch * bench.refill
    waves = [list(range(s, min(s + size, len(prompts)))) for s in range(0, len(prompts), size)]
    rng = random.Random(bench.seed * 1_000_003 + batch)

    def wave(arm: Arm, w: int, label: str) -> WaveResult:
        want = [refs[i] for i in waves[w]]
        runner = runners[arm.name]
        got = runner.run_wave(arm, [prompts[i] for i in waves[w]], want, bench.output_len, label)
        arm.check(got.token_ids, want)
        return got

    def run_in_order(order: list[Arm], w: int, label: str, record: bool) -> list[float]:
        walls = []
        for i, arm in enumerate(order):
            got = wave(arm, w, f"{arm.name}/{label}")
            walls.append(got.wall_s)
            if record:
                arm.record(got)
            runner = runners[arm.name]
            if runner.settle_s and (i + 1 == len(order) or runners[order[i + 1].name] is not runner):
                if hasattr(runner, "pause"):
                    runner.pause()
                time.sleep(runner.settle_s)
        return walls

    warm = run_in_order(wave_order(group, runners, rng), 0, "warmup", record=False)
    per_round = max(1, math.ceil(bench.min_round_s / max(min(warm), 1e-6)))
    bar = tqdm(total=bench.rounds * per_round * len(group), desc=f"batch {batch}", mininterval=2)
    for r in range(bench.rounds):
        for arm in group:
            arm.rounds.append(Round())
        for j in range(per_round):
            run_in_order(wave_order(group, runners, rng), (r * per_round + j) % len(waves), f"r{r}", record=True)
            bar.update(len(group))
    bar.close()
    return per_round


def run_bench(cfg, out_dir: Path, trace: str | None = None) -> dict:
    bench = cfg.bench
    several = len(bench.batch_sizes) > 1
    if trace:
        cfg.engine.trace_path = trace
    started = time.perf_counter()
    engine = Engine(cfg)
    hf = vllm = None
    arms, plan = [], {}
    try:
        prompts = load_prompts(engine, bench)
        ours = EngineArms(engine)
        refs = reference(ours, prompts, bench)
        if bench.hf_peer:
            from cluster.bench.hf_peer import HFPeer

            hf = HFPeer(cfg, prompts[: bench.hf_prompts])
        if bench.vllm_python:
            if bench.refill > 1:
                raise ValueError("bench.refill > 1 is not supported with vLLM's arms (bench.vllm_python): their "
                                 "engines hold max(bench.batch_sizes) sequences and would decode a whole wave at once")
            from cluster.bench.vllm_peer import VLLMArms

            vllm = VLLMArms(cfg, out_dir)
        for b in bench.batch_sizes:
            group = our_arms(bench, b, several)
            runners = {a.name: ours for a in group}
            for peer in ([hf] if hf is not None and b == 1 else []) + ([vllm] if vllm is not None else []):
                for a in peer.arms(b, several):
                    group.append(a)
                    runners[a.name] = peer
            plan[b] = run_rounds(group, runners, prompts, refs, bench, b)
            arms += group
        time_model = dataclasses.asdict(engine.time_models.report()) if engine.time_models else None
        registry = getattr(engine.time_models, "registry", None)  # an in-process rank's registry
        if time_model is not None and registry is not None:
            time_model.update(kind=registry.kind, held_out_mape=registry.held_out_mape())
    finally:
        engine.shutdown()
        if vllm is not None:
            vllm.close()
    result = build_result(cfg, arms, time_model, plan, time.perf_counter() - started,
                          vllm.describe() if vllm is not None else None)
    write_outputs(result, out_dir)
    return result


def reference(ours: EngineArms, prompts: list[list[int]], bench) -> list[list[int]]:
    """Target-only greedy outputs of every prompt, at the largest batch."""
    arm, b, refs = Arm("reference", "nospec", 0, max(bench.batch_sizes)), max(bench.batch_sizes), []
    for s in tqdm(range(0, len(prompts), b), desc="reference", mininterval=2):
        refs += ours.run_wave(arm, prompts[s:s + b], [], bench.output_len, "reference").token_ids
    return refs


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec bench", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--out", default="out/bench", help="directory for bench.json, bench.md and bench.png")
    p.add_argument("--record-trace", metavar="FILE", help="append one JSON line per decode step (cluster/engine/trace.py)")
    return p


def run(args: argparse.Namespace) -> int:
    from cluster.engine.ray_env import ensure_ray

    cfg = config_from_args(args)
    if not cfg.speculative.enabled or not cfg.speculative.adaptive.enabled:
        raise ValueError("bench needs speculative.enabled=true and speculative.adaptive.enabled=true")
    if not cfg.bench.ks and set(cfg.bench.policies) - {"nospec"}:
        raise ValueError(f"bench.ks is empty: policies {cfg.bench.policies} other than nospec need at least one k")
    if cfg.bench.ks and cfg.speculative.num_speculative_tokens < max(cfg.bench.ks):
        raise ValueError(f"speculative.num_speculative_tokens={cfg.speculative.num_speculative_tokens} is below "
                         f"max(bench.ks)={max(cfg.bench.ks)}")
    started = False if cfg.parallel.in_process else ensure_ray(cfg)  # a TP=1 in-process run needs no Ray
    try:
        result = run_bench(cfg, Path(args.out), args.record_trace)
    finally:
        if started:
            import ray

            ray.shutdown()
    print(Path(args.out, "bench.md").read_text())
    if not result["engine_outputs_identical"]:
        print("adaspec bench: our outputs differ from the target-only reference", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
