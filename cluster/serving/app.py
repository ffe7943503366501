"""OpenAI-compatible HTTP serving on Ray Serve: `/v1/completions`, `/v1/chat/completions`
(SSE streaming), `/v1/models`, `/health`, `/metrics`. One replica serves HTTP and drives
one Engine in an engine actor of its own (cluster/serving/engine_client.py), which starts
the TP worker actors inside the running Ray.

    serve run yamls/serve.yaml                                     # Serve's own CLI
    adaspec serve --config yamls/tiny.yaml --port 8000             # the same, as a command
"""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import StarletteHTTPException
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from ray import serve

from cluster.config import Config, ConfigError, load_config
from cluster.engine.request import RequestError, RequestParams
from cluster.serving.asgi import GenerationRoutes, route_path
from cluster.serving.engine_client import EngineClient, RequestStream
from cluster.serving.protocol import APIError, SamplingBody, chat_prompt, completion_prompt
from models.config import TINY_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_NAME = "adaspec-tiny"  # the bundled pair's served name
UNAUTHENTICATED = ("/health",)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def served_model_name(cfg: Config) -> str:
    """serve.model_name, else the checkpoint directory's name (adaspec-tiny for the bundled pair)."""
    if cfg.serve.model_name:
        return cfg.serve.model_name
    target = Path(cfg.model.target).resolve()
    return BUNDLED_NAME if target == (TINY_DIR / "target").resolve() else target.name


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
    """The replica: the routes, tokenization and SSE here; the Engine in its engine actor."""

    def __init__(self, config: str | None, overrides: list[str]):
        from cluster.engine.core import load_tokenizer
        from cluster.serving.metrics import ServerMetrics

        self.cfg = load_config(config, overrides)
        self.tokenizer = load_tokenizer(self.cfg.model.target)
        self.engine = EngineClient(self.cfg, self.tokenizer)
        self.metrics = ServerMetrics(self.engine)
        self.created = int(time.time())
        self.model_name = served_model_name(self.cfg)

    def __serve_build_asgi_app__(self):
        return build_routes(self)

    def pids(self) -> list[int]:
        """This replica's process and its engine's (the serving benchmark stops an arm's
        processes between its measurements, as it stops vLLM's)."""
        import os

        return [os.getpid()] + list(self.engine.info["pids"])

    async def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError(f"engine loop stopped: {self.engine.error!r}")

    def __del__(self):
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()

    # ------------------------------------------------------------------ requests
    def check_model(self, body: BaseModel) -> None:
        name = self.model_name
        if body.model is not None and body.model != name:
            raise APIError(400, f"model {body.model!r} is not served here; this server serves {name!r}",
                           param="model", code="model_not_found")

    def encode_chat(self, text: str) -> list[int]:
        tok = self.tokenizer
        # the template may already hold BOS
        return self.engine.encode(text, add_special_tokens=not (tok.bos_token and text.startswith(tok.bos_token)))

    def prompt_of(self, kind: str, body: BaseModel) -> tuple[str | list[int], int]:
        """The request's prompt (text or token ids) and max_tokens, as OpenAI reads them."""
        self.check_model(body)
        if kind == "text":
            return completion_prompt(body), 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        ids = self.encode_chat(chat_prompt(self.tokenizer, body))
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        if max_tokens is None:  # as OpenAI: up to the context limit
            max_tokens = max(self.engine.max_model_len - len(ids), 1)
        return ids, max_tokens

    async def add(self, kind: str, body: SamplingBody, prompt, max_tokens: int) -> tuple[str, RequestStream,
                                                                                           RequestParams]:
        """Queue the request in the engine: its OpenAI id, its stream of updates and its parameters."""
        params = body.to_params(max_tokens)
        if params.n > self.cfg.serve.max_n:
            raise RequestError(f"n must be at most {self.cfg.serve.max_n} on this server (serve.max_n), got {params.n}",
                               "n")
        stream = await self.engine.add(prompt, params)
        return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{stream.request_id}", stream, params


class AuthorizeAndCount:
    """The API key check and the per-route request count, as plain ASGI: Starlette's
    BaseHTTPMiddleware would pass every streamed chunk through a memory stream and a task
    switch of its own."""

    def __init__(self, app, server: OpenAIServer, key: str | None):
        self.app, self.server = app, server
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        route = path if path in ROUTES else "other"
        if self.expected is not None and path not in UNAUTHENTICATED:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                self.server.metrics.observe_request(route, 401)
                response = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                    code="invalid_api_key").response()
                return await response(scope, receive, send)
        started = False

        async def counted(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.server.metrics.observe_request(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except BaseException:
            if not started:  # an error before any answer (Serve answers it with a 500)
                self.server.metrics.observe_request(route, 500)
            raise


def build_routes(server: OpenAIServer):
    app = FastAPI(title="adaspec", docs_url=None, redoc_url=None, openapi_url=None)
    key = server.cfg.serve.api_key

    app.add_exception_handler(APIError, lambda _, e: e.response())
    app.add_exception_handler(StarletteHTTPException, lambda _, e: APIError(e.status_code, str(e.detail)).response())

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "created": server.created, "owned_by": "adaspec",
                                            "max_model_len": server.engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if server.engine.is_alive():
            return JSONResponse({"status": "ok"})
        return APIError(503, f"engine loop stopped: {server.engine.error!r}", kind="server_error").response()

    @app.get("/metrics")
    def metrics() -> Response:
        payload, content_type = server.metrics.render()
        return Response(payload, media_type=content_type)

    return AuthorizeAndCount(GenerationRoutes(app, server), server, key)


def build_app(args: dict | None = None, **options):
    """Serve's application builder (`import_path: cluster.serving.app:build_app`); options: more
    deployment options (the serving benchmark's health-check timeout)."""
    parsed = ServerArgs.from_dict(args)
    cfg = load_config(parsed.config, parsed.overrides)  # fail here, with the key named, not in a replica
    return OpenAIServer.options(
        max_ongoing_requests=cfg.engine.max_num_seqs + cfg.engine.max_waiting,
        ray_actor_options={"num_cpus": parsed.num_cpus}, **options,
    ).bind(parsed.config, parsed.overrides)
