"""Simulate speculative decoding at scale: recorded draft behaviour, the real controller, a cost model.

    adaspec simulate --trace docs/traces/sharegpt-mtp.jsonl --model yamls/models/deepseek-v3.yaml \\
        --hardware yamls/hardware/ascend-910b.yaml --tp 16 --out out/sim
    adaspec simulate --trace T.jsonl --profile T.jsonl --validate --batches 1,8,32 --out out/sim-cpu
    adaspec simulate --trace T.jsonl --model M.yaml --hardware H.yaml --tp 8 --poisson 5,20,80 --out out/load

The trace (adaspec bench --record-trace) gives every simulated sequence its draft
confidences and acceptance per step; the controller (budget, early stop, keep,
calibration) and the time-model registry (startup sweep included) run unchanged; step
times come from a roofline of --model on --tp devices of --hardware, or from a profile
measured here (--profile: a step trace or a sweep file). --validate compares every arm with
the decode throughput the trace itself measured (a profile of this machine, to check the
method where both exist). Arms nospec, static-k, adaptive-k, oracle-k.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from cluster.entrypoints.common import add_config_args, config_from_args

POLICIES = ("nospec", "static", "adaptive", "oracle")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec simulate", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--trace", required=True, help="a step trace with static arms (adaspec bench --record-trace FILE)")
    p.add_argument("--model", help="model yaml (yamls/models/*.yaml); with --hardware and --tp")
    p.add_argument("--hardware", help="accelerator yaml (yamls/hardware/*.yaml)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--profile", help="instead of a roofline: a step trace (.jsonl) or a sweep file measured here")
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--ks", type=_ints, default=[3, 5, 7], help="draft lengths (at most the trace's static k)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES))
    p.add_argument("--output-len", type=int, default=64, help="tokens per sequence (default 64, as the bench)")
    p.add_argument("--num-seqs", type=int, default=64, help="sequences per arm and batch (whole waves; default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-control-time", action="store_true",
                   help="leave the controller's own wall time here out of the step times")
    p.add_argument("--validate", action="store_true", help="compare with the decode throughput the trace measured")
    p.add_argument("--poisson", type=_floats, metavar="RATES",
                   help="Poisson load instead of waves: request rates (req/s, comma-separated), at most "
                        "--max-batch sequences at once, --num-seqs requests per arm and rate")
    p.add_argument("--max-batch", type=int, default=256, help="with --poisson: the engine's largest batch")
    p.add_argument("--out", default="out/sim", help="directory for bench.json, bench.md and bench.png")
    return p


def cost_model(args: argparse.Namespace):
    from cluster.sim.costs import ProfileCost
    from cluster.sim.roofline import RooflineCost
    from cluster.sim.specs import load_hardware, load_model

    if args.profile:
        if args.model or args.hardware:
            raise ValueError("--profile replaces --model/--hardware: give one or the other")
        cost = ProfileCost.load(args.profile)
        return cost, cost.describe()
    if not (args.model and args.hardware):
        raise ValueError("a cost model is needed: --model and --hardware (with --tp), or --profile")
    model, hw = load_model(args.model), load_hardware(args.hardware)
    return RooflineCost(model, hw, args.tp), f"roofline of {model.name} on {args.tp} x {hw.name} (TP={args.tp})"


def run(args: argparse.Namespace) -> int:
    from cluster.sim.load import simulate_load
    from cluster.sim.replay import SimArm, simulate, startup_model
    from cluster.sim.report import summarise, write_outputs
    from cluster.sim.traces import load_pool, measured

    cfg = config_from_args(args)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"--policies: unknown {sorted(unknown)}; expected some of {POLICIES}")
    pool = load_pool(args.trace)
    if max(args.ks) > pool.k:
        raise ValueError(f"--ks {max(args.ks)} is more than the {pool.k} drafts the trace's static steps verified")
    cost, described = cost_model(args)
    spec = cfg.speculative
    spec.enabled, spec.adaptive.enabled = True, True
    spec.num_speculative_tokens = max(args.ks)
    poisson = args.poisson is not None
    if poisson and args.validate:
        raise ValueError("--validate compares waves with the trace's benchmark: not with --poisson")
    batches = [args.max_batch] if poisson else args.batches
    startup = startup_model(cost, spec, max(batches))  # an engine configured for the largest batch
    arms = [SimArm(p, 0 if p == "nospec" else k, b) for b in batches for p in policies
            for k in ([0] if p == "nospec" else args.ks)]
    runs = [(arm, rate) for rate in args.poisson for arm in arms] if poisson else [(arm, None) for arm in arms]
    results = []
    for arm, rate in tqdm(runs, desc="simulate", mininterval=2):
        if poisson:
            results.append(simulate_load(arm, rate, pool, cost, spec, startup, args.output_len, args.num_seqs,
                                         args.seed, control_time=not args.no_control_time))
        else:
            results.append(simulate(arm, pool, cost, spec, startup, args.output_len, args.num_seqs, args.seed,
                                    control_time=not args.no_control_time).summary())
    result = {"simulated": True, "mode": "poisson" if poisson else "waves", "trace": str(args.trace),
              "cost_model": described, "tp": args.tp, "pool_rows": len(pool), "pool_k": pool.k,
              "output_len": args.output_len, "num_seqs": args.num_seqs, "seed": args.seed,
              "max_batch": max(batches), "arms": results, "summary": {} if poisson else summarise(results),
              "notes": (("prefill priced as one forward over the admitted prompts" if poisson else
                         "decode throughput only (prefill not simulated)")
                        + f"; {len(pool)} draft rows from the trace's static-{pool.k} steps, a simulated sequence "
                          f"replaying one recorded sequence; controller time "
                        + ("left out" if args.no_control_time else "as profiled, else measured here")
                        + "; calibrators warmed on 4,096 verified rows")}
    if args.validate:
        got = measured(args.trace)
        result["validation"] = [
            {"arm": a["name"].split("@")[0], "batch": a["batch"], "simulated_tok_per_s": a["tok_per_s"],
             "measured_tok_per_s": round(got[key]["decode_tok_per_s"], 2),
             "error": a["tok_per_s"] / got[key]["decode_tok_per_s"] - 1}
            for a in results if (key := (a["name"].split("@")[0], a["batch"])) in got]
    write_outputs(result, Path(args.out))
    print(Path(args.out, "bench.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
