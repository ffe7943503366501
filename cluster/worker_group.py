"""The TP ranks as one group: Ray actors in a placement group, or (TP=1, the default
executor) one worker in the driver process. `step` sends the same plan to every rank."""
from __future__ import annotations

from workers.plan import StepPlan, StepResult
from workers.worker import TPWorker

MIN_BUNDLE_CPU = 0.01  # Ray bundles need some resource; ranks may share cores on small hosts


class LocalWorkerGroup:
    """TP=1 in the driver process: no Ray, same TPWorker code."""

    def __init__(self, model, spec, parallel, cache):
        if parallel.tp_size != 1:
            raise ValueError("LocalWorkerGroup runs parallel.tp_size=1 only")
        self.worker = TPWorker(0, model, spec, parallel, cache)
        self.worker.init("127.0.0.1", 0)

    def step(self, plan: StepPlan) -> list[StepResult]:
        return [self.worker.step(plan)]

    def call(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

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
        env = {"OMP_NUM_THREADS": str(parallel.threads())}
        self.workers = [
            actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                resources={"NPU": 1} if "NPU" in bundle else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env},
            ).remote(rank, model, spec, parallel, cache)
            for rank in range(parallel.tp_size)
        ]
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        ray.get([w.init.remote(addr, port) for w in self.workers])
        self.use_compiled = parallel.compiled_dag
        self.dag = None  # compiled on the first step, after the startup profile calls

    def step(self, plan: StepPlan) -> list[StepResult]:
        """One plan to every rank: through a Ray Compiled Graph (shared-memory channels,
        no per-call task submission), or one `.remote` per rank."""
        import ray

        if not self.use_compiled:
            return ray.get([w.step.remote(plan) for w in self.workers])
        if self.dag is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                self.dag = MultiOutputNode([w.step.bind(inp) for w in self.workers]).experimental_compile()
        return ray.get(self.dag.execute(plan))

    def call(self, method: str, *args) -> list:
        """Run a TPWorker method on every rank at once; results by rank."""
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.dag is not None:
            self.dag.teardown()
            self.dag = None
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
