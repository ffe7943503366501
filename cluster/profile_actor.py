"""The profile registry as a Ray actor, and the Engine's link to it.

Rank 0's measured step times go to the actor without waiting (`record.remote`). When the
registry refits, the actor pushes `(version, coefficients)` to every worker and waits for
all of them to acknowledge; only then does `acked_version` move, and only then does the
Engine put the new version in its plans. So every rank holds a version before any plan
names it. If the actor dies, the Engine keeps planning with the last acknowledged
version (and Ray restarts the actor; refits resume from the samples that follow).
"""
from __future__ import annotations

import dataclasses
import logging
import time

try:
    import ray
except ImportError:  # an in-process engine (TP=1) needs only LocalProfileLink, and runs without Ray
    ray = None

from controller.registry import ProfileRegistry, StepSample
from controller.time_model import TimeModel

log = logging.getLogger("adaspec.profile")
POLL_EVERY = 4  # steps between looks at the acknowledged version
SEND_EVERY = 8  # samples buffered per message to the actor


class ProfileActor:
    def __init__(self, refit_every: int, initial: TimeModel, sweep: list[StepSample], workers: list):
        # After a restart, continue from the newest version the workers hold: a version
        # number is never reused for different coefficients.
        held = []
        for w in workers:
            try:
                held.append(ray.get(w.current_time_model.remote(), timeout=60))
            except ray.exceptions.RayError:  # a dead rank: the Engine is rebuilding the group
                pass
        initial = max(held + [initial], key=lambda m: m.version)
        self.registry = ProfileRegistry(refit_every, initial)
        self.registry.sweep = list(sweep)
        self.workers = workers
        self.acked = initial.version

    def record(self, samples: list[StepSample]) -> None:
        model = self.registry.add(samples)
        if model is not None:
            self._push(model)

    def force_refit(self) -> int:
        """Refit now and push (tests, operators); returns the acknowledged version."""
        self._push(self.registry.refit().model)
        return self.acked

    def install(self, model: TimeModel) -> int:
        """Push a given model (operators, tests) under the next version number."""
        self._push(self.registry.adopt(model))
        return self.acked

    def _push(self, model: TimeModel) -> None:
        ray.get([w.install_time_model.remote(model) for w in self.workers])
        self.acked = model.version

    def acked_version(self) -> int:
        return self.acked

    def current_model(self) -> TimeModel:
        return self.registry.model

    def report(self) -> dict:
        r = self.registry.last_report
        return {"version": self.acked, "mae_ms": r.mae_ms if r else None, "mape": r.mape if r else None}


class LocalProfileLink:
    """In-process registry for a LocalWorkerGroup: refits are installed at once."""

    def __init__(self, refit_every: int, initial: TimeModel, sweep: list[StepSample], workers):
        self.registry = ProfileRegistry(refit_every, initial)
        self.registry.sweep = list(sweep)
        self.workers = workers
        self.version = initial.version

    def record(self, samples: list[StepSample]) -> None:
        model = self.registry.add(samples)
        if model is not None:
            self.version = max(self.workers.call("install_time_model", model))

    def poll(self, step: int) -> int:
        return self.version

    def rebind(self, workers) -> int:
        """New workers: install the model in force."""
        self.workers = workers
        self.version = max(workers.call("install_time_model", self.registry.model))
        return self.version

    def force_refit(self) -> int:
        self.version = max(self.workers.call("install_time_model", self.registry.refit().model))
        return self.version

    def install(self, model: TimeModel) -> int:
        self.version = max(self.workers.call("install_time_model", self.registry.adopt(model)))
        return self.version

    def report(self) -> dict:
        r = self.registry.last_report
        return {"version": self.version, "mae_ms": r.mae_ms if r else None, "mape": r.mape if r else None}


class RayProfileLink:
    """The Engine's side of the actor: fire-and-forget records, non-blocking polls."""

    def __init__(self, refit_every: int, initial: TimeModel, sweep: list[StepSample], workers):
        self.refit_every, self.sweep, self.model = refit_every, sweep, initial
        self.actor = self._start(initial, workers)
        self.version = initial.version
        self._pending = None
        self._buffer: list[StepSample] = []

    def _start(self, model: TimeModel, workers):
        actor_cls = ray.remote(num_cpus=0, max_restarts=-1)(ProfileActor)
        return actor_cls.remote(self.refit_every, model, self.sweep, workers.workers)

    def rebind(self, workers) -> int:
        """New workers: a new actor pushing to them, starting from the model in force."""
        try:
            model = ray.get(self.actor.current_model.remote(), timeout=30)
        except ray.exceptions.RayError:
            model = self.model  # the actor is gone too: the newest model this link saw
        try:
            ray.kill(self.actor)
        except ray.exceptions.RayError:
            pass
        model = dataclasses.replace(model, version=max(model.version, self.version))
        workers.call("install_time_model", model)
        self.actor, self.model, self.version, self._pending = self._start(model, workers), model, model.version, None
        return self.version

    def record(self, samples: list[StepSample]) -> None:
        self._buffer += samples
        if len(self._buffer) >= SEND_EVERY:
            self.actor.record.remote(self._buffer)
            self._buffer = []

    def poll(self, step: int) -> int:
        if step % POLL_EVERY:
            return self.version
        try:
            if self._pending is None:
                self._pending = self.actor.acked_version.remote()
            ready, _ = ray.wait([self._pending], timeout=0)
            if ready:
                self.version = max(self.version, ray.get(self._pending))
                self._pending = None
        except ray.exceptions.RayError as e:  # actor died: keep the last acknowledged version
            log.warning("profile actor unavailable (%s); planning with time model v%d", type(e).__name__, self.version)
            self._pending = None
        return self.version

    def _call(self, method: str, *args, timeout_s: float = 60.0):
        """A blocking call to the actor, waiting out a restart."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(getattr(self.actor, method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def force_refit(self) -> int:
        self.version = self._call("force_refit")
        return self.version

    def install(self, model: TimeModel) -> int:
        self.version = self._call("install", model)
        return self.version

    def report(self) -> dict:
        return self._call("report")
