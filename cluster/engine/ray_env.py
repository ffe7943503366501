"""Connect to Ray: an address from the config, or an embedded local instance."""
from __future__ import annotations

import math
import os

from cluster.config import Config

# Ray starts its worker processes at niceness 15, where every process at 0 (Ray's own daemons, the driver,
# a load's clients) preempts them mid-step: one client's served decode steps took 1.26x as long as the same
# engine in a driver. The engine actor and the TP rank actors ask for 0 in their runtime environment, as
# Ray's job supervisor does for a job's driver (the HTTP replica stays at 15).
NICE_0_ENV = {"RAY_worker_niceness": "0"}


def ensure_ray(cfg: Config, env: dict[str, str] | None = None) -> bool:
    """Initialise Ray if needed; returns True when this call started it. `env` is set for an
    embedded Ray's processes (Ray's own settings, read when they start); a Ray reached by
    address keeps its own."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")  # set inside `ray job submit`
    if address:
        ray.init(address=address, log_to_driver=False)
        return True
    p = cfg.parallel
    need = math.ceil(p.tp_size * max(p.num_cpus_per_worker, 0.01)) + 1  # ranks plus the driver
    os.environ.update(env or {})  # the raylet and every worker inherit it
    ray.init(num_cpus=cfg.cluster.num_cpus or need, include_dashboard=cfg.cluster.include_dashboard,
             _temp_dir=cfg.cluster.temp_dir, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0", **(env or {})}})
    return True
