"""The TP ranks as one group: Ray actors in a placement group, or (TP=1, the default
executor) one worker in the driver process. `WorkerGroup` is everything the Engine and the
startup sweep may ask of the ranks; every call reaches every rank."""
from __future__ import annotations

from typing import Any, Protocol

from cluster.engine.ray_env import NICE_0_ENV
from controller.catchup import SWEEP_CATCHUP
from controller.time_model import TimeModel
from workers.plan import StepPlan, StepResult
from workers.worker import TPWorker

MIN_BUNDLE_CPU = 0.01  # Ray bundles need some resource; ranks may share cores on small hosts


class WorkerGroup(Protocol):
    actors: list[Any] | None  # the ranks' Ray actor handles (None: the rank runs in this process)

    def step(self, plan: StepPlan) -> list[StepResult]:
        """One plan to every rank; results by rank."""

    def install_time_model(self, model: TimeModel) -> int:
        """Install a refit on every rank; returns its version once all acknowledged."""

    def validate_ms(self, n: int, q: int, ctx: int, runs: int) -> float:
        """Time a validate forward of n sequences x q tokens at context ctx (all ranks at once; rank 0's clock)."""

    def draft_ms(self, n: int, ctx: int, steps: int, runs: int, catchup: int = SWEEP_CATCHUP) -> float:
        """Time a decode step's `steps` draft positions for n sequences, after a catch-up of `catchup`
        tokens each (all ranks at once; rank 0's clock)."""

    def shutdown(self) -> None: ...


class LocalWorkerGroup:
    """TP=1 in the driver process: no Ray, same TPWorker code."""

    actors = None

    def __init__(self, model, spec, parallel, cache):
        if parallel.tp_size != 1:
            raise ValueError("LocalWorkerGroup runs parallel.tp_size=1 only")
        self.worker = TPWorker(0, model, spec, parallel, cache)
        self.worker.init("127.0.0.1", 0)

    def step(self, plan: StepPlan) -> list[StepResult]:
        return [self.worker.step(plan)]

    def install_time_model(self, model: TimeModel) -> int:
        return self.worker.install_time_model(model)

    def validate_ms(self, n: int, q: int, ctx: int, runs: int) -> float:
        return self.worker.validate_ms(n, q, ctx, runs)

    def draft_ms(self, n: int, ctx: int, steps: int, runs: int, catchup: int = SWEEP_CATCHUP) -> float:
        return self.worker.draft_ms(n, ctx, steps, runs, catchup)

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayWorkerGroup:
    """One Ray actor per rank, gang-scheduled in a placement group."""

    def __init__(self, model, spec, parallel, cache):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": max(parallel.num_cpus_per_worker, MIN_BUNDLE_CPU)}
        if parallel.device == "cuda":
            bundle["GPU"] = 1
        elif parallel.device == "npu":
            bundle["NPU"] = 1
        self.pg = placement_group([dict(bundle) for _ in range(parallel.tp_size)], strategy=parallel.placement_strategy)
        ray.get(self.pg.ready(), timeout=300)
        actor_cls = ray.remote(TPWorker)
        env = {"OMP_NUM_THREADS": str(parallel.threads()), **NICE_0_ENV}  # ranks at the driver's priority
        self.actors = [
            actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                resources={"NPU": 1} if "NPU" in bundle else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env},
            ).remote(rank, model, spec, parallel, cache)
            for rank in range(parallel.tp_size)
        ]
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        ray.get([w.init.remote(addr, port) for w in self.actors])
        self.use_compiled = parallel.compiled_dag
        self.dag = None  # compiled on the first step, after the startup sweep's calls

    def step(self, plan: StepPlan) -> list[StepResult]:
        """Through a Ray Compiled Graph (shared-memory channels, no per-call task
        submission), or one `.remote` per rank."""
        import ray

        if not self.use_compiled:
            return ray.get([w.step.remote(plan) for w in self.actors])
        if self.dag is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                self.dag = MultiOutputNode([w.step.bind(inp) for w in self.actors]).experimental_compile()
        return ray.get(self.dag.execute(plan))

    def install_time_model(self, model: TimeModel) -> int:
        import ray

        return min(ray.get([w.install_time_model.remote(model) for w in self.actors]))

    def validate_ms(self, n: int, q: int, ctx: int, runs: int) -> float:
        import ray

        return ray.get([w.validate_ms.remote(n, q, ctx, runs) for w in self.actors])[0]

    def draft_ms(self, n: int, ctx: int, steps: int, runs: int, catchup: int = SWEEP_CATCHUP) -> float:
        import ray

        return ray.get([w.draft_ms.remote(n, ctx, steps, runs, catchup) for w in self.actors])[0]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.dag is not None:
            self.dag.teardown()
            self.dag = None
        for w in self.actors:
            ray.kill(w)
        remove_placement_group(self.pg)


def make_worker_group(cfg) -> WorkerGroup:
    """The ranks: Ray actors in a placement group, or (parallel.executor, TP=1) this process."""
    if cfg.parallel.in_process:
        return LocalWorkerGroup(cfg.model, cfg.speculative, cfg.parallel, cfg.cache)
    from cluster.engine.ray_env import ensure_ray

    ensure_ray(cfg)
    return RayWorkerGroup(cfg.model, cfg.speculative, cfg.parallel, cfg.cache)
