"""The replica's poller without Ray: an engine actor stand-in answers each poll at once.
Polls come FIRST_POLL_INTERVAL_S apart while a request waits for its first token, and
serve.stream_interval_ms apart once every request has one (each poll costs the engine's
process a Ray call; what arrives meanwhile comes coalesced in the next poll)."""
from __future__ import annotations

import asyncio

import numpy as np

from cluster.engine.request import RequestOutput
from cluster.serving.engine_client import FIRST_POLL_INTERVAL_S, EngineClient, RequestStream

INTERVAL_S = 0.1  # the stream interval under test: far from FIRST_POLL_INTERVAL_S, so timing noise cannot blur them
FIRST_AT = 10  # the poll that brings the first token


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.fn(*args))
        return future


class _Actor:
    def __init__(self):
        self.times: list[float] = []
        self.poll = _Method(self._poll)

    def _poll(self, timeout_s):
        self.times.append(asyncio.get_running_loop().time())
        calls = len(self.times)
        if calls < FIRST_AT:
            return []
        return [RequestOutput(request_id="r", sample_index=0, prompt_ids=[1], token_ids=[5] * (calls - FIRST_AT + 1),
                              text="", finished=calls == FIRST_AT + 3, finish_reason=None, new_token_ids=[5])]


def test_polls_come_close_until_the_first_token_then_at_the_stream_interval():
    async def run():
        client = EngineClient.__new__(EngineClient)
        client.actor, client.error, client.poll_interval_s = _Actor(), None, INTERVAL_S
        stream = RequestStream("r", 1)
        client._streams = {"r": stream}
        client._poller = None
        client._start_poller()
        outputs = [out async for out in stream]
        client._poller.cancel()
        return client.actor.times, outputs

    times, outputs = asyncio.run(run())
    gaps = np.diff(times)
    waiting, streaming = gaps[:FIRST_AT - 1], gaps[FIRST_AT:]
    assert np.median(waiting) < INTERVAL_S / 2 and waiting.min() >= FIRST_POLL_INTERVAL_S * 0.9
    assert len(streaming) >= 2 and streaming.min() >= INTERVAL_S * 0.95
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4] and outputs[-1].finished
