"""The Engine's link to the validate-time registry: it records measured steps, learns
which time-model version every rank holds (plans name only such versions), and reports
the model's state for metrics without ever blocking a scrape.

Two implementations of `TimeModelLink`: `LocalTimeModelLink` keeps the registry in the
driver (an in-process rank: refits are installed at once); `RayTimeModelLink` talks to the
profile actor (cluster/engine/profile_actor.py) without waiting on it in the step loop.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from cluster.engine.executor import WorkerGroup
from controller.registry import ProfileRegistry
from controller.samples import StepSample
from controller.time_model import TimeModel

log = logging.getLogger("adaspec.time_model")
POLL_EVERY = 4  # steps between looks at the acknowledged version
SEND_EVERY = 8  # samples buffered per message to the actor
ADD_EVERY = 64  # ... and per registry call in this process, at most a quarter of refit_every (refits stay timely)
# Once the engine has been idle (a server between requests), the registry's calls wait for the next idle spell,
# up to this many times ADD_EVERY samples: under load they run in the step loop as before
IDLE_DEFER = 8
CALL_TIMEOUT_S = 60.0  # blocking calls (refit, install: tests and operators) wait out an actor restart


@dataclass(frozen=True)
class TimeModelReport:
    version: int  # the newest version every rank acknowledged
    mae_ms: float | None  # error of the last fit over the points it kept
    mape: float | None
    # the last fit's (o0, o1, o2, o3): a step's rest outside drafting and validation; and v_drafted, what a
    # drafting step's validation costs more
    rest_ms: tuple | None = None


def rest_terms(model: TimeModel) -> tuple:
    return tuple(round(getattr(model, f), 5) for f in ("o0", "o1", "o2", "o3", "v_drafted"))


class TimeModelLink(Protocol):
    def record(self, samples: list[StepSample]) -> None:
        """Measured decode steps (rank 0's clock) for the registry."""

    def idle(self) -> None:
        """The engine has nothing to step: a moment for the registry's work that waits for one."""

    def poll(self, step: int) -> int:
        """The version plans may name from this step on (every rank holds it); never blocks."""

    def rebind(self, workers: WorkerGroup) -> int:
        """New ranks after a recovery: install the model in force; returns its version."""

    def force_refit(self) -> int:
        """Refit and install now; returns the new version."""

    def install(self, model: TimeModel) -> int:
        """Install a given model as the next version; returns it."""

    def report(self) -> TimeModelReport:
        """The last known state (version, fit error); never blocks."""


def make_time_model_link(workers: WorkerGroup, refit_every: int, model: TimeModel,
                         sweep: list[StepSample], kind: str = "linear") -> TimeModelLink:
    if workers.actors is None:
        return LocalTimeModelLink(refit_every, model, sweep, workers, kind)
    return RayTimeModelLink(refit_every, model, sweep, workers, kind)


class LocalTimeModelLink:
    """The registry in this process, for an in-process rank: refits are installed at once."""

    def __init__(self, refit_every: int, initial: TimeModel, sweep: list[StepSample], workers: WorkerGroup,
                 kind: str = "linear"):
        self._registry = ProfileRegistry(refit_every, initial, sweep, kind)
        self.workers = workers
        self.version = initial.version
        self._buffer: list[StepSample] = []
        self._add_every = max(1, min(ADD_EVERY, refit_every // 4))
        self._flush_at = self._add_every  # samples buffered before a call in the step loop (`idle` raises it)

    @property
    def registry(self) -> ProfileRegistry:
        """The registry, with every recorded sample in it."""
        self._flush()
        return self._registry

    def record(self, samples: list[StepSample]) -> None:
        """Buffered (up to ADD_EVERY samples per registry call): one call per step cost 29 us
        (median, batch 1, plain decoding), most of it the call's own, run cold after the forward;
        one per 8 steps still cost a batch-8 step about 5 us, one per 32 about 4 us a batch-8
        step standing down, one per 64 about 2.3."""
        self._buffer += samples
        if len(self._buffer) >= self._flush_at:
            self._flush()

    def idle(self) -> None:
        """The registry's call, with its refit, where the steps wait for no one. In an
        in-process served engine at 10% of saturation it had run in the step loop 24-28 times a
        round of 48 requests (12 s), 17-72 ms in all, one call up to 20 ms (a refit), each
        delaying every sequence in flight. From the first idle spell on, the step loop calls it
        only once IDLE_DEFER times as many samples wait (a server that is never idle)."""
        self._flush_at = self._add_every * IDLE_DEFER
        self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        samples, self._buffer = self._buffer, []
        model = self._registry.add(samples)
        if model is not None:
            self.version = self.workers.install_time_model(model)

    def poll(self, step: int) -> int:
        return self.version

    def rebind(self, workers: WorkerGroup) -> int:
        self.workers = workers
        self.version = workers.install_time_model(self.registry.model)
        return self.version

    def force_refit(self) -> int:
        self.version = self.workers.install_time_model(self.registry.refit().model)
        return self.version

    def install(self, model: TimeModel) -> int:
        self.version = self.workers.install_time_model(self.registry.adopt(model))
        return self.version

    def report(self) -> TimeModelReport:
        r = self.registry.last_report
        return TimeModelReport(self.version, r.mae_ms if r else None, r.mape if r else None,
                               rest_terms(r.model) if r else None)


class RayTimeModelLink:
    """The profile actor's client: fire-and-forget records, non-blocking polls that also
    refresh the cached report."""

    def __init__(self, refit_every: int, initial: TimeModel, sweep: list[StepSample], workers: WorkerGroup,
                 kind: str = "linear"):
        self.refit_every, self.sweep, self.model, self.kind = refit_every, sweep, initial, kind
        self.actor = self._start(initial, workers)
        self.status = TimeModelReport(initial.version, None, None)
        self._pending = None
        self._buffer: list[StepSample] = []

    @property
    def version(self) -> int:
        return self.status.version

    def _start(self, model: TimeModel, workers: WorkerGroup):
        import ray

        from cluster.engine.profile_actor import ProfileActor

        actor_cls = ray.remote(num_cpus=0, max_restarts=-1)(ProfileActor)
        # Held here for the actor's lifetime: Ray re-runs the constructor on a restart, and an
        # argument whose object went out of scope would make that restart fail.
        self._sweep_ref = ray.put(self.sweep)
        return actor_cls.remote(self.refit_every, model, self._sweep_ref, workers.actors, self.kind)

    def rebind(self, workers: WorkerGroup) -> int:
        """A new actor pushing to the new ranks, starting from the model in force."""
        import ray

        try:
            model = ray.get(self.actor.current_model.remote(), timeout=30)
        except ray.exceptions.RayError:
            model = self.model  # the actor is gone too: the newest model this link saw
        try:
            ray.kill(self.actor)
        except ray.exceptions.RayError:
            pass
        model = dataclasses.replace(model, version=max(model.version, self.version))
        workers.install_time_model(model)
        self.actor, self.model, self._pending = self._start(model, workers), model, None
        self.status = dataclasses.replace(self.status, version=model.version)
        return self.version

    def record(self, samples: list[StepSample]) -> None:
        self._buffer += samples
        if len(self._buffer) >= SEND_EVERY:
            self.actor.record.remote(self._buffer)
            self._buffer = []

    def idle(self) -> None:
        """Nothing waits here: the actor refits in its own process, sent a few samples at a time."""

    def poll(self, step: int) -> int:
        if step % POLL_EVERY == 0:
            self._refresh()
        return self.version

    def _refresh(self) -> None:
        """Take the actor's status if an earlier request has answered, else ask; never waits."""
        import ray

        try:
            if self._pending is None:
                self._pending = self.actor.status.remote()
            ready, _ = ray.wait([self._pending], timeout=0)
            if ready:
                self._update(ray.get(self._pending))
                self._pending = None
        except ray.exceptions.RayError as e:  # actor died: keep the last acknowledged version
            log.warning("profile actor unavailable (%s); planning with time model v%d", type(e).__name__, self.version)
            self._pending = None

    def _update(self, status: TimeModelReport) -> None:
        if status.version >= self.status.version:
            self.status = status

    def _blocking(self, submit: Callable) -> None:
        """Wait for an actor call (`submit()` returns its object ref), through a restart."""
        import ray

        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            try:
                self._update(ray.get(submit()))
                return
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def force_refit(self) -> int:
        self._blocking(lambda: self.actor.force_refit.remote())
        return self.version

    def install(self, model: TimeModel) -> int:
        self._blocking(lambda: self.actor.install.remote(model))
        return self.version

    def report(self) -> TimeModelReport:
        self._refresh()  # an idle engine polls no more: a scrape moves the status along itself
        return self.status
