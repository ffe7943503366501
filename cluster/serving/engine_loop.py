"""EngineLoop: an Engine stepped by its own thread, for serving. Other threads reach the
Engine only through `call` (under the lock, let in ahead of the next step) and collect
what the steps produced with `poll`, a long poll that returns every update since the last
one, coalesced per sample: a slow reader gets fewer, larger updates instead of a backlog.
A poll may ask for a pause since the last one (fewer, larger chunks); a sample's first text
and its end are let through at once, since a client waits on each, and alone: the other
samples' updates keep coalescing until the pause is over. (Letting everything through with
them made the pause moot under load: at 64 clients a request starts or ends nearly every
step, so every sample went out every step.)

Requests may also be queued without waiting for the engine (`submit`): the loop thread
applies everything queued at the start of each step. A caller that waits on the lock for
the step to end instead (as the channel's reader did) reads the requests that arrive
meanwhile only after it, when the next step has begun: in a served burst of 48 requests,
half of them waited one step more (40 ms at 512 prompt tokens a step).

It runs inside the engine actor (cluster/serving/engine_client.py), a process of its own,
so the model never shares an interpreter lock with the HTTP event loop.
"""
from __future__ import annotations

import logging
import threading
import time

from cluster.engine.request import RequestError, RequestOutput, RequestParams, coalesce

log = logging.getLogger("adaspec.engine_loop")
IDLE_WAIT_S = 0.005  # pause when the engine has work but could schedule nothing


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no new requests are taken."""


class EngineLoop:
    def __init__(self, engine, threads: int = 0):
        """threads: the kernels' threads for the in-process rank (0: leave its setting)."""
        self.engine = engine
        self.threads = threads
        self.error: BaseException | None = None
        self._cond = threading.Condition()  # guards the Engine
        self._callers = 0  # threads waiting to call into the Engine: the loop lets them in first
        self._callers_lock = threading.Lock()
        self._stopped = False
        self._inbox: list[tuple[list[tuple], object]] = []  # (requests, done) queued by submit
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()  # set when the loop may have something to do
        self._wake.set()  # the engine may hold work already
        self._outbox: dict[tuple[str, int], RequestOutput] = {}
        self._outbox_cond = threading.Condition()
        self._urgent: set[tuple[str, int]] = set()  # samples whose first text or end is in the outbox
        self._texted: set[tuple[str, int]] = set()  # samples whose text has started
        self._returned = 0.0  # when the last full poll returned (not one that took only first texts and ends)
        self._thread = threading.Thread(target=self._run, name="adaspec-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def call(self, fn, *args):
        """fn(*args) under the engine lock, ahead of the loop's next step."""
        with self._callers_lock:
            self._callers += 1
        try:
            with self._cond:
                return fn(*args)
        finally:
            with self._callers_lock:
                self._callers -= 1
            with self._cond:
                self._cond.notify_all()
            self._wake.set()

    def submit(self, requests: list[tuple], done) -> None:
        """Queue adds and aborts, ("add", request_id, prompt, params) and ("abort", request_id),
        without waiting for the engine: the loop thread applies them in order before its next
        step, then calls done(errors) there, with per add None or the RequestError or
        EngineDeadError that refused it. done must not block."""
        with self._inbox_lock:
            self._inbox.append((requests, done))
        self._wake.set()

    def add(self, request_id: str, prompt: str | list[int], params: RequestParams) -> None:
        """Queue a request; raises RequestError for bad input, EngineDeadError when stopped."""
        self.call(self._add, request_id, prompt, params)

    def abort(self, request_id: str) -> int:
        """Drop a request's samples (its client went away); their updates stop."""
        return self.call(self._abort, request_id)

    def poll(self, timeout_s: float, interval_s: float = 0.0) -> list[RequestOutput]:
        """Every update since the last full poll: per sample the newest output, its
        new_token_ids holding all tokens since the sample's last update. Returns once there
        are updates and interval_s has passed since the last full poll returned, and after
        timeout_s with whatever there is (perhaps nothing). Before that, a first text or an
        end returns at once with only the samples that have one."""
        start = time.monotonic()
        ready_at, give_up = self._returned + interval_s, start + timeout_s
        with self._outbox_cond:
            while True:
                now = time.monotonic()
                due = bool(self._outbox) and now >= ready_at
                if not self.is_alive() or self._urgent or due or now >= give_up:
                    break
                self._outbox_cond.wait((min(ready_at, give_up) if self._outbox else give_up) - now)
            if not self._outbox and not self.is_alive():
                raise EngineDeadError(f"the engine loop stopped: {self.error!r}")
            if self._urgent and not due and self.is_alive():
                updates = [self._outbox.pop(key) for key in self._urgent]
            else:
                updates, self._outbox = list(self._outbox.values()), {}
                self._returned = time.monotonic()
            self._urgent = set()
        return updates

    def is_alive(self) -> bool:
        return self.error is None and not self._stopped and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._wake.set()
        self._thread.join(timeout)
        with self._outbox_cond:
            self._outbox_cond.notify_all()

    # ------------------------------------------------------------------ the loop thread
    def _add(self, request_id: str, prompt, params: RequestParams) -> None:
        if not self.is_alive():
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        self.engine.add_request(prompt, params, request_id=request_id)

    def _try_add(self, request_id: str, prompt, params: RequestParams) -> Exception | None:
        try:
            self._add(request_id, prompt, params)
        except (RequestError, EngineDeadError) as e:
            return e
        return None

    def _abort(self, request_id: str) -> int:
        dropped = self.engine.abort(request_id)
        with self._outbox_cond:
            self._texted = {key for key in self._texted if key[0] != request_id}
        return dropped

    def _apply_inbox(self) -> None:
        with self._inbox_lock:
            queued, self._inbox = self._inbox, []
        for requests, done in queued:
            errors = []
            for kind, request_id, *rest in requests:
                if kind == "add":
                    errors.append(self._try_add(request_id, *rest))
                else:
                    self._abort(request_id)
            done(errors)

    def _run(self) -> None:
        if self.threads:
            from models import kernels

            kernels.set_threads(self.threads)
        try:
            while True:
                self._wake.wait()
                with self._cond:
                    self._cond.wait_for(lambda: self._stopped or self._callers == 0)  # callers go first
                    if self._stopped:
                        return
                    self._wake.clear()  # before taking the inbox: a submit from now on wakes the next round
                    self._apply_inbox()
                    if not self.engine.has_work():
                        continue
                    steps = self.engine.stats.steps
                    outputs = self.engine.step()
                    if self.engine.stats.steps == steps:  # nothing could be scheduled: don't spin
                        self._cond.wait(IDLE_WAIT_S)
                    if self.engine.has_work():
                        self._wake.set()
                self._publish(outputs)
                if not self._wake.is_set():  # nothing left to step, nothing submitted: an idle spell
                    self._idle()
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear about it
            log.exception("engine loop stopped")
            self.error = e
            with self._outbox_cond:
                self._outbox_cond.notify_all()

    def _idle(self) -> None:
        """Engine.idle once the last step's outputs are out, unless a caller or a submit came
        first: what it runs (the time-model registry's calls) then delays no step."""
        with self._cond:
            if not (self._stopped or self._callers or self._wake.is_set() or self.engine.has_work()):
                self.engine.idle()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        textless = self.engine.decoder is None  # token ids only: the first update is the first "text"
        with self._outbox_cond:
            wake = not self._outbox  # else a waiting poll has its own deadline: no need to wake it every step
            for out in outputs:
                key = (out.request_id, out.sample_index)
                if out.finished:
                    self._urgent.add(key)
                    self._texted.discard(key)
                elif key not in self._texted and (out.text or textless):
                    self._urgent.add(key)
                    self._texted.add(key)
                earlier = self._outbox.get(key)
                if earlier is not None:
                    out = coalesce(earlier, out)
                self._outbox[key] = out
            if wake or self._urgent:
                self._outbox_cond.notify_all()
