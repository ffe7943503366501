"""`adaspec launch`: start or attach to a Ray cluster and serve a config on it.

Starts Ray here or attaches to `cluster.address`; the Engine reserves the TP ranks'
placement group (`parallel.placement_strategy`: STRICT_PACK on one node, SPREAD across
nodes) and starts the rank actors and the profile actor inside the Serve replica. Prints
the cluster layout and the endpoints, then waits like `adaspec serve`.

    adaspec launch yamls/tp16.yaml
    adaspec launch yamls/tiny.yaml --set cluster.address=auto --set parallel.placement_strategy=SPREAD
"""
from __future__ import annotations

import argparse
import sys

from cluster.entrypoints.common import add_config_args
from cluster.entrypoints.serve import Serving, add_http_args, http_overrides, print_endpoints, serve_until_signal


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="adaspec launch", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config_file", metavar="CONFIG.yaml", help="the config to launch (e.g. yamls/tp16.yaml)")
    add_config_args(p)
    add_http_args(p)
    return p


def rank_layout(tp_size: int) -> list[str]:
    """Node of each rank of the engine's placement group (the newest group of tp_size bundles)."""
    import ray
    from ray.util import placement_group_table

    groups = [g for g in placement_group_table().values()
              if g.get("state") == "CREATED" and len(g.get("bundles", {})) == tp_size]
    if not groups:
        return []
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    bundle_nodes = groups[-1].get("bundles_to_node_id", {})
    return [nodes.get(bundle_nodes.get(i), "?") for i in range(tp_size)]


def print_cluster(serving: Serving) -> None:
    import ray

    p = serving.cfg.parallel
    alive = [n for n in ray.nodes() if n.get("Alive")]
    cpus = sum(n.get("Resources", {}).get("CPU", 0) for n in alive)
    print(f"adaspec: Ray cluster with {len(alive)} node(s), {cpus:g} CPUs"
          + (f" at {serving.cfg.cluster.address}" if serving.cfg.cluster.address else " (started here)"))
    if p.in_process:
        print(f"  TP=1: the rank runs in the serving replica's process (parallel.executor={p.executor})")
    else:
        layout = rank_layout(p.tp_size)
        hosts = ", ".join(f"rank {r}@{h}" for r, h in enumerate(layout)) or "layout unavailable"
        print(f"  TP={p.tp_size} ranks, placement {p.placement_strategy}: {hosts}")
    dashboard = dashboard_url()
    if dashboard:
        print(f"  Ray dashboard: http://{dashboard}   (ray job submit --address http://{dashboard} ...)")


def dashboard_url() -> str | None:
    try:
        from ray._private.worker import get_dashboard_url

        return get_dashboard_url() or None
    except Exception:  # noqa: BLE001 - the dashboard is optional
        return None


def run(args: argparse.Namespace) -> int:
    if args.config and args.config != args.config_file:
        raise ValueError(f"give the config once: {args.config_file!r} and --config {args.config!r} differ")
    def announce(serving: Serving) -> None:
        print_cluster(serving)
        print_endpoints(serving)

    return serve_until_signal(args.config_file, list(args.overrides) + http_overrides(args), announce)


def main(argv: list[str] | None = None) -> int:
    from cluster.entrypoints.common import run_cli

    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
