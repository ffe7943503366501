"""`adaspec bench-paired`: several of our configurations in this process, stepped in turn on
the same Poisson arrivals, each on its own clock. It resolves differences of a fraction of a
percent where the served sweep's rounds spread 5-10% (bench-serve), without HTTP.

    adaspec bench-paired --config yamls/bench.yaml --arms nospec,static-3,adaptive-7 --rates 0.5,1.2 --out out/paired

An arm may carry config overrides after its name, each after a '+': adaptive-3+speculative.adaptive.min_gain=0.1
is adaptive-3 with that setting, and `--arms adaptive-3,adaptive-3+KEY=VALUE` (no fixed arm) reports the variant over
the arm itself, stepped in pairs: an A/B of one setting.

Each arm (nospec, static-K, adaptive-K: bench-serve's) is an Engine, its one rank in this
process (TP=1), one for every group of arms stepped together (an adaptive arm's engine
learns only from the steps it takes beside the arm it is compared with), all reading one
copy of the weights as one server would (--separate-weights: a copy each). All get the
held-out requests bench-serve sends (bench.serve_requests, each with its reply's length as
max_tokens, greedy, EOS honoured), arriving as a seeded Poisson process. Each engine keeps
its own clock: the time its steps took, moved on to the next arrival when it has nothing
to do, so it sees the arrivals a server at that rate would, at its own speed; in each idle
gap it does what a server's loop does there (Engine.idle: the time-model registry's
buffered samples and refits), off its clock. The engines compared are stepped in turn, one
step each (which goes first rotates by round), so the machine's drift falls on all alike:
each comparison's two on their own (--schedule pairs, the default), or every arm together
(--schedule all: fewer rounds to run, but each further engine leaves the caches colder for
the next). A round's throughput is its output tokens over its clock at the last completion.
A rate reports each adaptive arm over each fixed arm (or, without both kinds, each arm over
the first): the median over rounds of the per-round ratio, with the 95% interval of that
median; and each adaptive arm over the fixed arm it compares worst with there (best fixed).
Rates are fractions of the first arm's saturation, measured first in the first group that
holds it (every request at once; `inf` runs a rate that way). Before measuring, every group
serves --warm-rounds rounds at each of --warm-rates (a server's history: its time-model
refits, calibration, probe back-offs). The arms must emit the same tokens (greedy): a round where
they differ is an error.
Writes paired.json, paired.md and paired.png.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from cluster.bench.paired_report import markdown, plot
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
            if arrivals[self.next][0] > self.clock:  # a gap before it: a server's idle work, off the clock
                engine.idle()
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


def paired_round(engines: list, specs: list, rate: float, seed: int, first: int = 0) -> list[Clocked]:
    """One round of every engine, one step of each in turn starting with engines[first];
    their throughputs are tokens / clock."""
    runs = [Clocked(e, arrivals(specs, rate, seed)) for e in engines]
    order = runs[first:] + runs[:first]
    while not all(r.done() for r in runs):
        for r in order:
            if not r.done():
                r.step()
    emitted = [[r.tokens[i] for i in r.ids] for r in runs]
    if any(e != emitted[0] for e in emitted[1:]):
        raise RuntimeError(f"round {seed}: the arms emitted different tokens for the same greedy requests")
    return runs


def comparisons(arms: list[str]) -> list[tuple[str, str]]:
    """(arm, over) pairs a rate reports: every adaptive arm over every fixed one (nospec, static-K), or,
    where the arms hold no adaptive or no fixed arm, every arm over the first."""
    adaptive = [a for a in arms if a.startswith("adaptive")]
    fixed = [a for a in arms if a not in adaptive]
    if adaptive and fixed:
        return [(a, f) for a in adaptive for f in fixed]
    return [(a, arms[0]) for a in arms[1:]]


SCHEDULES = ("pairs", "all")


def groups(arms: list[str], schedule: str) -> list[tuple[str, ...]]:
    """The arms stepped together in a round: all of them, or each comparison's two (`pairs`:
    every further engine stepped in turn makes every step find the caches colder, and in a run
    of seven arms at batch 8 adaptive-3 read 0.981 of plain decoding where the two alone read 0.997)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    return [tuple(arms)] if schedule == "all" else list(dict.fromkeys(comparisons(arms)))


def rate_point(arms: list[str], measured: dict, frac: float, rate: float) -> dict:
    """A rate's point from measured[group] (a list per arm of the group: its tok/s each round):
    each arm's median over every round it ran, each comparison's per-round ratios (measured in
    the group holding both) with their median and interval, and, with fixed and adaptive arms,
    each adaptive arm over the fixed arm it compares worst with (best fixed)."""
    def ratio(a: str, over: str) -> dict:
        g = next(g for g in measured if a in g and over in g)
        x, y = measured[g][g.index(a)], measured[g][g.index(over)]
        ratios = [p / q for p, q in zip(x, y)]
        mid, interval = ratio_summary(x, y)
        return {"arm": a, "over": over, "ratios": [round(v, 5) for v in ratios], "median": round(mid, 5),
                "interval": [round(v, 5) for v in interval], "min": round(min(ratios), 5),
                "max": round(max(ratios), 5)}

    runs = {a: [t for g, tok in measured.items() if a in g for t in tok[g.index(a)]] for a in arms}
    point = {"rate_fraction": frac, "rate": round(rate, 4) if math.isfinite(rate) else None,
             "tok_s": [round(median(runs[a]), 2) for a in arms],
             "ratios": [ratio(a, over) for a, over in comparisons(arms)]}
    adaptive = [a for a in arms if a.startswith("adaptive")]
    if adaptive and len(adaptive) < len(arms):
        point["over_best_fixed"] = [min((r for r in point["ratios"] if r["arm"] == a), key=lambda r: r["median"])
                                    for a in adaptive]
    return point


def sweep(engines: dict, arms: list[str], specs: list, rates: list[float], rounds: int, warm_rates: list[float],
          warm_rounds: int, seed: int, schedule: str = "pairs") -> dict:
    """engines: group (`groups`) -> its own engines, one per arm of the group in its order
    (`group_engines`). Each round runs every group on the round's arrivals."""
    together = groups(arms, schedule)

    def run(group: tuple, rate: float, round_seed: int, j: int) -> list[Clocked]:
        return paired_round(engines[group], specs, rate, round_seed, j % len(group))

    first = next(g for g in together if arms[0] in g)  # the first arm's saturation, in its first group
    base = run(first, float("inf"), seed, 0)[first.index(arms[0])]
    sat_rps = len(specs) / base.clock
    for i, frac in enumerate(tqdm(warm_rates, desc="warm-up", mininterval=2)):
        for j in range(warm_rounds):
            for g in together:
                run(g, frac * sat_rps, seed + 1000 * (i + 1) + j, j)
    points = []
    for i, frac in enumerate(rates):
        measured = {g: [[] for _ in g] for g in together}
        before = _counts(engines)
        for j in tqdm(range(rounds), desc=f"{frac:.0%} of saturation", mininterval=2, leave=False):
            for g in together:
                for got, r in zip(measured[g], run(g, frac * sat_rps, seed + 100_000 + 1000 * i + j, j)):
                    got.append(r.output_tokens() / r.clock)
        points.append(rate_point(arms, measured, frac, frac * sat_rps) | {"drafting": drafting(arms, before,
                                                                                                _counts(engines))})
    return {"saturation_rps": round(sat_rps, 4), "points": points}


def _counts(engines: dict) -> dict:
    """(group, arm) -> its engine's decode steps, those that drafted nothing, and draft ms so far."""
    return {(g, a): (e.stats.decode_steps, e.stats.zero_budget_steps, e.stats.draft_ms)
            for g, held in engines.items() for a, e in zip(g, held)}


def drafting(arms: list[str], before: dict, after: dict) -> dict:
    """Per arm, over its engines, between two `_counts`: decode steps, those that drafted, and their draft
    forwards' ms (where a standing-down arm's gap goes: in batch-capped pairs at 32 sequences, mostly a few
    stand-down probes in the rounds' tails, each catching one row up on a few hundred tokens)."""
    out = {a: {"decode_steps": 0, "drafting_steps": 0, "draft_ms": 0.0} for a in arms}
    for (g, a), (steps, plain, ms) in after.items():
        s0, p0, m0 = before[(g, a)]
        got = out[a]
        got["decode_steps"] += steps - s0
        got["drafting_steps"] += (steps - s0) - (plain - p0)
        got["draft_ms"] = round(got["draft_ms"] + ms - m0, 1)
    return out


def group_engines(arms: list[str], schedule: str, make) -> dict:
    """group -> engines of its own (make(arm) -> a new Engine): an adaptive engine learns its time
    model, calibration and probe back-off from the steps it takes, and beside another arm's it
    takes them on caches that arm leaves. Shared by every pair, adaptive-7's engine had read
    0.987-0.994 of plain decoding at 25-120% of saturation in a run of five arms (nospec,
    static-3 / 5 / 7), where beside two fixed arms it read 0.994-0.999 (5ab98e9's code)."""
    return {g: [make(a) for a in g] for g in groups(arms, schedule)}


def share_engine_weights(engines: list) -> None:
    """Every engine reads one copy of each model (the first engine's that holds it), as one server
    would: stepped in turn, engines with copies of their own would each find the caches full of
    the others' weights (models/share.py). One copy per dtype the kernels stream it in: an arm whose
    draft streams other weights (a variant's speculative.draft_weights) shares the target alone."""
    from models.kernels import PACK_DTYPE
    from models.share import share_weights

    held: dict[tuple, object] = {}
    for engine in engines:
        for role, module in engine.workers.worker.runner.weight_modules().items():
            key = (role, module.__dict__.get(PACK_DTYPE))
            if key in held:
                share_weights(module, held[key])
            else:
                held[key] = module


def variant_overrides(arm: str) -> list[str]:
    """An arm's config overrides: its name's (nospec, static-K, adaptive-K: arm_overrides), then each
    KEY=VALUE after a '+' (a variant of the arm: adaptive-3+speculative.adaptive.min_gain=0.1)."""
    name, *extra = arm.split("+")
    for item in extra:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"arm {arm!r}: {item!r} is not KEY=VALUE (an arm's overrides follow its name, each "
                             "after a '+')")
    return arm_overrides(name) + extra


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
    p.add_argument("--arms", default="nospec,adaptive-7",
                   help="two or more arms (nospec, static-K, adaptive-K, each optionally +KEY=VALUE overrides: "
                        "adaptive-3+speculative.adaptive.min_gain=0.1); see comparisons() for the ratios reported")
    p.add_argument("--rates", default="0.5,1.0,1.2",
                   help="comma-separated fractions of saturation (inf: every request at once)")
    p.add_argument("--rounds", type=int, default=5, help="paired rounds per rate")
    p.add_argument("--warm-rates", default="0.1,0.25,0.5,0.75,1.0", help="fractions served first, untimed")
    p.add_argument("--warm-rounds", type=int, default=2, help="rounds at each warm-up rate")
    p.add_argument("--schedule", choices=SCHEDULES, default="pairs",
                   help="step each compared pair of arms on its own (default), or all arms together (faster)")
    p.add_argument("--separate-weights", action="store_true",
                   help="each engine keeps its own copy of the weights (default: one copy, as one server holds)")
    p.add_argument("--out", default="out/bench-paired", help="directory for paired.json, .md and .png")
    return p


def run(args: argparse.Namespace) -> int:
    from cluster.bench.serving import workload
    from cluster.config import load_config
    from cluster.engine.core import Engine

    arms = [a.strip() for a in args.arms.split(",")]
    if len(arms) < 2 or len(set(arms)) != len(arms):
        raise ValueError(f"--arms {args.arms!r}: expected two or more different arms")
    rates, warm = _fractions(args.rates, "--rates"), _fractions(args.warm_rates, "--warm-rates", empty_ok=True)
    if args.rounds < 1 or args.warm_rounds < 0:
        raise ValueError("--rounds must be at least 1 and --warm-rounds at least 0")
    cfgs = [load_config(args.config, args.overrides + variant_overrides(a)) for a in arms]
    for a, c in zip(arms, cfgs):
        if not c.parallel.in_process:
            raise ValueError(f"{a}: bench-paired runs each engine's one rank in this process (parallel.tp_size=1)")
    made: list = []

    def make(arm: str):
        made.append(Engine(cfgs[arms.index(arm)]))
        return made[-1]

    try:
        engines = group_engines(arms, args.schedule, make)
        if not args.separate_weights:
            share_engine_weights(made)
        specs = workload(made[0].tokenizer, cfgs[0].bench)
        started = time.perf_counter()
        result = sweep(engines, arms, specs, rates, args.rounds, warm, args.warm_rounds, cfgs[0].bench.seed,
                       args.schedule)
    finally:
        for e in made:
            e.shutdown()
    result.update(arms=arms, schedule=args.schedule, shared_weights=not args.separate_weights, rounds=args.rounds,
                  requests=len(specs), warm_rates=warm, warm_rounds=args.warm_rounds,
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
