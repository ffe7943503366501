"""AsyncEngine: one Engine, one background thread stepping it, and an asyncio stream of
`RequestOutput` updates per request. Concurrent requests join the same continuous batch.

    python -c "import asyncio; from cluster.serving.async_engine import demo; asyncio.run(demo())"
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from cluster.engine.request import RequestOutput, RequestParams

log = logging.getLogger("adaspec.async_engine")
IDLE_WAIT_S = 0.005  # pause when the engine has work but could schedule nothing


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no new requests are taken."""


@dataclass
class RequestStream:
    """The updates of one request (all of its `n` samples), in engine order."""

    request_id: str
    n: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: set = field(default_factory=set)  # sample indices done (touched by the engine thread only)

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


class AsyncEngine:
    """Owns the engine loop thread. The Engine is touched only under `self._cond`."""

    def __init__(self, engine):
        self.engine = engine
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._adders = 0  # threads waiting to add a request: the loop lets them in first
        self._adders_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._stopped = False
        self._counter = itertools.count()
        self._thread = threading.Thread(target=self._run, name="adaspec-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers (event loop side)
    async def add(self, prompt: str | list[int], params: RequestParams) -> RequestStream:
        """Queue a request; raises RequestError for bad input, EngineDeadError when stopped."""
        request_id = f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(request_id, params.n, asyncio.get_running_loop())
        await asyncio.to_thread(self._locked, self._add, prompt, params, stream)
        return stream

    async def generate(self, prompt: str | list[int], params: RequestParams) -> list[RequestOutput]:
        """Run one request to completion; its finished outputs by sample index."""
        return await (await self.add(prompt, params)).final()

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize with the engine's tokenizer (which is not safe to share across threads)."""
        if add_special_tokens:
            return await asyncio.to_thread(self._locked, self.engine.encode, text)
        tok = self.engine.tokenizer
        return await asyncio.to_thread(self._locked, lambda: tok(text, add_special_tokens=False)["input_ids"])

    def snapshot(self, fn):
        """Call `fn(engine)` under the engine lock (for metrics that read engine state)."""
        return self._locked(fn, self.engine)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def is_alive(self) -> bool:
        return self.error is None and not self._stopped and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # ------------------------------------------------------------------ locked helpers
    def _locked(self, fn, *args):
        """fn(*args) under the engine lock, ahead of the loop's next step."""
        with self._adders_lock:
            self._adders += 1
        try:
            with self._cond:
                return fn(*args)
        finally:
            with self._adders_lock:
                self._adders -= 1
            with self._cond:
                self._cond.notify_all()

    def _add(self, prompt, params: RequestParams, stream: RequestStream) -> None:
        """(under the lock) The request into the engine's queue, its stream into the routing table."""
        if not self.is_alive():
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        self.engine.add_request(prompt, params, request_id=stream.request_id)
        self._streams[stream.request_id] = stream

    # ------------------------------------------------------------------ the loop thread
    def _ready(self) -> bool:
        return self._stopped or (self._adders == 0 and self.engine.has_work())

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(self._ready)
                    if self._stopped:
                        return
                    steps = self.engine.stats.steps
                    outputs = self.engine.step()
                    if self.engine.stats.steps == steps:  # nothing could be scheduled: don't spin
                        self._cond.wait(IDLE_WAIT_S)
                self._dispatch(outputs)
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear about it
            log.exception("engine loop stopped")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine loop stopped: {type(e).__name__}: {e}"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.finished.add(out.sample_index)
                if len(stream.finished) == stream.n:
                    self._streams.pop(out.request_id, None)
            _put(stream, out)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            _put(stream, error)


def _put(stream: RequestStream, item) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening
        pass


async def demo() -> None:
    """Two concurrent greedy requests on a TP=1 in-process engine."""
    from cluster.config import load_config
    from cluster.engine.core import Engine
    from cluster.engine.executor import LocalWorkerGroup

    cfg = load_config("yamls/tiny.yaml", ["parallel.tp_size=1"])
    engine = AsyncEngine(Engine(cfg, workers=LocalWorkerGroup(cfg.model, cfg.speculative, cfg.parallel, cfg.cache)))
    try:
        params = RequestParams(max_tokens=16)
        for outs in await asyncio.gather(*(engine.generate(p, params) for p in ("Hi", "Tell me about Ray."))):
            print(repr(outs[0].text))
    finally:
        engine.shutdown()
        engine.engine.shutdown()
