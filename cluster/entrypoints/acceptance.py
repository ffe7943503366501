"""Greedy draft acceptance per position on held-out ShareGPT prompts.

    python -m cluster.entrypoints.acceptance --config yamls/tiny.yaml --set parallel.tp_size=1 --set speculative.method=mtp

Runs static k (all drafts verified), so position j's rate is P(draft j accepted | drafts
before it accepted), the number the pruning decision estimates.
"""
from __future__ import annotations

import argparse
import json
import sys

from cluster.entrypoints.common import add_config_args, open_engine
from cluster.engine.request import RequestParams
from cluster.bench.sharegpt import heldout_prompts


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec acceptance", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    return p


def run(args: argparse.Namespace) -> int:
    args.overrides = ["speculative.adaptive.enabled=false"] + list(args.overrides)
    with open_engine(args) as engine:
        tok = engine.tokenizer
        prompts = [tok(p)["input_ids"][: args.max_prompt_tokens] for p in heldout_prompts(seed=0)[: args.num_prompts]]
        results = engine.generate(prompts, RequestParams(max_tokens=args.output_len, ignore_eos=True))
        st = engine.stats
        rates = [a / v if v else 0.0 for a, v in zip(st.accepted_per_position, st.verified_per_position)]
        out = {"method": engine.cfg.speculative.method, "k": engine.cfg.speculative.num_speculative_tokens,
               "prompts": len(prompts), "output_len": args.output_len,
               "acceptance_per_position": [round(r, 4) for r in rates],
               "acceptance_rate": round(st.accepted / max(st.verified, 1), 4),
               "acceptance_length": round(acceptance_length([r[0] for r in results]), 3)}
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


def acceptance_length(outputs) -> float:
    """Mean tokens emitted per sequence per decode step (the prefill's token excluded)."""
    tokens = sum(len(o.token_ids) - 1 for o in outputs)
    steps = sum(o.steps - 1 for o in outputs)
    return tokens / max(steps, 1)


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
