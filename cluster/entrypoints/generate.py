"""`adaspec generate`: run prompts through the engine and print the outputs.

    python -m cluster.entrypoints.generate --config yamls/tiny.yaml --prompt "Tell me about Ray." --json
"""
from __future__ import annotations

import argparse
import json
import sys

from cluster.entrypoints.common import add_config_args, config_from_args, open_engine, stdout_to_stderr
from cluster.engine.request import RequestParams


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec generate", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise SystemExit("adaspec generate: give at least one --prompt or a --prompts-file")
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    params = RequestParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                           n=args.n)
    params.validate()  # refuse bad arguments before any worker starts
    cfg = config_from_args(args)
    with stdout_to_stderr() as out:  # Ray's own messages must not mix with the outputs
        with open_engine(args, cfg) as engine:
            results = engine.generate(prompts, params)
        write_outputs(out, args.json, cfg.parallel.tp_size, prompts, results)
    return 0


def write_outputs(out, as_json: bool, tp_size: int, prompts: list[str], results) -> None:
    if as_json:
        outputs = [{"prompt": prompt, "prompt_token_ids": o.prompt_ids, "token_ids": o.token_ids, "text": o.text,
                    "finish_reason": o.finish_reason, "seed": o.seed, "steps": o.steps, "drafted": o.drafted,
                    "verified": o.verified, "accepted": o.accepted}
                   for prompt, samples in zip(prompts, results) for o in samples]
        json.dump({"tp_size": tp_size, "outputs": outputs}, out)
        out.write("\n")
        return
    for prompt, samples in zip(prompts, results):
        for o in samples:
            out.write(f"--- {prompt!r}\n{o.text}\n\n")


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
