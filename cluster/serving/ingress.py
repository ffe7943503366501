"""Ray Serve's direct ingress: the app's replica answers HTTP itself, with no proxy hop.

By default every request and every streamed chunk crosses Serve's proxy actor, which
took a quarter of this 2-core machine at 16 streaming clients (and the replica another
quarter). Ray Serve's throughput mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, Ray >= 2.55)
lets an application's ingress replica listen on a port of its own from
`RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT` up to (not including) `..._MAX_HTTP_PORT`. With it
(and the kernels' own thread pool) served plain decoding kept 0.69-0.81x of the offline
engine's speed at 1-64 clients, against 0.35-0.58x before (docs/bench-serve).

Serve's processes read these variables when they start, so they are set before an
embedded Ray starts (`ray_env`); a cluster of its own sets them in its environment. The
proxy still starts and binds `http_options`' port, so callers move it to a spare port
and give the replica's range the port users asked for. `app_url` says where an
application answers either way.
"""
from __future__ import annotations

import time

THROUGHPUT_MODE = "RAY_SERVE_THROUGHPUT_OPTIMIZED"


def ray_env(first_port: int, ports: int = 1) -> dict[str, str]:
    """Environment for an embedded Ray whose Serve apps listen on first_port.. (one port each)."""
    return {THROUGHPUT_MODE: "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first_port + ports),
            # a replica going away waits this long for load balancers to notice (default 30 s);
            # an embedded server has none
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def app_url(app_name: str, route_prefix: str, proxy_url: str, host: str = "127.0.0.1", timeout_s: float = 60.0) -> str:
    """The base URL of a running application: its replica's own port on `host` (the address
    it binds, `http_options`' host) under direct ingress, else the proxy's URL with the
    route prefix."""
    import ray
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    deadline = time.monotonic() + timeout_s
    while True:
        groups = ray.get(controller.get_target_groups.remote(app_name))
        http = [g for g in groups if str(getattr(g.protocol, "value", g.protocol)).upper() == "HTTP" and g.targets]
        replicas = [t for g in http for t in g.targets if g.app_name == app_name]
        if replicas:
            return f"http://{host}:{replicas[0].port}{route_prefix.rstrip('/')}"
        if http and not any(g.app_name for g in http):  # no direct ingress: the proxies serve it
            return proxy_url.rstrip("/") + route_prefix.rstrip("/")
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {app_name!r} has no running HTTP ingress after {timeout_s:.0f} s")
        time.sleep(0.2)
