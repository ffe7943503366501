"""The serving replica's engine, in a process of its own.

`EngineActor` is a Ray actor holding the Engine and its EngineLoop thread (TP=1 runs its
rank right there; larger TP sizes start their worker actors from it). `EngineClient`, in
the HTTP replica, gives each request an asyncio stream of RequestOutput updates. Requests,
aborts and updates travel over one TCP connection between the two (cluster/serving/
channel.py), not as Ray calls; Ray starts the actor, reads its state and stops it. A reader
task per replica routes the updates: each batch holds the updates of every request since
the last, so the HTTP side never carries one object per token and the model's process
never waits on the HTTP event loop's interpreter lock. Batches come at most every
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
from cluster.serving.channel import Channel, ChannelServer
from cluster.serving.engine_loop import EngineDeadError, EngineLoop
from cluster.serving.priority import LoadPriority

log = logging.getLogger("adaspec.engine_client")
MAX_CONCURRENT_CALLS = 4  # actor threads for Ray's calls: metric scrapes, health, shutdown
SWITCH_INTERVAL_S = 0.001


class EngineActor:
    """(a Ray actor) The Engine, its stepping thread and the channel to the replica.
    Request errors go back as values, so the replica re-raises them exactly (param,
    Retry-After)."""

    def __init__(self, cfg: Config):
        import sys

        import ray

        from cluster.engine.core import Engine

        # the channel's threads take the interpreter lock between the loop's steps: hand it over
        # within 1 ms, not Python's default 5
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.loop = EngineLoop(Engine(cfg), threads=cfg.serve.engine_threads)
        self.channel = ChannelServer(self.loop, cfg.serve.stream_interval_ms / 1e3, ray.util.get_node_ip_address())

    def info(self) -> dict:
        """The replica's facts: the context length, this process's niceness, where and how to
        connect, and the processes that run the model (this one and any rank actors)."""
        import os

        import ray

        actors = self.loop.engine.workers.actors or []
        return {"max_model_len": self.loop.engine.max_model_len, "niceness": os.getpriority(os.PRIO_PROCESS, 0),
                "address": self.channel.address, "token": self.channel.token,
                "pids": [os.getpid()] + ray.get([a.pid.remote() for a in actors])}

    def state(self):
        from cluster.serving.metrics import engine_state

        return self.loop.call(engine_state, self.loop.engine)

    def is_alive(self) -> bool:
        return self.loop.is_alive()

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.channel.close()
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
        async for batch in self.batches():
            for out in batch:
                yield out

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """The updates in engine order, as many at a time as have arrived (an HTTP answer
        writes each batch at once); raises what ended the stream early (EngineDeadError)."""
        done: set[int] = set()
        while len(done) < self.n:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch = []
            for item in items:
                if isinstance(item, BaseException):
                    if batch:
                        yield batch
                    raise item
                if item.finished:
                    done.add(item.sample_index)
                batch.append(item)
            yield batch

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
        self._call_ids = itertools.count()
        self._channel: Channel | None = None
        self._connecting = asyncio.Lock()  # bound to the replica's event loop on first use
        self._reader: asyncio.Task | None = None
        self._calls: dict[int, asyncio.Future] = {}  # adds waiting for the engine's answer
        self.priority = LoadPriority()  # this process's niceness by the requests in flight

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
        channel = await self._connect()
        stream = RequestStream(f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}", params.n)
        self._streams[stream.request_id] = stream  # before the add: its first update may come before the answer
        self.priority.update(len(self._streams))
        call_id = next(self._call_ids)
        answer = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            channel.send(("add", call_id, stream.request_id, prompt, params))
            error = await answer
        except BaseException:  # the engine died, or the caller went away (then it may have been added)
            self._streams.pop(stream.request_id, None)
            if self.error is None:
                channel.send(("abort", stream.request_id))
            raise
        finally:
            self._calls.pop(call_id, None)
        if error is not None:
            self._streams.pop(stream.request_id, None)
            raise error
        return stream

    async def generate(self, prompt: str | list[int], params: RequestParams) -> list[RequestOutput]:
        return await (await self.add(prompt, params)).final()

    async def abort(self, stream: RequestStream) -> None:
        """Stop a request whose reader went away (a no-op once it finished)."""
        if self._streams.pop(stream.request_id, None) is not None and not stream.done and self.error is None:
            try:
                self._channel.send(("abort", stream.request_id))
            except Exception:  # noqa: BLE001 - a closed connection has nothing left to abort
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
        return self.error is None and (self._reader is None or not self._reader.done())

    def shutdown(self) -> None:
        import ray

        if self._reader is not None:
            self._reader.cancel()
        if self._channel is not None:
            self._channel.close()
        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - shutting down: a dead actor is fine
            log.debug("engine actor shutdown failed", exc_info=True)
        ray.kill(self.actor)

    # ------------------------------------------------------------------ the connection
    async def _connect(self) -> Channel:
        """The connection to the engine actor, made on the first request (on the replica's
        event loop), with the task that reads it."""
        if self._channel is not None:
            return self._channel
        async with self._connecting:
            if self._channel is None:
                try:
                    channel = await Channel.connect(tuple(self.info["address"]), self.info["token"])
                except (OSError, asyncio.TimeoutError) as e:
                    self._stop(EngineDeadError(f"cannot reach the engine actor: {type(e).__name__}: {e}"))
                    raise self.error from None
                self._reader = asyncio.get_running_loop().create_task(self._read(channel))
                self._channel = channel
        return self._channel

    async def _read(self, channel: Channel) -> None:
        try:
            while True:
                message = await channel.receive()
                if message[0] == "updates":
                    self._route(message[1])
                elif message[0] == "added":
                    answer = self._calls.get(message[1])
                    if answer is not None and not answer.done():
                        answer.set_result(message[2])
                elif message[0] == "dead":
                    raise EngineDeadError(message[1])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the loop or the actor died: fail every stream
            log.error("engine stopped: %s", e)
            self._stop(e)

    def _stop(self, error: BaseException) -> None:
        """Fail every open stream and waiting add; take no more requests."""
        self.error = error
        dead = EngineDeadError(f"the engine loop stopped: {type(error).__name__}: {error}")
        calls, self._calls = list(self._calls.values()), {}
        for answer in calls:
            if not answer.done():
                answer.set_exception(dead)
        self._fail_all(dead)

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
        self.priority.update(len(self._streams))

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.queue.put_nowait(error)
