"""The `adaspec` command: one subcommand per job, each with --config and --set."""
from __future__ import annotations

import argparse
import sys

from cluster.entrypoints import acceptance, generate, launch, profile, simulate
from cluster.entrypoints import serve as serve_cli
from cluster.bench import controller as bench_controller
from cluster.bench import estimators
from cluster.bench import offline as bench
from cluster.bench import paired as bench_paired
from cluster.bench import serving as bench_serve

COMMANDS = {"generate": generate, "bench": bench, "bench-serve": bench_serve, "bench-controller": bench_controller,
            "bench-paired": bench_paired, "profile": profile,
            "acceptance": acceptance, "estimators": estimators, "serve": serve_cli, "launch": launch,
            "simulate": simulate}


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    parser = argparse.ArgumentParser(prog="adaspec", description="Adaptive speculative decoding on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.build_parser(sub.add_parser(name, help=module.__doc__.strip().splitlines()[0]))
    args = parser.parse_args(argv)
    return run_cli(COMMANDS[args.command].run, args)


if __name__ == "__main__":
    sys.exit(main())
