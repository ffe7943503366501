"""`adaspec bench-paired`: two of our configurations in this process, stepped in alternation
on the same Poisson arrivals, each on its own clock. It resolves differences of a fraction of
a percent where the served sweep's rounds spread 5-10% (bench-serve), without HTTP.

    adaspec bench-paired --config yamls/bench.yaml --arms nospec,adaptive-7 --rates 0.5,1.2 --out out/paired

Each arm (nospec, static-K, adaptive-K: bench-serve's) is an Engine of its own, its one rank
in this process (TP=1). Both get the held-out requests bench-serve sends (bench.serve_requests,
each with its reply's length as max_tokens, greedy, EOS honoured), arriving as a seeded
Poisson process. Each engine keeps its own clock: the time its steps took, moved on to the
next arrival when it has nothing to do, so it sees the arrivals a server at that rate would,
at its own speed. One step of one engine, then one of the other (which goes first alternates
by round), so the machine's drift falls on both alike. A round's throughput is its output
tokens over its clock at the last completion; a rate's point is the median over rounds of
the second arm's throughput over the first's, with the 95% interval of that median. Rates
are fractions of the first arm's saturation, measured first (every request at once).
Before measuring, both engines serve --warm-rounds rounds at each of --warm-rates (a
server's history: its time-model refits, calibration, probe back-offs). Both arms must
emit the same tokens (greedy): a round where they differ is an error.
Writes paired.json, paired.md and paired.png.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from cluster.bench.results import write_report
from cluster.bench.servers import arm_overrides
from cluster.bench.stats import median, ratio_summary
from cluster.engine.request import RequestParams
from cluster.entrypoints.common import add_config_args


@dataclass
class Clocked:
    """One engine through one round: its arrivals (seconds, request spec), its clock."""
    engine: object
    arrivals: list
    clock: float = 0.0
    next: int = 0
    tokens: dict = field(default_factory=dict)  # request id -> token ids, once finished
    ids: list = field(default_factory=list)  # request ids in arrival order

    def done(self) -> bool:
        return self.next >= len(self.arrivals) and not self.engine.has_work()

    def step(self) -> None:
        engine, arrivals = self.engine, self.arrivals
        if not engine.has_work():  # idle: its clock moves on to the next arrival
            self.clock = max(self.clock, arrivals[self.next][0])
        while self.next < len(arrivals) and arrivals[self.next][0] <= self.clock:
            spec = arrivals[self.next][1]
            self.ids.append(engine.add_request(spec.prompt, RequestParams(max_tokens=spec.max_tokens)))
            self.next += 1
        t = time.perf_counter()
        outputs = engine.step()
        self.clock += time.perf_counter() - t
        self.tokens.update((o.request_id, o.token_ids) for o in outputs if o.finished)

    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


def arrivals(specs: list, rate: float, seed: int) -> list[tuple[float, object]]:
    """The requests in a seeded order at seeded Poisson arrival times (rate: requests/s; inf: all at 0)."""
    rng = random.Random(seed)
    order, t, out = rng.sample(range(len(specs)), len(specs)), 0.0, []
    for i in order:
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
        out.append((t, specs[i]))
    return out


def paired_round(engines: list, specs: list, rate: float, seed: int, second_first: bool) -> list[Clocked]:
    """One round of both engines, a step of each in turn; their throughputs are tokens / clock."""
    runs = [Clocked(e, arrivals(specs, rate, seed)) for e in engines]
    order = runs[::-1] if second_first else runs
    while not all(r.done() for r in runs):
        for r in order:
            if not r.done():
                r.step()
    a, b = ([r.tokens[i] for i in r.ids] for r in runs)
    if a != b:
        raise RuntimeError(f"round {seed}: the arms emitted different tokens for the same greedy requests")
    return runs


def sweep(engines: list, specs: list, rates: list[float], rounds: int, warm_rates: list[float],
          warm_rounds: int, seed: int) -> dict:
    base = paired_round(engines, specs, float("inf"), seed, False)[0]
    sat_rps = len(specs) / base.clock
    for i, frac in enumerate(tqdm(warm_rates, desc="warm-up", mininterval=2)):
        for j in range(warm_rounds):
            paired_round(engines, specs, frac * sat_rps, seed + 1000 * (i + 1) + j, j % 2 == 1)
    points = []
    for i, frac in enumerate(rates):
        tok_s = [[], []]
        for j in tqdm(range(rounds), desc=f"{frac:.0%} of saturation", mininterval=2, leave=False):
            runs = paired_round(engines, specs, frac * sat_rps, seed + 100_000 + 1000 * i + j, j % 2 == 1)
            for got, r in zip(tok_s, runs):
                got.append(r.output_tokens() / r.clock)
        ratios = [b / a for a, b in zip(*tok_s)]
        mid, interval = ratio_summary(tok_s[1], tok_s[0])
        points.append({"rate_fraction": frac, "rate": round(frac * sat_rps, 4), "ratios": [round(x, 5) for x in ratios],
                       "median": round(mid, 5), "interval": [round(x, 5) for x in interval],
                       "min": round(min(ratios), 5), "max": round(max(ratios), 5),
                       "tok_s": [round(median(v), 2) for v in tok_s]})
    return {"saturation_rps": round(sat_rps, 4), "points": points}


def markdown(result: dict) -> str:
    first, second = result["arms"]
    lines = [f"{second} over {first}, output tok/s on each engine's own clock, stepped in alternation "
             f"({result['rounds']} rounds a rate, {result['requests']} requests a round, after "
             f"{result['warm_rounds']} warm-up round(s) at each of {result['warm_rates']} of saturation; "
             f"saturation {result['saturation_rps']} req/s):", "",
             f"| of saturation | {first} tok/s | {second} tok/s | {second} / {first}, median [min, max] | "
             "95% interval |", "|---|---|---|---|---|"]
    for p in result["points"]:
        lines.append(f"| {p['rate_fraction']:.0%} | {p['tok_s'][0]} | {p['tok_s'][1]} | {p['median']:.4f} "
                     f"[{p['min']:.4f}, {p['max']:.4f}] | [{p['interval'][0]:.4f}, {p['interval'][1]:.4f}] |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    x = [100 * p["rate_fraction"] for p in pts]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.errorbar(x, [p["median"] for p in pts], yerr=[[p["median"] - p["interval"][0] for p in pts],
                                                      [p["interval"][1] - p["median"] for p in pts]],
                fmt="o-", capsize=3, label="median, 95% interval")
    ax.plot(x, [p["min"] for p in pts], "v", color="grey", ms=4, label="min / max round")
    ax.plot(x, [p["max"] for p in pts], "^", color="grey", ms=4)
    ax.set_xlabel("request rate, % of saturation")
    ax.set_ylabel(f"{result['arms'][1]} / {result['arms'][0]}")
    ax.set_title("paired engines, output tok/s ratio", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fractions(text: str, name: str, empty_ok: bool = False) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} {text!r}: expected comma-separated fractions of saturation") from None
    if (not values and not empty_ok) or any(v <= 0 for v in values):
        raise ValueError(f"{name} {text!r}: expected positive fractions of saturation")
    return values


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec bench-paired", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--arms", default="nospec,adaptive-7", help="two arms: the reference, then the one compared")
    p.add_argument("--rates", default="0.5,1.0,1.2", help="comma-separated fractions of saturation")
    p.add_argument("--rounds", type=int, default=5, help="paired rounds per rate")
    p.add_argument("--warm-rates", default="0.1,0.25,0.5,0.75,1.0", help="fractions served first, untimed")
    p.add_argument("--warm-rounds", type=int, default=2, help="rounds at each warm-up rate")
    p.add_argument("--out", default="out/bench-paired", help="directory for paired.json, .md and .png")
    return p


def run(args: argparse.Namespace) -> int:
    from cluster.bench.serving import workload
    from cluster.config import load_config
    from cluster.engine.core import Engine

    arms = [a.strip() for a in args.arms.split(",")]
    if len(arms) != 2:
        raise ValueError(f"--arms {args.arms!r}: expected two arms, the reference and the one compared")
    rates, warm = _fractions(args.rates, "--rates"), _fractions(args.warm_rates, "--warm-rates", empty_ok=True)
    if args.rounds < 1 or args.warm_rounds < 0:
        raise ValueError("--rounds must be at least 1 and --warm-rounds at least 0")
    cfgs = [load_config(args.config, args.overrides + arm_overrides(a)) for a in arms]
    for a, c in zip(arms, cfgs):
        if not c.parallel.in_process:
            raise ValueError(f"{a}: bench-paired runs each engine's one rank in this process (parallel.tp_size=1)")
    engines = []
    try:
        engines = [Engine(c) for c in cfgs]
        specs = workload(engines[0].tokenizer, cfgs[0].bench)
        started = time.perf_counter()
        result = sweep(engines, specs, rates, args.rounds, warm, args.warm_rounds, cfgs[0].bench.seed)
    finally:
        for e in engines:
            e.shutdown()
    result.update(arms=arms, rounds=args.rounds, requests=len(specs), warm_rates=warm, warm_rounds=args.warm_rounds,
                  elapsed_s=round(time.perf_counter() - started, 1))
    table = markdown(result)
    write_report(Path(args.out), "paired", result, table)
    plot(result, Path(args.out) / "paired.png")
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
