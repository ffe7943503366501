"""The serving benchmark's client: streamed `/v1/completions` requests sent on a seeded
Poisson schedule, or by a fixed number of closed-loop clients, to any OpenAI-compatible
server, and what each one measured. Connections are kept open between requests, as
OpenAI's client does (KEEPALIVE_S)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

REQUEST_TIMEOUT_S = 600
# An idle pooled connection is dropped after this long, well before a server closes it (uvicorn's
# default, vLLM's server's, is 5 s; Ray Serve's 90 s), so a request never goes out on a
# connection the server is closing. Reusing connections is what OpenAI's client and vLLM's
# benchmark do: a fresh connection per request cost the client 0.7 ms of a 10 ms
# one-token request here.
KEEPALIVE_S = 1.0
RETRIES = 1  # a request whose reused connection broke before any answer is sent again this many times


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]  # token ids (sent as ids, so every server sees the same prompt)
    max_tokens: int


@dataclass
class RequestResult:
    sent: float  # perf_counter seconds
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    text: str = ""  # the completion, joined from the chunks
    tokens: int = 0  # completion tokens, from the stream's usage
    error: str = ""

    @property
    def ttft_ms(self) -> float | None:
        return 1e3 * (self.chunk_times[0] - self.sent) if self.chunk_times else None

    @property
    def tpot_ms(self) -> float | None:
        if not self.chunk_times or self.tokens < 2:
            return None
        return 1e3 * (self.end - self.chunk_times[0]) / (self.tokens - 1)

    def itl_ms(self) -> list[float]:
        return [1e3 * (b - a) for a, b in zip(self.chunk_times, self.chunk_times[1:])]


async def stream_completion(session, url: str, model: str | None, spec: RequestSpec, api_key: str | None,
                            result: RequestResult) -> None:
    """One streamed greedy completion (EOS honoured), filling `result`."""
    body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for attempt in range(RETRIES + 1):
        if await _stream_once(session, url, body, headers, result, retry=attempt < RETRIES):
            return


async def _stream_once(session, url: str, body: dict, headers: dict, result: RequestResult, retry: bool) -> bool:
    """One try of stream_completion; False when it should be sent again: the connection broke
    before the server answered (a pooled one the server had just closed)."""
    import aiohttp

    answered = False
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            answered = True
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return True
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))[:200]
                    return True
                delta = "".join(c.get("text") or "" for c in event.get("choices", []))
                if delta:
                    result.chunk_times.append(time.perf_counter())
                    result.text += delta
                if event.get("usage"):
                    result.tokens = int(event["usage"]["completion_tokens"])
        if not result.tokens:
            result.error = "the stream carried no usage"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        if retry and not answered:
            return False
        result.error = f"{type(e).__name__}: {e}"[:200]
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        result.end = time.perf_counter()
    return True


def arrival_offsets(n: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from the start at which each of n requests is sent: a Poisson process of
    `rate` requests per second (all at once for an infinite rate)."""
    if not np.isfinite(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_load(url: str, model: str | None, specs: list[RequestSpec], rate: float, seed: int,
                   api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Send `specs` on the Poisson schedule; returns the results and the wall time from the
    first request sent to the last response finished."""
    import aiohttp

    offsets = arrival_offsets(len(specs), rate, seed)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)  # no cap on concurrent requests
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        results = [RequestResult(sent=0.0) for _ in specs]

        async def send(i: int) -> None:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            results[i].sent = time.perf_counter()
            await stream_completion(session, url, model, specs[i], api_key, results[i])

        await asyncio.gather(*(send(i) for i in range(len(specs))))
        wall = max(r.end for r in results) - start
    return results, wall


async def run_clients(url: str, model: str | None, specs: list[RequestSpec], clients: int,
                      api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """`clients` closed-loop clients: each sends its next request as soon as its last one
    finished, taking `specs` in order. Returns the results and the wall time."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    results = [RequestResult(sent=0.0) for _ in specs]
    queue = iter(range(len(specs)))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def client() -> None:
            for i in queue:
                results[i].sent = time.perf_counter()
                await stream_completion(session, url, model, specs[i], api_key, results[i])

        await asyncio.gather(*(client() for _ in range(clients)))
        wall = max(r.end for r in results) - start
    return results, wall
