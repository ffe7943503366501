"""OpenAI-compatible HTTP serving on Ray Serve: `/v1/completions`, `/v1/chat/completions`
(SSE streaming), `/v1/models`, `/health`, `/metrics`. One replica drives one Engine,
whose TP worker actors it starts inside the running Ray.

    serve run yamls/serve.yaml                                     # Serve's own CLI
    adaspec serve --config yamls/tiny.yaml --port 8000             # the same, as a command
"""
from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import StarletteHTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from ray import serve

from cluster.async_engine import AsyncEngine, EngineDeadError
from cluster.config import ConfigError, load_config
from cluster.request import QueueFullError, RequestError, RequestOutput, RequestParams

REPO_ROOT = Path(__file__).resolve().parent.parent
UNAUTHENTICATED = ("/health",)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


# ---------------------------------------------------------------------- OpenAI's shapes
class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default: 1.0
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False

    def to_params(self, max_tokens: int) -> RequestParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(stop):
            raise RequestError("stop must not hold empty strings")
        return RequestParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                             top_p=1.0 if self.top_p is None else self.top_p,
                             top_k=0 if self.top_k in (None, -1) else self.top_k, seed=self.seed, stop=tuple(stop),
                             ignore_eos=bool(self.ignore_eos), n=1 if self.n is None else self.n)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatBody(SamplingBody):
    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None


def completion_prompt(body: CompletionBody) -> str | list[int]:
    prompt = body.prompt
    if prompt is None:
        raise RequestError("prompt is required: a string (or a list of one string, or token ids)")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise RequestError(f"prompt must be one string, got a list of {len(prompt)}; send one request per prompt")
        prompt = prompt[0]
    if not prompt:
        raise RequestError("prompt is empty")
    return prompt


def chat_prompt(tokenizer, body: ChatBody) -> str:
    if not body.messages:
        raise RequestError("messages is required: a non-empty list of {role, content}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages cannot be rendered: this model has no chat template; use /v1/completions")
    messages = []
    for m in body.messages:
        parts = m.content if isinstance(m.content, list) else [{"type": "text", "text": m.content or ""}]
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in parts):
            raise RequestError("messages: only text content ({type: text, text: ...}) is supported")
        messages.append({"role": m.role, "content": "".join(p["text"] for p in parts)})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template error is the client's input, not a server fault
        raise RequestError(f"messages: the chat template rejected them: {e}") from None


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(outputs: list[RequestOutput]) -> dict:
    prompt, completion = len(outputs[0].prompt_ids), sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_body(kind: str, rid: str, model: str, created: int, outputs: list[RequestOutput]) -> dict:
    if kind == "chat":
        choices = [{"index": o.sample_index, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                    "finish_reason": o.finish_reason} for o in outputs]
    else:
        choices = [{"index": o.sample_index, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                   for o in outputs]
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(outputs)}


def stable_prefix(text: str, stop: tuple[str, ...]) -> str:
    """What of an unfinished text can be sent now: not a trailing partial UTF-8 character,
    whitespace a later token may merge with, or the start of a stop string."""
    text = text.rstrip("\ufffd").rstrip()
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                text = text[:-k]
                break
    return text


@dataclass
class SSEState:
    """Turns a request's updates into OpenAI stream chunks; the joined deltas equal the final text."""

    kind: str
    rid: str
    model: str
    created: int
    n: int
    stop: tuple[str, ...]
    include_usage: bool
    sent: dict = field(default_factory=dict)  # sample index -> text sent so far

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> str:
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage_
        return f"data: {json.dumps(body)}\n\n"

    def opening(self) -> list[str]:
        if self.kind != "chat":
            return []
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.n)]

    def update(self, out: RequestOutput) -> list[str]:
        i, sent = out.sample_index, self.sent.get(out.sample_index, "")
        text = out.text if out.finished else stable_prefix(out.text, self.stop)
        delta = text[len(sent):] if text.startswith(sent) else ""
        self.sent[i] = sent + delta
        if not delta and not out.finished:
            return []
        reason = out.finish_reason if out.finished else None
        if self.kind == "chat":
            choice = {"index": i, "delta": {"content": delta} if delta else {}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": reason}
        return [self.chunk([choice])]

    def closing(self, outputs: list[RequestOutput]) -> list[str]:
        return [self.chunk([], usage(outputs))] if self.include_usage else []


class APIError(Exception):
    """A request the server refuses; answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), status_code=self.status)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (declared or streamed) before it is all read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit} (serve.max_request_bytes)",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes (serve.max_request_bytes)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    raw = await read_body(request, limit)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except ValueError as e:  # e.g. an integer literal past Python's 4300-digit conversion limit
        raise APIError(400, f"request body is not acceptable JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param, path = str(err["loc"][0]), ".".join(str(p) for p in err["loc"])
        where = f" (at {path})" if path != param else ""
        raise APIError(400, f"{param}: {err['msg']}{where}", param=param) from None


def request_error(error: RequestError) -> JSONResponse:
    """400 for a RequestError; its message starts with the field it is about ("max_tokens must be ...").
    429 with Retry-After when the engine's waiting queue is full."""
    if isinstance(error, QueueFullError):
        response = APIError(429, str(error), kind="rate_limit_error", code="queue_full").response()
        response.headers["Retry-After"] = str(error.retry_after_s)
        return response
    first = str(error).split(" ", 1)[0]
    param = first if first in CompletionBody.model_fields or first in ChatBody.model_fields else None
    return APIError(400, str(error), param=param).response()


@dataclass
class ServerArgs:
    """The application's arguments (`args:` in yamls/serve.yaml)."""

    config: str | None = None  # YAML config path, relative to the working directory or the repository
    overrides: list[str] = field(default_factory=list)  # `key.path=value`, as --set
    num_cpus: float = 0.0  # Ray CPUs of the replica itself (the TP ranks reserve their own)

    @classmethod
    def from_dict(cls, args: dict | None) -> "ServerArgs":
        args, allowed = dict(args or {}), cls.__dataclass_fields__
        for key in args.keys() - allowed:
            raise ConfigError(f"unknown application argument {key!r}; allowed: {', '.join(allowed)}")
        overrides = args.get("overrides") or []
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ConfigError(f"application argument overrides must be a list of key=value strings, got {overrides!r}")
        return cls(resolve_config_path(args.get("config")), overrides, float(args.get("num_cpus", 0.0)))


def resolve_config_path(path: str | None) -> str | None:
    """An absolute path, so a replica finds the file whatever its working directory."""
    if path is None:
        return None
    p = Path(path).expanduser()
    for candidate in (p, REPO_ROOT / p):
        if candidate.is_file():
            return str(candidate.resolve())
    raise ConfigError(f"config file {path!r} does not exist (looked in {Path.cwd()} and {REPO_ROOT})")


@serve.deployment(name="adaspec", ray_actor_options={"num_cpus": 0}, health_check_period_s=10)
@serve.ingress()
class OpenAIServer:
    """The replica: an Engine (TP workers as Ray actors), its loop thread and the routes."""

    def __init__(self, config: str | None, overrides: list[str]):
        from cluster.engine import Engine
        from cluster.metrics import ServerMetrics

        self.cfg = load_config(config, overrides)
        self.engine = Engine(self.cfg)
        self.async_engine = AsyncEngine(self.engine)
        self.metrics = ServerMetrics(self.async_engine)
        self.created = int(time.time())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_routes(self)

    async def check_health(self) -> None:
        if not self.async_engine.is_alive():
            raise RuntimeError(f"engine loop stopped: {self.async_engine.error!r}")

    def __del__(self):
        if getattr(self, "async_engine", None) is not None:
            self.async_engine.shutdown()
            self.engine.shutdown()

    # ------------------------------------------------------------------ requests
    def check_model(self, body: BaseModel) -> None:
        name = self.cfg.serve.model_name
        if body.model is not None and body.model != name:
            raise APIError(400, f"model {body.model!r} is not served here; this server serves {name!r}",
                           param="model", code="model_not_found")

    async def encode_chat(self, text: str) -> list[int]:
        tok = self.engine.tokenizer
        if tok.bos_token and text.startswith(tok.bos_token):  # the template already holds BOS
            return await self.async_engine.encode(text, add_special_tokens=False)
        return await self.async_engine.encode(text)

    async def respond(self, kind: str, body: BaseModel, prompt, max_tokens: int) -> Response:
        start, params = time.monotonic(), body.to_params(max_tokens)
        stream = await self.async_engine.add(prompt, params)
        name, rid = self.cfg.serve.model_name, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{stream.request_id}"
        if body.stream:
            state = SSEState(kind, rid, name, int(time.time()), params.n, params.stop, body.include_usage())
            return StreamingResponse(self._sse(stream, state, start), media_type="text/event-stream")
        outputs = await stream.final()
        self.metrics.observe_finished(outputs, time.monotonic() - start)
        return JSONResponse(response_body(kind, rid, name, int(time.time()), outputs))

    async def _sse(self, stream, state: SSEState, start: float):
        final: dict[int, RequestOutput] = {}
        try:
            for chunk in state.opening():
                yield chunk
            async for out in stream:
                final[out.sample_index] = out
                for chunk in state.update(out):
                    yield chunk
            outputs = [final[i] for i in range(state.n)]
            self.metrics.observe_finished(outputs, time.monotonic() - start)
            for chunk in state.closing(outputs):
                yield chunk
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(str(e), 'server_error', None, None))}\n\n"
        yield "data: [DONE]\n\n"


def build_routes(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="adaspec", docs_url=None, redoc_url=None, openapi_url=None)
    key, limit = server.cfg.serve.api_key, server.cfg.serve.max_request_bytes

    @app.middleware("http")
    async def authorize_and_count(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if key and request.url.path not in UNAUTHENTICATED and not hmac.compare_digest(given, f"Bearer {key}".encode()):
            response = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key").response()
        else:
            response = await call_next(request)
        path = request.url.path
        server.metrics.observe_request(path if path in ROUTES else "other", response.status_code)
        return response

    app.add_exception_handler(APIError, lambda _, e: e.response())
    app.add_exception_handler(RequestError, lambda _, e: request_error(e))
    app.add_exception_handler(StarletteHTTPException, lambda _, e: APIError(e.status_code, str(e.detail)).response())
    app.add_exception_handler(EngineDeadError, lambda _, e: APIError(503, str(e), kind="server_error").response())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionBody, limit)
        server.check_model(body)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        return await server.respond("text", body, completion_prompt(body), max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatBody, limit)
        server.check_model(body)
        ids = await server.encode_chat(chat_prompt(server.engine.tokenizer, body))
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        if max_tokens is None:  # as OpenAI: up to the context limit
            max_tokens = max(server.engine.max_model_len - len(ids), 1)
        return await server.respond("chat", body, ids, max_tokens)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.cfg.serve.model_name, "object": "model",
                                            "created": server.created, "owned_by": "adaspec",
                                            "max_model_len": server.engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if server.async_engine.is_alive():
            return JSONResponse({"status": "ok"})
        return APIError(503, f"engine loop stopped: {server.async_engine.error!r}", kind="server_error").response()

    @app.get("/metrics")
    def metrics() -> Response:
        payload, content_type = server.metrics.render()
        return Response(payload, media_type=content_type)

    return app


def build_app(args: dict | None = None):
    """Serve's application builder (`import_path: cluster.serve:build_app`)."""
    parsed = ServerArgs.from_dict(args)
    cfg = load_config(parsed.config, parsed.overrides)  # fail here, with the key named, not in a replica
    return OpenAIServer.options(
        max_ongoing_requests=cfg.engine.max_num_seqs + cfg.engine.max_waiting,
        ray_actor_options={"num_cpus": parsed.num_cpus},
    ).bind(parsed.config, parsed.overrides)
