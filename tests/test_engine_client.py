"""The engine loop's poll pacing, with a stand-in engine that emits one token of one request
per step: a poll asked for an interval returns at most that often while a stream runs, but a
sample's first text and its end come at once (a client waits on the one, and sends its next
request after the other). Then the replica's side of it, EngineClient, against a real engine
actor: its update stream and the actor's death."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from cluster.engine.request import RequestOutput
from cluster.serving.engine_loop import EngineLoop

STEP_S = 0.004
INTERVAL_S = 0.1  # far above STEP_S, so timing noise cannot blur "at once" and "after the interval"
TEXTS = ["", "", "a"] + ["a" * i for i in range(2, 80)]  # the first two tokens decode to no text yet
FIRST_TEXT = 3  # the step whose output first has text


class _Engine:
    decoder = object()  # it has a tokenizer: "first text" means text, not the first token

    def __init__(self):
        self.stats = SimpleNamespace(steps=0)
        self.published: list[float] = []

    def has_work(self) -> bool:
        return self.stats.steps < len(TEXTS)

    def idle(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        i = self.stats.steps + 1
        # the step after the first text takes half an interval: a poll that lets the first text through at once
        # returns it alone even on a loaded machine; one that holds it for the interval gets both
        time.sleep(INTERVAL_S / 2 if i == FIRST_TEXT + 1 else STEP_S)
        self.stats.steps = i
        self.published.append(time.monotonic())
        return [RequestOutput(request_id="r", sample_index=0, prompt_ids=[1], token_ids=[5] * i, text=TEXTS[i - 1],
                              finished=i == len(TEXTS), finish_reason="length" if i == len(TEXTS) else None,
                              new_token_ids=[5])]


def test_polls_keep_the_interval_but_let_a_first_text_and_an_end_through_at_once():
    engine = _Engine()
    loop = EngineLoop(engine)
    try:
        polls: list[tuple[float, RequestOutput]] = []
        while not (polls and polls[-1][1].finished):
            for out in loop.poll(5.0, INTERVAL_S):
                polls.append((time.monotonic(), out))
    finally:
        loop.shutdown()
    returned = np.array([t for t, _ in polls])
    steps = [len(out.token_ids) for _, out in polls]
    first_text = next(k for k, (_, out) in enumerate(polls) if out.text)
    assert steps[first_text] == FIRST_TEXT  # not coalesced with later steps: it came at once
    assert returned[first_text] - engine.published[FIRST_TEXT - 1] < INTERVAL_S / 2
    assert returned[-1] - engine.published[-1] < INTERVAL_S / 2  # the end, at once
    streaming = np.diff(returned[first_text + 1:-1])  # the regular polls keep their own pace: the first text
    assert len(streaming) >= 2 and streaming.min() >= INTERVAL_S * 0.95  # went out alone, in between them
    joined = [t for _, out in polls for t in out.new_token_ids]
    assert joined == polls[-1][1].token_ids  # coalesced updates lose no token


class _Busy:
    """A long stream beside short requests that each start and end within a few steps, as
    under many closed-loop clients: a first text or an end in nearly every step."""

    decoder = object()
    SHORT = 3  # steps per short request: first text on its first, end on its last

    def __init__(self, steps: int):
        self.stats = SimpleNamespace(steps=0)
        self.total = steps
        self.ended: dict[str, float] = {}  # short request -> when the step that ended it returned

    def has_work(self) -> bool:
        return self.stats.steps < self.total

    def idle(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_S)
        i = self.stats.steps = self.stats.steps + 1
        short, j = f"s{(i - 1) // self.SHORT}", (i - 1) % self.SHORT + 1
        outs = [RequestOutput(request_id="long", sample_index=0, prompt_ids=[1], token_ids=[5] * i, text="a" * i,
                              finished=i == self.total, finish_reason="length" if i == self.total else None,
                              new_token_ids=[5]),
                RequestOutput(request_id=short, sample_index=0, prompt_ids=[1], token_ids=[6] * j, text="b" * j,
                              finished=j == self.SHORT, finish_reason="stop" if j == self.SHORT else None,
                              new_token_ids=[6])]
        if j == self.SHORT:
            self.ended[short] = time.monotonic()
        return outs


def test_a_first_text_or_an_end_goes_out_alone_and_the_other_streams_keep_the_interval():
    engine = _Busy(steps=90)
    loop = EngineLoop(engine)
    try:
        polls: list[tuple[float, RequestOutput]] = []
        while not any(out.request_id == "long" and out.finished for _, out in polls):
            polls += [(time.monotonic(), out) for out in loop.poll(5.0, INTERVAL_S)]
    finally:
        loop.shutdown()
    long = [(t, out) for t, out in polls if out.request_id == "long"]
    gaps = np.diff([t for t, _ in long[1:-1]])  # after its first text, before its end
    assert len(long) >= 3 and gaps.min() >= INTERVAL_S * 0.95  # not carried along by the short ones' polls
    assert [t for _, out in long for t in out.new_token_ids] == long[-1][1].token_ids  # no token lost
    ends = [(t, out.request_id) for t, out in polls if out.request_id != "long" and out.finished]
    assert len(ends) == 90 // _Busy.SHORT
    late = [t - engine.ended[rid] for t, rid in ends]
    assert np.median(late) < INTERVAL_S / 4  # the short requests' ends, at once


class _Idle:
    """Two steps of work, then none."""

    decoder = object()

    def __init__(self):
        self.stats = SimpleNamespace(steps=0)
        self.events: list[str] = []

    def has_work(self) -> bool:
        return self.stats.steps < 2

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_S)
        self.stats.steps += 1
        self.events.append("step")
        return []

    def idle(self) -> None:
        self.events.append("idle")


def test_the_loop_calls_idle_once_the_engine_has_nothing_to_step():
    """Engine.idle (the registry's deferred calls) runs between steps never, once per idle spell."""
    engine = _Idle()
    loop = EngineLoop(engine)
    try:
        deadline = time.monotonic() + 5.0
        while "idle" not in engine.events and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # a loop that spun on idle would add more
    finally:
        loop.shutdown()
    assert engine.events == ["step", "step", "idle"]


class _Slow:
    """Three long steps; adds (an empty prompt is refused) and aborts are logged with the
    number of steps done when they reached the engine."""

    decoder = object()
    STEP_S = 0.3

    def __init__(self):
        self.stats = SimpleNamespace(steps=0)
        self.log: list[tuple[str, str, int]] = []

    def has_work(self) -> bool:
        return self.stats.steps < 3

    def idle(self) -> None:
        pass

    def add_request(self, prompt, params, request_id):
        from cluster.engine.request import RequestError

        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        self.log.append(("add", request_id, self.stats.steps))

    def abort(self, request_id):
        self.log.append(("abort", request_id, self.stats.steps))
        return 1

    def step(self):
        time.sleep(self.STEP_S)
        self.stats.steps += 1
        return []


def test_submitted_requests_do_not_wait_for_the_step_and_all_reach_the_next_one():
    """Adds and aborts submitted during a step return at once and are applied, in order,
    before the next step, all of them, whichever submit brought them; each submit's answer
    names the refused add."""
    import threading

    from cluster.engine.request import RequestError

    engine = _Slow()
    loop = EngineLoop(engine)
    answers, answered = [], threading.Event()

    def done(errors):
        answers.append(errors)
        if len(answers) == 2:
            answered.set()

    try:
        time.sleep(_Slow.STEP_S / 4)  # inside the first step
        took = time.monotonic()
        loop.submit([("add", "a", [1], None), ("add", "b", [], None)], done)
        loop.submit([("abort", "a"), ("add", "c", [2], None)], done)
        took = time.monotonic() - took
        assert answered.wait(5)
    finally:
        loop.shutdown()
    assert took < _Slow.STEP_S / 4  # not held until the step ended
    assert engine.log == [("add", "a", 1), ("abort", "a", 1), ("add", "c", 1)]  # all before the second step
    assert answers[0][0] is None and isinstance(answers[0][1], RequestError) and answers[1] == [None]


def test_update_stream_brings_every_token_and_fails_open_streams_when_the_actor_dies(ray_session):
    """The replica's side against a real engine actor: a stream's updates join to the engine's
    own tokens; killing the actor mid-stream ends every open stream with EngineDeadError (no
    stream hangs), and new requests are refused."""
    import asyncio

    import pytest

    from cluster.engine.core import load_tokenizer
    from cluster.serving.engine_client import EngineClient
    from cluster.serving.engine_loop import EngineDeadError
    from tests.conftest import greedy, local_engine, tiny_config

    cfg = tiny_config("parallel.tp_size=1", "serve.stream_interval_ms=5")
    prompt = [1, 17, 29, 300, 5]
    engine = local_engine(cfg)
    try:
        expected = engine.generate([prompt], greedy(24))[0][0].token_ids
    finally:
        engine.shutdown()

    async def scenario():
        client = EngineClient(cfg, load_tokenizer(cfg.model.target))
        try:
            assert client.info["niceness"] == 0  # not Ray's 15 for workers: preempted mid-step by every daemon
            joined = [t async for out in await client.add(prompt, greedy(24)) for t in out.new_token_ids]
            assert joined == expected
            long = await client.add(prompt, greedy(400))
            first = await anext(aiter(long))
            assert first.new_token_ids
            ray_session.kill(client.actor)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(long.final(), 15)
            assert not client.is_alive()
            with pytest.raises(EngineDeadError):
                await client.add(prompt, greedy(4))
        finally:
            client.shutdown()

    asyncio.run(scenario())


class _Loop:
    """An EngineLoop stand-in for the channel: adds and aborts are recorded (a prompt of [] is
    refused), and so is how many submits brought them; each poll hands out what was queued, and once
    `dead` is set polls raise EngineDeadError."""

    def __init__(self):
        import queue

        self.added, self.aborted, self.batches, self.dead, self.calls = [], [], queue.Queue(), False, 0

    def submit(self, requests, done):
        from cluster.engine.request import RequestError

        self.calls += 1
        errors = []
        for kind, request_id, *rest in requests:
            if kind == "abort":
                self.aborted.append(request_id)
                continue
            prompt = rest[0]
            if not prompt:
                errors.append(RequestError("prompt is empty", "prompt"))
                continue
            errors.append(None)
            self.added.append(request_id)
            self.batches.put([RequestOutput(request_id=request_id, sample_index=0, prompt_ids=prompt, token_ids=[7],
                                            text="x", finished=True, finish_reason="length", new_token_ids=[7])])
        done(errors)

    def poll(self, timeout_s, interval_s=0.0):
        import queue

        from cluster.serving.engine_loop import EngineDeadError

        try:
            batch = self.batches.get(timeout=min(timeout_s, 0.05))
        except queue.Empty:
            batch = []
        if self.dead:
            raise EngineDeadError("the engine loop stopped: boom")
        return batch


def test_channel_serves_only_the_token_holder_and_carries_adds_errors_updates_and_the_end():
    """The replica's connection to the engine actor: a connection without the token is closed
    unread; adds and aborts that arrive together are queued in one submit, in order, and the
    adds answered (a refused one with its error, param kept), the loop's updates come as frames, and a
    dead loop's last frame says so before the end."""
    import asyncio
    import socket

    import pytest

    from cluster.engine.request import RequestError
    from cluster.serving.channel import Channel, ChannelServer, encode

    loop = _Loop()
    server = ChannelServer(loop, 0.0, "127.0.0.1")

    async def scenario():
        with socket.create_connection(server.address) as intruder:
            intruder.sendall(b"not the token...")  # as long as a token
            intruder.settimeout(5)
            assert intruder.recv(1) == b""  # closed unread
        channel = await Channel.connect(server.address, server.token)
        # a burst: both adds and the abort arrive in one read and are queued together
        channel.writer.write(encode(("add", 0, "r0", [1, 2], None)) + encode(("add", 1, "r1", [], None))
                             + encode(("abort", "r0")))
        frames = [await asyncio.wait_for(channel.receive(), 5) for _ in range(3)]
        assert ("added", 0, None) in frames
        refused = next(f for f in frames if f[:2] == ("added", 1))[2]
        assert isinstance(refused, RequestError) and refused.param == "prompt"
        (updates,) = [f[1] for f in frames if f[0] == "updates"]
        assert [(u.request_id, u.token_ids, u.finished) for u in updates] == [("r0", [7], True)]
        assert loop.added == ["r0"] and loop.aborted == ["r0"] and loop.calls == 1
        loop.dead = True
        assert (await asyncio.wait_for(channel.receive(), 5))[0] == "dead"
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(channel.receive(), 5)
        channel.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
