"""`adaspec bench-serve`: a serving load sweep over HTTP. Held-out ShareGPT requests, each
with its own reply's length as max_tokens (capped at bench.max_output_len), greedy, EOS
honoured, streamed, arrive as a seeded Poisson process; request rates go from 10% to 120%
of the plain-decoding saturation, measured first with every request sent at once.

    adaspec bench-serve --config yamls/bench.yaml --out out/bench-serve
    adaspec bench-serve --config yamls/bench.yaml --url http://127.0.0.1:8000 --out out/other

Arms (bench.serve_arms): our server (`adaspec serve`'s Ray Serve app) in each
configuration, one application per arm under its own route prefix (bench.serve_replicas
of them per arm), all started first;
with bench.vllm_python set, also vLLM's OpenAI server on the same checkpoint
(bench.serve_vllm_arms). At every rate the arms take turns in bench.serve_rate_rounds
rounds, in an order shuffled (seeded) round by round, each round on the same requests in an
order and at arrival times of its own, the same for every arm (`round_schedule`), and more
rounds until every arm spent bench.serve_min_rate_s at the rate (a point: the medians over
rounds; `rate_sweep`), round j on an arm's server j % bench.serve_replicas; every arm's
processes, ours and vLLM's alike, are stopped (SIGSTOP) while the others are measured, and
after a vLLM arm the next waits, untimed, until vLLM's pollers sleep (`vllm_peer.SETTLE_S`).
`--url` measures one running OpenAI-compatible server instead. Writes serve.json, serve.md and serve.png.
The servers themselves: cluster/bench/servers.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cluster.bench.load import RequestResult, RequestSpec, run_load
from cluster.bench.servers import OurServers, Target, arm_overrides, running, vllm_servers
from cluster.bench.vllm_peer import SETTLE_S
from cluster.entrypoints.common import add_config_args, config_from_args
from cluster.config import ConfigError

def workload(tokenizer, bench) -> list[RequestSpec]:
    from cluster.bench.sharegpt import heldout_exchanges

    specs = []
    for prompt, reply in heldout_exchanges(seed=bench.seed):
        ids = tokenizer(prompt)["input_ids"]
        if len(ids) < bench.min_prompt_len:
            continue
        out_len = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        specs.append(RequestSpec(ids[: bench.max_prompt_len], max(1, min(out_len, bench.max_output_len))))
        if len(specs) == bench.serve_requests:
            return specs
    raise ValueError(f"only {len(specs)} held-out exchanges have prompts of >= {bench.min_prompt_len} tokens")


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3)}


def point(arm: str, rate: float, fraction: float | None, results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if not r.error]
    return {"arm": arm, "rate": round(rate, 4) if np.isfinite(rate) else "inf", "rate_fraction": fraction,
            "completed": len(ok), "errors": len(results) - len(ok),
            "error_examples": sorted({r.error for r in results if r.error})[:3],
            "output_tok_per_s": round(sum(r.tokens for r in ok) / max(wall, 1e-9), 2),
            "request_per_s": round(len(ok) / max(wall, 1e-9), 3), "wall_s": round(wall, 3),
            "ttft_ms": percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
            "tpot_ms": percentiles([r.tpot_ms for r in ok if r.tpot_ms is not None]),
            "itl_ms": percentiles([g for r in ok for g in r.itl_ms()]),
            "texts": [r.text if not r.error else None for r in results]}  # compared across arms, then dropped


def compare_texts(base: dict, points: list[dict]) -> dict:
    """Per arm: did every completed request stream the same text as the base arm's
    saturation run (all greedy, so every configuration must agree)?"""
    out = {}
    for p in points:
        got = out.setdefault(p["arm"], {"identical": True, "differing": 0})
        for mine, ref in zip(p["texts"], base["texts"]):
            if mine is not None and ref is not None and mine != ref:
                got["identical"], got["differing"] = False, got["differing"] + 1
    return out


def measure(target: Target, specs: list[RequestSpec], rate: float, seed: int, fraction: float | None = None,
            api_key: str | None = None) -> dict:
    with running(target):
        results, wall = asyncio.run(run_load(target.url, target.model, specs, rate, seed, api_key))
    return point(target.arm, rate, fraction, results, wall)


WARMUP_ALONE = 4  # requests a server's warm-up sends one at a time, after the workload at once (warm_up)
# the most rounds a rate takes to reach bench.serve_min_rate_s (at 120% of saturation a round lasts about 1.2 s)
MAX_RATE_ROUNDS = 40
def run_sweep(cfg, config: str | None, overrides: list[str], out_dir: Path, url: str | None = None,
              trace: str | None = None) -> dict:
    from cluster.engine.core import load_tokenizer

    bench, started = cfg.bench, time.perf_counter()
    if not url and "nospec" not in bench.serve_arms:
        raise ConfigError(f"bench.serve_arms={list(bench.serve_arms)} has no nospec: the rates are fractions of "
                          "its saturation, measured first")
    specs = workload(load_tokenizer(cfg.model.target), bench)
    ours, peers, targets = None, [], []
    try:
        if url:
            targets = [Target("url", url.rstrip("/"), None)]
        else:
            ours = OurServers(cfg, config, overrides, list(bench.serve_arms), trace, bench.serve_replicas)
            targets += ours.targets
            if bench.vllm_python:
                peers = vllm_servers(cfg, out_dir)
                targets += [Target(s.name, s.url, s.name, SETTLE_S, s) for s in peers]
                for s in peers:
                    s.pause()
        warmup = specs[:bench.serve_warmup_requests] if bench.serve_warmup_requests is not None else specs
        for t in tqdm(targets, desc="warm-up", mininterval=2):  # untimed: a server that has served a while
            warm_up(t, warmup, bench.seed)
        base = next(t for t in targets if t.arm in ("nospec", "url"))
        saturation = measure(base, specs, float("inf"), bench.seed)
        if not saturation["completed"]:
            raise RuntimeError(f"{base.arm} completed none of {len(specs)} requests at saturation; errors: "
                               f"{saturation['error_examples']}")
        sat_rps = saturation["request_per_s"]
        rng = random.Random(bench.seed)
        points, rate_rounds = rate_sweep(bench, targets, specs, sat_rps, rng)
        firsts = [t for t in targets if t.replica == 0]  # the closed-loop points take each arm's first server
        client_points, client_rounds = closed_loop(cfg, config, overrides, firsts, specs, ours is not None, rng)
        identical = compare_texts(saturation, rate_rounds + client_rounds)
    finally:
        for s in peers:
            s.close()
        if ours is not None:
            ours.close()
    for p in [saturation] + points + client_points:
        p.pop("texts", None)
    result = {"config": cfg.to_dict(), "url": url, "arms": list(dict.fromkeys(t.arm for t in targets)),
              "replicas": bench.serve_replicas if ours is not None else 1, "requests": len(specs),
              "outputs_identical": all(v["identical"] for a, v in identical.items() if not a.startswith("vllm")),
              "texts_vs_base": identical,
              "mean_max_tokens": round(float(np.mean([s.max_tokens for s in specs])), 1),
              "saturation": saturation, "saturation_rps": sat_rps, "points": points,
              "client_points": client_points,
              "vllm": ({"servers": {s.name: round(s.start_s, 1) for s in peers}} if peers else
                       {"skipped": "bench.vllm_python is not set" if not url else "--url given"}),
              "machine": _machine(cfg), "elapsed_s": round(time.perf_counter() - started, 1)}
    write_outputs(result, out_dir)
    return result


def rate_sweep(bench, targets: list[Target], specs: list[RequestSpec], sat_rps: float,
               rng: random.Random) -> tuple[list[dict], list[dict]]:
    """The Poisson points: at every rate, bench.serve_rate_rounds rounds, and more until every
    arm has spent bench.serve_min_rate_s there (`more_rounds`), every arm once per round in an
    order shuffled per round, on the round's order of the requests and arrival times
    (`round_schedule`, the same for every arm); round j takes an arm's
    server j % (its servers). A point at 75-120% of saturation lasts about 1.2-2 s, and one
    arm's throughput moved by 15-20% from one pass to the next on this machine (the ratio of
    two arms measured side by side, 2-5%): with 4 rounds a rate's median ratio had an interval
    7% wide there, against 0.5-1% at 10-25%, whose rounds last 4-10 s.
    Returns the points merged over rounds (clients.merge_rounds: medians, and each round's
    throughput, so ratios are taken round by round) and every round's point."""
    from cluster.bench.clients import merge_rounds

    servers: dict[str, list[Target]] = {}
    for t in targets:
        servers.setdefault(t.arm, []).append(t)
    arms, points, every = list(servers), [], []
    bar = tqdm(total=len(bench.serve_rates) * bench.serve_rate_rounds * len(arms), desc="sweep", mininterval=2)
    for i, fraction in enumerate(bench.serve_rates):
        got, j = {arm: [] for arm in arms}, 0
        while j < bench.serve_rate_rounds or more_rounds(got, j, bench.serve_min_rate_s):
            if j >= bench.serve_rate_rounds:
                bar.total += len(arms)
                bar.refresh()
            order, seed = round_schedule(len(specs), bench.seed, i, j)
            mine = [specs[o] for o in order]
            for arm in rng.sample(arms, len(arms)):
                t = servers[arm][j % len(servers[arm])]
                p = measure(t, mine, fraction * sat_rps, seed, fraction)
                got[arm].append(dict(p, texts=in_order(p["texts"], order), replica=t.replica))
                time.sleep(t.settle_s)
                bar.update()
            j += 1
        points += [merge_rounds(got[arm]) for arm in arms]
        every += [p for arm in arms for p in got[arm]]
    bar.close()
    return points, every


def warm_up(target: Target, specs: list[RequestSpec], seed: int) -> None:
    """Untimed: `specs` all at once, then the first WARMUP_ALONE of them one at a time. An
    adaptive server's controller starts cold (it probes at every step until it has verified
    64 first drafts, controller/policy.py), and with every request at once it drafts nothing:
    in a traced run at 75% of saturation each server's first measured round held its cold
    start, 30-60 probes within about a second, some of them 4-10 ms (the probing row first
    catching up on 100-380 tokens). Alone, a request drafts at most of its steps."""
    measure(target, specs, float("inf"), seed)
    for spec in specs[:WARMUP_ALONE]:
        measure(target, [spec], float("inf"), seed)
    time.sleep(target.settle_s)


def round_schedule(n: int, seed: int, rate_index: int, round_index: int) -> tuple[list[int], int]:
    """Round `round_index` of rate `rate_index`: the order its n requests go out in and its
    arrival times' seed, the same for every arm. Each round has its own: with one order
    and one schedule for every round, the same request came last in every round, and at
    10-25% of saturation, where the last request runs alone, its decoding alone decided
    the round's wall time, so every round measured that one request's tail again."""
    rng = random.Random(f"{seed}/{rate_index}/{round_index}")
    return rng.sample(range(n), n), rng.randrange(2**31)


def in_order(texts: list, order: list[int]) -> list:
    """A round's texts (in its order) back in the workload's order."""
    out = [None] * len(order)
    for text, i in zip(texts, order):
        out[i] = text
    return out


def more_rounds(got: dict[str, list[dict]], done: int, min_s: float) -> bool:
    """After `done` rounds of a rate (got: each arm's points so far): does it need another for
    every arm to have spent min_s there (bench.serve_min_rate_s)? At most MAX_RATE_ROUNDS."""
    return done < MAX_RATE_ROUNDS and min(sum(p["wall_s"] for p in points) for points in got.values()) < min_s


def closed_loop(cfg, config: str | None, overrides: list[str], targets: list[Target], specs: list[RequestSpec],
                offline: bool, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """bench.serve_clients points for every arm, plus (with our servers) the offline engine
    on the same requests: bench.serve_client_rounds rounds per client count, every runner
    once per round in an order shuffled per round (the reference arms back to back:
    clients.round_order), so a ratio can be taken round by round; within a round every
    runner takes each block of the requests in turn (clients.blocks).
    Returns the points merged over rounds (clients.merge_rounds) and every round's point."""
    from cluster.bench.clients import OfflineClients, blocks, client_results, joined, merge_rounds, round_order
    from cluster.config import load_config

    if not cfg.bench.serve_clients:
        return [], []
    runners: list = list(targets)
    if offline:
        runners.append(OfflineClients(load_config(config, list(overrides) + arm_overrides("nospec"))))
    rounds: dict[tuple, list[dict]] = {}
    try:
        parts = {clients: blocks(specs, clients) for clients in cfg.bench.serve_clients}
        bar = tqdm(total=sum(map(len, parts.values())) * cfg.bench.serve_client_rounds * len(runners),
                   desc="clients", mininterval=2)
        for clients in cfg.bench.serve_clients:
            for _ in range(cfg.bench.serve_client_rounds):
                order, got = round_order(runners, rng), {r.arm: [] for r in runners}
                for b, part in enumerate(parts[clients]):
                    for r in (order if b % 2 == 0 else order[::-1]):
                        got[r.arm].append(r.results(part, clients) if isinstance(r, OfflineClients) else
                                          client_results(r, part, clients))
                        time.sleep(r.settle_s)
                        bar.update()
                for r in runners:
                    rounds.setdefault((r.arm, clients), []).append(joined(r.arm, clients, got[r.arm]))
        bar.close()
    finally:
        for r in runners:
            if isinstance(r, OfflineClients):
                r.close()
    return [merge_rounds(ps) for ps in rounds.values()], [p for ps in rounds.values() for p in ps]


def _machine(cfg) -> str:
    from cluster.bench.results import machine_note

    return machine_note(cfg.parallel.device)


def write_outputs(result: dict, out_dir: Path) -> None:
    from cluster.bench.serve_report import markdown, plot

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve.json").write_text(json.dumps(result, indent=1))
    (out_dir / "serve.md").write_text(markdown(result))
    plot(result, out_dir / "serve.png")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec bench-serve", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--out", default="out/bench-serve", help="directory for serve.json, serve.md and serve.png")
    p.add_argument("--url", help="measure this running OpenAI-compatible server instead of starting ours")
    p.add_argument("--record-trace", metavar="FILE",
                   help="our arms append their decode steps to FILE with the arm before the suffix (cluster/engine/trace.py)")
    return p


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    for arm in cfg.bench.serve_arms:
        arm_overrides(arm)  # refuse a bad arm name before anything starts
    result = run_sweep(cfg, args.config, list(args.overrides), Path(args.out), args.url, args.record_trace)
    print(Path(args.out, "serve.md").read_text())
    return 1 if any(p["errors"] for p in result["points"]) else 0


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
