"""The serving replica's engine, in a process of its own.

`EngineActor` is a Ray actor holding the Engine and its EngineLoop thread (TP=1 runs its
rank right there; larger TP sizes start their worker actors from it). `EngineClient`, in
the HTTP replica, gives each request an asyncio stream of RequestOutput updates. One
poller task per replica reads the actor's update stream (`EngineActor.updates`, a Ray
generator: one call for the replica's life): each item holds the updates of every request
since the last, so the HTTP side never carries one object per token and the model's process
never waits on the HTTP event loop's interpreter lock. Items come at most every
`serve.stream_interval_ms`, except that a first text or an end comes at once.

Requests are tokenized in the replica; a request whose client goes away is aborted in the
engine (`EngineClient.abort`, called by the routes when a stream is closed early).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from cluster.config import Config
from cluster.engine.ray_env import NICE_0_ENV
from cluster.engine.request import RequestOutput, RequestParams
from cluster.serving.engine_loop import EngineDeadError, EngineLoop

log = logging.getLogger("adaspec.engine_client")
POLL_WAIT_S = 1.0  # a poll with nothing to bring returns after this long
MAX_CONCURRENT_CALLS = 32  # actor threads: the update stream, adds, aborts and metric scrapes
UNREAD_BATCHES = 4  # the update stream waits once this many batches are unread: the outbox coalesces meanwhile
SWITCH_INTERVAL_S = 0.001


class EngineActor:
    """(a Ray actor) The Engine and its stepping thread. Request errors come back as
    values, so the replica re-raises them exactly (param, Retry-After)."""

    def __init__(self, cfg: Config):
        import sys

        from cluster.engine.core import Engine

        # Ray's threads here (polls, adds) take the interpreter lock between the loop's steps:
        # hand it over within 1 ms, not Python's default 5
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.loop = EngineLoop(Engine(cfg), threads=cfg.serve.engine_threads)

    def info(self) -> dict:
        import os

        return {"max_model_len": self.loop.engine.max_model_len, "niceness": os.getpriority(os.PRIO_PROCESS, 0)}

    def add(self, request_id: str, prompt: list[int], params: RequestParams) -> Exception | None:
        from cluster.engine.request import RequestError

        try:
            self.loop.add(request_id, prompt, params)
        except (RequestError, EngineDeadError) as e:
            return e
        return None

    def abort(self, request_id: str) -> int:
        return self.loop.abort(request_id)

    def updates(self, timeout_s: float, interval_s: float):
        """(a streaming generator) every poll's updates, for as long as the engine runs; raises
        EngineDeadError once the loop has stopped and nothing is left to bring."""
        while True:
            batch = self.loop.poll(timeout_s, interval_s)
            if batch:
                yield batch

    def state(self):
        from cluster.serving.metrics import engine_state

        return self.loop.call(engine_state, self.loop.engine)

    def is_alive(self) -> bool:
        return self.loop.is_alive()

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.loop.engine.shutdown()


@dataclass
class RequestStream:
    """The updates of one request (all of its `n` samples), in engine order."""

    request_id: str
    n: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: set = field(default_factory=set)  # sample indices done

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        done: set[int] = set()
        while len(done) < self.n:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                done.add(item.sample_index)
            yield item

    async def final(self) -> list[RequestOutput]:
        """Consume the stream; the finished output of each sample, by sample index."""
        last: dict[int, RequestOutput] = {}
        async for out in self:
            last[out.sample_index] = out
        return [last[i] for i in range(self.n)]

    @property
    def done(self) -> bool:
        return len(self.finished) == self.n


class EngineClient:
    """The replica's side: starts the engine actor and routes its updates to streams."""

    def __init__(self, cfg: Config, tokenizer):
        import ray

        self.tokenizer = tokenizer
        actor_cls = ray.remote(EngineActor).options(num_cpus=0, max_concurrency=MAX_CONCURRENT_CALLS,
                                                    max_restarts=0, runtime_env={"env_vars": NICE_0_ENV})
        self.actor = actor_cls.remote(cfg)
        self.info = ray.get(self.actor.info.remote())  # waits for the model to load (and the startup sweep)
        self.error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._counter = itertools.count()
        self._poller: asyncio.Task | None = None
        self.poll_interval_s = cfg.serve.stream_interval_ms / 1e3

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    # ------------------------------------------------------------------ requests
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize here, in the replica (on its event loop: the tokenizer is not shared)."""
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    async def add(self, prompt: str | list[int], params: RequestParams) -> RequestStream:
        """Queue a request; raises RequestError for bad input, EngineDeadError when stopped."""
        if self.error is not None:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        if isinstance(prompt, str):
            from cluster.engine.request import RequestError

            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send token ids", "prompt")
            prompt = self.encode(prompt)
        self._start_poller()
        stream = RequestStream(f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}", params.n)
        self._streams[stream.request_id] = stream  # before the add: its first update may be in the next poll
        try:
            error = await self.actor.add.remote(stream.request_id, prompt, params)
        except Exception as e:  # noqa: BLE001 - the actor is gone
            self._streams.pop(stream.request_id, None)
            raise EngineDeadError(f"the engine actor is gone: {type(e).__name__}: {e}") from None
        if error is not None:
            self._streams.pop(stream.request_id, None)
            raise error
        return stream

    async def generate(self, prompt: str | list[int], params: RequestParams) -> list[RequestOutput]:
        return await (await self.add(prompt, params)).final()

    async def abort(self, stream: RequestStream) -> None:
        """Stop a request whose reader went away (a no-op once it finished)."""
        if self._streams.pop(stream.request_id, None) is not None and not stream.done:
            try:
                await self.actor.abort.remote(stream.request_id)
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to abort
                log.debug("abort of %s failed", stream.request_id, exc_info=True)

    # ------------------------------------------------------------------ state
    def state(self, timeout_s: float = 10.0):
        """(EngineSnapshot, TimeModelReport or None) read in the engine process."""
        import ray

        return ray.get(self.actor.state.remote(), timeout=timeout_s)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def is_alive(self) -> bool:
        return self.error is None and (self._poller is None or not self._poller.done())

    def shutdown(self) -> None:
        import ray

        if self._poller is not None:
            self._poller.cancel()
        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - shutting down: a dead actor is fine
            log.debug("engine actor shutdown failed", exc_info=True)
        ray.kill(self.actor)

    # ------------------------------------------------------------------ the poller
    def _start_poller(self) -> None:
        if self._poller is None or self._poller.done() and self.error is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        # One streaming call for the replica's life: a Ray call per poll cost the engine's process
        # more (one client: 0.96x the tokens per second of this at 20 ms, 0.89x at 5 ms). The actor
        # holds each batch until stream_interval_ms after the last one, but lets a first text or an
        # end through at once: a client waits on the one, and sends its next request after the other.
        method = self.actor.updates.options(num_returns="streaming",
                                            _generator_backpressure_num_objects=UNREAD_BATCHES)
        try:
            async for ref in method.remote(POLL_WAIT_S, self.poll_interval_s):
                self._route(await ref)
            raise EngineDeadError("the engine's update stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the loop or the actor died: fail every stream
            log.error("engine stopped: %s", e)
            self.error = e
            self._fail_all(EngineDeadError(f"the engine loop stopped: {type(e).__name__}: {e}"))

    def _route(self, updates: list[RequestOutput]) -> None:
        for out in updates:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted, or its reader went away
                continue
            if out.finished:
                stream.finished.add(out.sample_index)
                if stream.done:
                    self._streams.pop(out.request_id, None)
            stream.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.queue.put_nowait(error)
