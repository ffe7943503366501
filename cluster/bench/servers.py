"""The arms' servers for `adaspec bench-serve` (cluster/bench/serving.py): ours, each arm
bench.serve_replicas Ray Serve applications (`adaspec serve`'s app) with the arm's config
overrides; vLLM's OpenAI server for its arms; and `running`, which lets an arm's processes
run only while it is measured (SIGSTOP otherwise)."""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cluster.bench.vllm_peer import PausablePids
from cluster.config import ConfigError

ARM_PATTERN = re.compile(r"^(nospec|static-(\d+)|adaptive-(\d+))$")
VLLM_ARM_PATTERN = re.compile(r"^vllm-(nospec|draft-(\d+))$")


@dataclass
class Target:
    """One arm's server: where to send requests and under which model name."""

    arm: str
    url: str
    model: str | None
    settle_s: float = 0.0  # untimed pause after measuring it (a peer that keeps polling)
    server: object = None  # its processes, stopped between its measurements (vllm_peer.Pausable)
    replica: int = 0  # which of the arm's servers (bench.serve_replicas)


def arm_overrides(arm: str) -> list[str]:
    """Config overrides that make our server run `arm` (nospec, static-K, adaptive-K)."""
    m = ARM_PATTERN.match(arm)
    if not m:
        raise ConfigError(f"bench.serve_arms: {arm!r} is not nospec, static-K or adaptive-K")
    if arm == "nospec":
        return ["speculative.enabled=false"]
    k = int(m.group(2) or m.group(3))
    return ["speculative.enabled=true", f"speculative.num_speculative_tokens={k}",
            f"speculative.adaptive.enabled={'true' if arm.startswith('adaptive') else 'false'}"]


@contextlib.contextmanager
def running(target: Target):
    """A server runs only while it is measured (its processes are stopped otherwise): an idle
    arm's wakeups (Serve's health checks and metrics, Ray's core worker threads) would
    otherwise land on the cores the measured one's kernels run on."""
    if target.server is not None:
        target.server.resume()
    try:
        yield
    finally:
        if target.server is not None:
            target.server.pause()


PORT_RANGE = 64  # ports the arms' replicas may take (ports in use are skipped)
PAUSED_HEALTH_CHECK_TIMEOUT_S = 24 * 3600.0  # a replica stopped while other arms run answers its check later


class OurServers:
    """`replicas` Ray Serve applications per arm (the app `adaspec serve` runs), each a process of its
    own: route prefix /<arm>, then /<arm>.r1, /<arm>.r2, ..."""

    def __init__(self, cfg, config: str | None, overrides: list[str], arms: list[str], trace: str | None,
                 replicas: int = 1):
        from ray import serve

        from cluster.engine.ray_env import ensure_ray
        from cluster.serving import ingress
        from cluster.serving.app import build_app, resolve_config_path, served_model_name
        from workers.worker import free_port

        # each arm's replica answers on a port of its own (serve.direct_ingress), as `adaspec serve`'s
        direct = ingress.ray_env(free_port(), PORT_RANGE) if cfg.serve.direct_ingress else None
        self.started_ray = ensure_ray(cfg, direct)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.targets = []
        config = resolve_config_path(config)
        apps = [(arm, r, arm if r == 0 else f"{arm}.r{r}") for arm in arms for r in range(replicas)]
        for arm, r, app in tqdm(apps, desc="starting our servers", mininterval=2):
            extra = arm_overrides(arm)
            if trace:
                t = Path(trace)
                extra += [f"engine.trace_path={t.with_name(f'{t.stem}.{app}{t.suffix}')}", f"engine.trace_label={app}"]
            serve.run(build_app({"config": config, "overrides": list(overrides) + extra},
                                health_check_timeout_s=PAUSED_HEALTH_CHECK_TIMEOUT_S), name=app,
                      route_prefix=f"/{app}", blocking=False)
            url = ingress.app_url(app, f"/{app}", f"http://127.0.0.1:{port}")
            self.targets.append(Target(arm, url, served_model_name(cfg), replica=r))
        for t, (_, _, app) in zip(self.targets, apps):  # each server's processes, stopped between its measurements
            t.server = PausablePids(_replica_pids(app))

    def close(self) -> None:
        import ray
        from ray import serve

        for t in self.targets:
            t.server.resume()  # a stopped replica would hold up Serve's shutdown
        serve.shutdown()
        if self.started_ray:
            ray.shutdown()


def _replica_pids(app: str) -> list[int]:
    """The processes of an application's replica and its engine. (The direct-ingress settings make
    handles route on the caller's event loop by default; this one, called without one, routes on
    its own.)"""
    from ray import serve

    handle = serve.get_app_handle(app)
    handle._init(_run_router_in_separate_loop=True)
    return handle.pids.remote().result()


def vllm_servers(cfg, out_dir: Path) -> list:
    from cluster.bench.vllm_peer import VLLMServer

    bench, servers = cfg.bench, []
    try:
        for arm in tqdm(bench.serve_vllm_arms, desc="starting vLLM servers", mininterval=2):
            m = VLLM_ARM_PATTERN.match(arm)
            if not m:
                raise ConfigError(f"bench.serve_vllm_arms: {arm!r} is not vllm-nospec or vllm-draft-K")
            k = int(m.group(2) or 0)
            servers.append(VLLMServer(bench.vllm_python, cfg.model.target, cfg.model.draft if k else None, k,
                                      cfg.engine.max_num_seqs, bench.max_prompt_len + bench.max_output_len + 8, arm,
                                      out_dir / "logs" / f"vllm-serve-{arm}.log", bench.vllm_env))
    except BaseException:
        for s in servers:
            s.close()
        raise
    return servers
