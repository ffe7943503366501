"""The profile actor: the validate-time registry as a Ray actor that refits on its own
schedule and pushes each refit to every rank.

Rank 0's measured step times arrive without the Engine waiting (`record.remote`). When
the registry refits, the actor pushes the new model to every rank and waits for all of
them to acknowledge; only then does `status().version` move, and only then does the
Engine put the new version in its plans. So every rank holds a version before any plan
names it. If the actor dies, the Engine keeps planning with the last acknowledged
version, and Ray restarts the actor.
"""
from __future__ import annotations

import ray

from cluster.engine.time_model_link import TimeModelReport, rest_terms
from controller.registry import ProfileRegistry
from controller.samples import StepSample
from controller.time_model import TimeModel

RESTART_PROBE_TIMEOUT_S = 60


class ProfileActor:
    def __init__(self, refit_every: int, initial: TimeModel, sweep: list[StepSample], ranks: list,
                 kind: str = "linear"):
        # After a restart, continue from the newest version the ranks hold: a version
        # number is never reused for different coefficients.
        held = []
        for rank in ranks:
            try:
                held.append(ray.get(rank.current_time_model.remote(), timeout=RESTART_PROBE_TIMEOUT_S))
            except ray.exceptions.RayError:  # a dead rank: the Engine is rebuilding the group
                pass
        initial = max(held + [initial], key=lambda m: m.version)
        self.registry = ProfileRegistry(refit_every, initial, sweep, kind)
        self.ranks = ranks
        self.acked = initial.version

    def record(self, samples: list[StepSample]) -> None:
        model = self.registry.add(samples)
        if model is not None:
            self._push(model)

    def force_refit(self) -> TimeModelReport:
        """Refit now and push (tests, operators)."""
        self._push(self.registry.refit().model)
        return self.status()

    def install(self, model: TimeModel) -> TimeModelReport:
        """Push a given model (operators, tests) under the next version number."""
        self._push(self.registry.adopt(model))
        return self.status()

    def _push(self, model: TimeModel) -> None:
        ray.get([rank.install_time_model.remote(model) for rank in self.ranks])
        self.acked = model.version

    def status(self) -> TimeModelReport:
        r = self.registry.last_report
        return TimeModelReport(self.acked, r.mae_ms if r else None, r.mape if r else None,
                               rest_terms(r.model) if r else None)

    def current_model(self) -> TimeModel:
        return self.registry.model
