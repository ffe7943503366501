"""What every entry point shares: config arguments, logging, engine lifetime, and errors
printed as one line that names the problem."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Callable, Iterator, TextIO

from cluster.config import Config, ConfigError, load_config
from cluster.engine.request import RequestError


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (default: the embedded tiny setup)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, value parsed as YAML (repeatable): --set parallel.tp_size=1")
    p.add_argument("--log-level", default="WARNING")


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


@contextlib.contextmanager
def open_engine(args: argparse.Namespace, cfg: Config | None = None) -> Iterator["Engine"]:  # noqa: F821
    """An Engine (on the configured Ray, unless its one rank runs here); Ray is shut down again if
    this started it."""
    from cluster.engine.core import Engine
    from cluster.engine.ray_env import ensure_ray

    cfg = cfg or config_from_args(args)
    started = False if cfg.parallel.in_process else ensure_ray(cfg)  # a TP=1 in-process run needs no Ray
    engine = None
    try:
        engine = Engine(cfg)
        yield engine
    finally:
        if engine is not None:
            engine.shutdown()
        if started:
            import ray

            ray.shutdown()


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[TextIO]:
    """Inside, whatever anyone writes to file descriptor 1 (Python, Ray's log forwarding, C
    libraries, processes started meanwhile) goes to stderr; the stream it yields is the real
    stdout, for the command's own result, so `--json` output always parses."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(os.dup(saved), "w")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # sys.stdout may not be fd 1 (under pytest, say)
            yield real
    finally:
        real.flush()
        real.close()
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_cli(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(args, "log_level", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return fn(args)
    except (ConfigError, RequestError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"adaspec: error: {e}", file=sys.stderr)
        return 2
