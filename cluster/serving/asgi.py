"""The generation routes, `POST /v1/completions` and `POST /v1/chat/completions`, as plain
ASGI in front of the FastAPI app that serves every other route.

Through FastAPI a one-token streamed request took 2.0-2.4 ms of the replica's CPU, of a
6-7 ms round trip at one client: six middleware layers, each wrapping `send`, routing,
dependency solving, and Starlette's streaming response, which starts an anyio task group
per response to watch for the client going away, then writes every SSE event on its own
(the last text, the usage, `[DONE]` and the end: four writes, each waking the client).
Here a request is read, checked and answered with one `send` per batch of updates the
engine sent, the closing events in the same write as the last text. A client that goes
away is noticed by Serve's direct ingress, which cancels the request's task: the engine
aborts the request on the way out.

Refusals are what the FastAPI routes answered: OpenAI's JSON errors (cluster/serving/
protocol.py) with the same status codes and headers (400 naming the param, 405, 413, 429
with Retry-After, 503 when the engine stopped); a fault of the server's own before the
answer starts is a 500 in the same shape.
"""
from __future__ import annotations

import json
import logging
import time

from cluster.engine.request import QueueFullError, RequestError, RequestOutput
from cluster.serving.engine_client import RequestStream
from cluster.serving.engine_loop import EngineDeadError
from cluster.serving.protocol import (APIError, ChatBody, CompletionBody, SSEState, error_body, parse_body,
                                      response_body)

log = logging.getLogger("adaspec.asgi")
GENERATION_ROUTES = {"/v1/completions": ("text", CompletionBody),
                     "/v1/chat/completions": ("chat", ChatBody)}
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
DONE = "data: [DONE]\n\n"


def route_path(scope) -> str:
    """The request's path below the application's route prefix (Serve puts the prefix in
    `root_path` and leaves it in `path`, as ASGI asks)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


def error_answer(error: Exception) -> tuple[int, dict, list[tuple[bytes, bytes]]]:
    """(status, OpenAI error body, extra headers) for a refused request."""
    if isinstance(error, APIError):
        return error.status, error_body(error.message, error.kind, error.param, error.code), []
    if isinstance(error, QueueFullError):
        return 429, error_body(str(error), "rate_limit_error", None, "queue_full"), [
            (b"retry-after", str(error.retry_after_s).encode())]
    if isinstance(error, RequestError):
        return 400, error_body(str(error), "invalid_request_error", error.param, None), []
    if isinstance(error, EngineDeadError):
        return 503, error_body(str(error), "server_error", None, None), []
    raise TypeError(f"not a refusal: {error!r}")


async def send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def read_body(scope, receive, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (declared or streamed) before it is all read."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"").decode("latin-1")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit} (serve.max_request_bytes)",
                       code="request_too_large")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes (serve.max_request_bytes)",
                           code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class GenerationRoutes:
    """The generation routes of `server` (an OpenAIServer); everything else goes to `app`."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        path = route_path(scope) if scope["type"] == "http" else None
        route = GENERATION_ROUTES.get(path)
        if route is None:
            return await self.app(scope, receive, send)
        try:
            if scope["method"] != "POST":
                raise APIError(405, f"{path} takes POST, not {scope['method']}")
            raw = await read_body(scope, receive, self.server.cfg.serve.max_request_bytes)
            kind, model = route
            start, body = time.monotonic(), parse_body(raw, model)
            prompt, max_tokens = self.server.prompt_of(kind, body)
            rid, stream, params = await self.server.add(kind, body, prompt, max_tokens)
        except (APIError, RequestError, EngineDeadError) as e:
            return await send_json(send, *error_answer(e))
        except ClientGone:
            return
        except Exception:  # a fault of ours, not the request's: OpenAI's 500, the trace in the replica's log
            log.exception("%s failed before answering", path)
            return await send_json(send, 500, error_body("internal server error", "server_error", None, None))
        try:
            if body.stream:
                state = SSEState(kind, rid, self.server.model_name, int(time.time()), params.n, params.stop,
                                 body.include_usage())
                await self._stream(send, stream, state, start)
            else:
                outputs = await stream.final()
                self.server.metrics.observe_finished(outputs, time.monotonic() - start)
                await send_json(send, 200, response_body(kind, rid, self.server.model_name, int(time.time()),
                                                         outputs))
        except EngineDeadError as e:  # only before a streamed answer started: a plain 503
            await send_json(send, *error_answer(e))
        finally:  # also when the client went away: Serve's direct ingress cancels this task then
            await self.server.engine.abort(stream)  # a no-op once it finished

    async def _stream(self, send, stream: RequestStream, state: SSEState, start: float) -> None:
        """The SSE answer: one write per batch of updates; the last text, the usage and
        `[DONE]` in the write that ends the response."""
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        final: dict[int, RequestOutput] = {}
        pending = state.opening()
        try:
            async for batch in stream.batches():
                for out in batch:
                    final[out.sample_index] = out
                    pending += state.update(out)
                if pending and not stream.done:
                    await send({"type": "http.response.body", "body": "".join(pending).encode(), "more_body": True})
                    pending = []
            outputs = [final[i] for i in range(state.n)]
            self.server.metrics.observe_finished(outputs, time.monotonic() - start)
            pending += state.closing(outputs)
        except EngineDeadError as e:
            pending.append(f"data: {json.dumps(error_body(str(e), 'server_error', None, None))}\n\n")
        pending.append(DONE)
        await send({"type": "http.response.body", "body": "".join(pending).encode(), "more_body": False})
