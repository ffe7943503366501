"""`adaspec serve`: the OpenAI-compatible server on Ray Serve, until Ctrl-C.

Starts Ray if needed (embedded unless `cluster.address` is set), then Serve's HTTP proxy
and the app; prints the endpoints and waits. SIGINT/SIGTERM shut Serve down, and the Ray
instance too when this command started it.

    adaspec serve --config yamls/tiny.yaml --port 8000 --api-key sk-local
    python -m cluster.entrypoints.serve --config yamls/tiny.yaml --set parallel.tp_size=1
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import dataclass

from cluster.entrypoints.common import add_config_args
from cluster.config import Config, load_config

APP_NAME = "adaspec"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec serve", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    add_http_args(p)
    return p


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to bind (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default: serve.port, 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")


def http_overrides(args: argparse.Namespace) -> list[str]:
    """--host/--port/--api-key as `serve.*` overrides, so the replica sees the same config."""
    out = []
    for key, value in (("host", args.host), ("port", args.port), ("api_key", args.api_key)):
        if value is not None:
            out.append(f"serve.{key}={value!r}" if isinstance(value, str) else f"serve.{key}={value}")
    return out


@dataclass
class Serving:
    """What `start` brought up, for `stop`."""

    cfg: Config
    url: str
    started_ray: bool


def start(config: str | None, overrides: list[str]) -> Serving:
    """Ray (embedded unless cluster.address is set) and the app, answering on serve.port: its
    replica itself with serve.direct_ingress on an embedded Ray, else Serve's proxy."""
    import ray
    from ray import serve

    from cluster.engine.ray_env import ensure_ray
    from cluster.serving import ingress
    from cluster.serving.app import build_app, resolve_config_path
    from workers.worker import free_port

    config = resolve_config_path(config)
    cfg = load_config(config, overrides)
    direct = cfg.serve.direct_ingress and not ray.is_initialized() and not (cfg.cluster.address or
                                                                             os.environ.get("RAY_ADDRESS"))
    started = ensure_ray(cfg, ingress.ray_env(cfg.serve.port) if direct else None)
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    proxy_port = free_port() if direct else cfg.serve.port  # Serve's proxy starts either way
    try:
        serve.start(http_options={"host": cfg.serve.host, "port": proxy_port})
        serve.run(build_app({"config": config, "overrides": overrides}), name=APP_NAME, route_prefix="/",
                  blocking=False)
        url = ingress.app_url(APP_NAME, "/", f"http://{host}:{proxy_port}", host)
    except BaseException:
        stop(Serving(cfg, "", started))
        raise
    return Serving(cfg, url, started)


def stop(serving: Serving) -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        if serving.started_ray:
            ray.shutdown()


def print_endpoints(serving: Serving) -> None:
    from cluster.serving.app import served_model_name

    cfg, url = serving.cfg, serving.url
    print(f"adaspec: serving {served_model_name(cfg)!r} (TP={cfg.parallel.tp_size}, {cfg.parallel.device}) at {url}")
    print(f"  POST {url}/v1/completions   POST {url}/v1/chat/completions   GET {url}/v1/models")
    print(f"  GET  {url}/health   GET {url}/metrics" + ("   (API key required)" if cfg.serve.api_key else ""))
    print("  Ctrl-C to stop", flush=True)


def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; returns the signal number."""
    got: list[int] = []
    done = threading.Event()

    def handler(signum, _frame):
        got.append(signum)
        done.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(1.0):
            pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return got[0]


def serve_until_signal(config: str | None, overrides: list[str], announce) -> int:
    """Start serving, `announce(serving)`, wait for SIGINT/SIGTERM, then stop cleanly."""
    serving = start(config, overrides)
    try:
        announce(serving)
        wait_for_signal()
        print("adaspec: shutting down", flush=True)
    finally:
        stop(serving)
    return 0


def run(args: argparse.Namespace) -> int:
    return serve_until_signal(args.config, list(args.overrides) + http_overrides(args), print_endpoints)


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
