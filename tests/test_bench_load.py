"""The serving benchmark's HTTP client against a stub OpenAI server: closed-loop clients
reuse their connection, and a request whose pooled connection the server dropped before
answering is sent again."""
from __future__ import annotations

import asyncio
import json

from cluster.bench.load import RequestSpec, run_clients


async def _serve_and_run(drop_every: int, specs: list[RequestSpec], clients: int):
    """A stub /v1/completions that streams the prompt's length as text; it closes every
    `drop_every`-th request's connection without answering (0: never). Returns the results,
    the connections the server accepted and the requests it answered."""
    from aiohttp import web

    seen = {"connections": set(), "requests": 0, "answered": 0}

    async def completions(request):
        body = await request.json()
        seen["connections"].add(request.transport.get_extra_info("peername"))  # the client port: one per connection
        seen["requests"] += 1
        if drop_every and seen["requests"] % drop_every == 0:
            request.transport.close()  # as a server closing an idle keep-alive connection
            return web.Response()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        text = {"choices": [{"index": 0, "text": f"n={len(body['prompt'])}"}]}
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        for event in (text, usage):
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        seen["answered"] += 1
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        results, _ = await run_clients(f"http://127.0.0.1:{port}", None, specs, clients)
    finally:
        await runner.cleanup()
    return results, len(seen["connections"]), seen


def _specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(list(range(i + 1)), 4) for i in range(n)]


def test_a_closed_loop_client_sends_its_requests_on_one_connection():
    results, connections, seen = asyncio.run(_serve_and_run(0, _specs(12), clients=2))
    assert [r.error for r in results] == [""] * 12
    assert [r.text for r in results] == [f"n={i + 1}" for i in range(12)]
    assert connections == 2 and seen["requests"] == 12


def test_a_request_whose_connection_broke_before_an_answer_is_sent_again():
    results, _, seen = asyncio.run(_serve_and_run(3, _specs(9), clients=1))
    assert [r.error for r in results] == [""] * 9
    assert [r.text for r in results] == [f"n={i + 1}" for i in range(9)]
    assert [r.tokens for r in results] == [4] * 9
    assert seen["answered"] == 9 and seen["requests"] > 9  # the dropped ones came again
