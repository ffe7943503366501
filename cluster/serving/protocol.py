"""OpenAI's request and response shapes: validated bodies, SSE chunks whose deltas join to
the final text, and errors as OpenAI's JSON (status, type, the `param` they are about)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.engine.request import RequestError, RequestOutput, RequestParams


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
            raise RequestError("stop must not hold empty strings", "stop")
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
        raise RequestError("prompt is required: a string (or a list of one string, or token ids)", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise RequestError(f"prompt must be one string, got a list of {len(prompt)}; send one request per prompt",
                               "prompt")
        prompt = prompt[0]
    if not prompt:
        raise RequestError("prompt is empty", "prompt")
    return prompt


def chat_prompt(tokenizer, body: ChatBody) -> str:
    if not body.messages:
        raise RequestError("messages is required: a non-empty list of {role, content}", "messages")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages cannot be rendered: this model has no chat template; use /v1/completions",
                           "messages")
    messages = []
    for m in body.messages:
        parts = m.content if isinstance(m.content, list) else [{"type": "text", "text": m.content or ""}]
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in parts):
            raise RequestError("messages: only text content ({type: text, text: ...}) is supported", "messages")
        messages.append({"role": m.role, "content": "".join(p["text"] for p in parts)})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template error is the client's input, not a server fault
        raise RequestError(f"messages: the chat template rejected them: {e}", "messages") from None


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
    """What of an unfinished text can be sent now: not a trailing partial UTF-8 character or
    the start of a stop string. The engine's text only grows (cluster/engine/detokenizer.py),
    so trailing whitespace goes out at once (held back, it delayed a first chunk by a poll)."""
    text = text.rstrip("\ufffd")
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


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The request body as `model`, or a 400 that says what is wrong with it."""
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
