"""The OpenAI-compatible server, live on Ray Serve, queried with the official `openai` client.

    python -m pytest -q tests/test_serve.py
"""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from cluster.config import ConfigError
from tests.conftest import greedy, local_engine, tiny_config

API_KEY = "sk-adaspec-test"
MODEL = "adaspec-tiny"
MAX_TOKENS = 10
PROMPTS = ["How do I bake bread?", "Write a poem about the sea", "What is Ray?", "Tell me a story",
           "Explain tensor parallelism.", "Hi", "List three fruits.", "Why is the sky blue?"]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "How do I bake bread?"}]
# The validate-time model starts untrained and refits online, so /metrics has a MAPE to show.
SERVER_SETTINGS = ("parallel.tp_size=1", "parallel.executor=ray", "speculative.adaptive.enabled=true",
                   "speculative.adaptive.profile_on_start=false", "speculative.adaptive.refit_every=16",
                   f"serve.api_key={API_KEY}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides_of(cfg) -> list[str]:
    """Every key of a Config as `key.path=value`, so the server runs exactly `cfg`."""
    out = []

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                out.append(f"{prefix}{key}={json.dumps(value)}")

    walk("", cfg.to_dict())
    return out


@pytest.fixture(scope="module")
def expected():
    """Greedy texts from an in-process engine on the same config: the prompts, then the chat."""
    cfg = tiny_config(*SERVER_SETTINGS)
    engine = local_engine(cfg)
    try:
        chat_text = engine.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        results = engine.generate(PROMPTS + [chat_text], greedy(MAX_TOKENS))
    finally:
        engine.shutdown()
    return [samples[0] for samples in results]


@pytest.fixture(scope="module")
def base_url(ray_session):
    from ray import serve

    from cluster.serving.app import build_app
    from cluster.serving.ingress import app_url

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_app({"config": "yamls/tiny.yaml", "overrides": overrides_of(tiny_config(*SERVER_SETTINGS))})
        serve.run(app, name="adaspec-test", route_prefix="/", blocking=False)
        url = app_url("adaspec-test", "/", f"http://127.0.0.1:{port}")
        assert url != f"http://127.0.0.1:{port}", "the app should answer on its own port (direct ingress)"
        yield url
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def client(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def http(base_url: str, path: str, body: bytes | None = None, key: str | None = API_KEY) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base_url + path, data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def complete(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def test_health_and_models(base_url, client):
    assert http(base_url, "/health", key=None) == (200, {"status": "ok"})
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    status, body = http(base_url, "/v1/nowhere")
    assert status == 404 and body["error"]["message"]


def test_completion_matches_engine(client, expected):
    r = complete(client, PROMPTS[0], n=2)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text == expected[0].text and c.finish_reason == "length" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected[0].prompt_ids), 2 * MAX_TOKENS)


def test_chat_matches_engine(client, expected):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected[-1].text
    assert r.usage.prompt_tokens == len(expected[-1].prompt_ids)


def test_streams_join_to_the_full_text(client, expected):
    chunks = list(complete(client, PROMPTS[1], stream=True))
    assert len(chunks) > 1 and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == expected[1].text
    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == expected[-1].text
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == MAX_TOKENS
    joined = {0: "", 1: ""}  # two samples in one stream: each one's deltas join to its text
    for c in complete(client, PROMPTS[2], stream=True, n=2):
        for choice in c.choices:
            joined[choice.index] += choice.text
    assert joined == {0: expected[2].text, 1: expected[2].text}


def test_concurrent_clients_get_engine_texts(client, expected):
    texts: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            texts[i] = complete(client, PROMPTS[i]).choices[0].text
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert [texts[i] for i in range(len(PROMPTS))] == [e.text for e in expected[:len(PROMPTS)]]


def test_wrong_or_missing_key_is_401(base_url):
    import openai

    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 401
    status, body = http(base_url, "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and body["error"]["message"]
    assert http(base_url, "/metrics", key="sk-wrong")[0] == 401


LONG = "word " * 600  # more tokens than model.max_model_len=512
BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "adaspec-tiny", "prompt": ', None, "not valid JSON"),
    ("non-UTF-8 body", "/v1/completions", b'{"prompt": "caf\xe9", "max_tokens": 2}', None, "UTF-8"),
    ("JSON that is not an object", "/v1/completions", b'["Hi"]', None, "JSON object"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, "model", "gpt-4"),
    ("missing prompt", "/v1/completions", {"model": MODEL, "max_tokens": 2}, "prompt", "prompt is required"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, "messages", "messages is required"),
    ("zero max_tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ("negative max_tokens", "/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, "max_tokens",
     "max_tokens"),
    ("prompt longer than the context", "/v1/completions", {"prompt": LONG, "max_tokens": 4}, "prompt",
     "context length"),
    ("wrong field type", "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature", "temperature"),
    ("several prompts", "/v1/completions", {"prompt": ["a", "b"]}, "prompt", "one string"),
    ("prompt of the wrong type", "/v1/completions", {"prompt": 5}, "prompt", "prompt"),
    ("message without a role", "/v1/chat/completions", {"messages": [{"content": "Hi"}]}, "messages", "role"),
    ("empty stop string", "/v1/completions", {"prompt": "Hi", "stop": [""]}, "stop", "stop"),
    ("too many stop strings", "/v1/completions", {"prompt": "Hi", "stop": ["a"] * 17}, "stop", "at most 16"),
    ("n too large", "/v1/completions", {"prompt": "Hi", "n": 17}, "n", "n must be"),
    ("integer of 5000 digits", "/v1/completions", b'{"prompt": "Hi", "seed": ' + b"9" * 5000 + b"}", None,
     "not acceptable JSON"),
]


@pytest.mark.parametrize("name,path,body,param,says", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_are_400(base_url, name, path, body, param, says):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = http(base_url, path, raw)
    assert status == 400, (name, answer)
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"], error
    assert error["param"] == param


def test_oversized_body_is_413(base_url):
    """Past serve.max_request_bytes (1 MiB here), declared by Content-Length or streamed in
    chunks without one, the body is refused before it is all read."""
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    status, answer = http(base_url, "/v1/completions", big)
    assert status == 413 and "max_request_bytes" in answer["error"]["message"], answer
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))  # urllib sends an iterator chunked
    req = urllib.request.Request(base_url + "/v1/completions", data=chunks, headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    assert e.value.code == 413 and "max_request_bytes" in e.value.read().decode()


def test_bad_request_through_the_client(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)
    assert "max_tokens" in str(e.value)


def test_metrics(base_url, client):
    complete(client, PROMPTS[2])
    deadline = time.monotonic() + 10
    while True:  # a scrape never waits on the profile actor: the fit's report may take a scrape or two
        status, text = http(base_url, "/metrics")
        assert status == 200
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}
        if "adaspec_time_model_mape" in values or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert values['adaspec_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert values['adaspec_requests_total{route="/v1/completions",status="400"}'] >= 1
    assert values['adaspec_requests_total{route="/v1/completions",status="401"}'] >= 1  # test_wrong_or_missing_key
    assert values["adaspec_generation_tokens_total"] >= MAX_TOKENS and values["adaspec_prompt_tokens_total"] > 0
    for name in ("adaspec_time_to_first_token_seconds_count", "adaspec_time_per_output_token_seconds_count",
                 "adaspec_e2e_request_latency_seconds_count", "adaspec_spec_drafted_tokens_total",
                 "adaspec_spec_verified_tokens_total", "adaspec_spec_accepted_tokens_total"):
        assert values[name] > 0, name
    assert values["adaspec_queue_depth"] == 0 and values["adaspec_running_sequences"] == 0  # all finished
    assert values["adaspec_mean_acceptance_length"] >= 1
    assert 0 <= values['adaspec_acceptance_rate{position="0"}'] <= 1
    # the fit's error as the link last saw it: a positive, finite fraction (NaN or a missing fit would fail)
    assert values["adaspec_time_model_version"] >= 1 and 0 < values["adaspec_time_model_mape"] < 100


def test_app_arguments_are_checked():
    from cluster.serving.app import build_app

    with pytest.raises(ConfigError, match="unknown application argument 'confg'"):
        build_app({"confg": "yamls/tiny.yaml"})
    with pytest.raises(ConfigError, match="does not exist"):
        build_app({"config": "yamls/nope.yaml"})
    with pytest.raises(ConfigError, match="parallel.tp_size"):
        build_app({"config": "yamls/tiny.yaml", "overrides": ["parallel.tp_size=0"]})


def test_stream_deltas_hold_back_what_may_change():
    from cluster.engine.request import RequestOutput
    from cluster.serving.protocol import SSEState

    state = SSEState("text", "cmpl-1", MODEL, 0, 1, ("\n\nUser:",), False)
    texts = ["Sure", "Sure, caf\ufffd", "Sure, café\n", "Sure, café\n\nUs", "Sure, café"]
    chunks = []
    for i, text in enumerate(texts):
        final = i == len(texts) - 1
        out = RequestOutput(request_id="r", sample_index=0, prompt_ids=[1], token_ids=[2] * (i + 1), text=text,
                            finished=final, finish_reason="stop" if final else None, new_token_ids=[2])
        chunks += [json.loads(c.removeprefix("data: ")) for c in state.update(out)]
    deltas = [c["choices"][0]["text"] for c in chunks]
    assert deltas == ["Sure", ", caf", "é", ""] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # trailing whitespace goes out at once (the engine's text only grows); held back, a first
    # chunk of " " waited a whole poll
    plain = SSEState("text", "cmpl-2", MODEL, 0, 1, (), False)
    first = RequestOutput(request_id="r", sample_index=0, prompt_ids=[1], token_ids=[2], text="Hi ",
                          finished=False, finish_reason=None, new_token_ids=[2])
    assert [json.loads(c.removeprefix("data: "))["choices"][0]["text"] for c in plain.update(first)] == ["Hi "]


def test_a_stream_writes_once_per_batch_and_ends_in_one_write():
    """The SSE answer: one write per batch of updates that arrived together; the last text,
    the usage and [DONE] in the write that ends the response."""
    import asyncio
    from types import SimpleNamespace

    from cluster.engine.request import RequestOutput
    from cluster.serving.asgi import GenerationRoutes
    from cluster.serving.engine_client import RequestStream
    from cluster.serving.protocol import SSEState

    def out(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput(request_id="r", sample_index=0, prompt_ids=[1, 2], token_ids=[3] * len(text.split()),
                             text=text, finished=finished, finish_reason="length" if finished else None,
                             new_token_ids=[3])

    observed = []
    server = SimpleNamespace(metrics=SimpleNamespace(observe_finished=lambda o, s: observed.append(o)))
    routes, writes = GenerationRoutes(None, server), []

    async def send(message) -> None:
        writes.append(message)

    async def run() -> None:
        stream = RequestStream("r", 1)
        for update in (out("a"), out("a b")):  # arrived together: one write
            stream.queue.put_nowait(update)
        state = SSEState("text", "cmpl-r", MODEL, 0, 1, (), True)
        task = asyncio.ensure_future(routes._stream(send, stream, state, 0.0))
        await asyncio.sleep(0.01)
        stream.finished.add(0)  # as EngineClient._route marks it on the end's arrival
        stream.queue.put_nowait(out("a b c"))
        stream.queue.put_nowait(out("a b c d", finished=True))
        await task

    asyncio.run(run())
    assert [w["type"] for w in writes] == ["http.response.start", "http.response.body", "http.response.body"]
    first, last = (w["body"].decode().split("\n\n")[:-1] for w in writes[1:])
    texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in first]
    assert texts == ["a", " b"] and writes[1]["more_body"] and not writes[2]["more_body"]
    closing = [json.loads(e.removeprefix("data: ")) for e in last[:-1]]
    assert [c["choices"][0]["text"] for c in closing[:2]] == [" c", " d"] and closing[1]["choices"][0][
        "finish_reason"] == "length"
    assert closing[2]["choices"] == [] and closing[2]["usage"]["completion_tokens"] == 4
    assert last[-1] == "data: [DONE]" and len(observed) == 1


def test_generation_routes_answer_refusals_and_faults_as_openai_errors():
    """The plain ASGI routes, without a server: 405, 413 (declared and streamed), 400 naming
    what is wrong, 429 with Retry-After, and a fault of the server's own as a 500 in
    OpenAI's shape; other paths go to the app behind."""
    import asyncio
    from types import SimpleNamespace

    from cluster.engine.request import QueueFullError
    from cluster.serving.asgi import GenerationRoutes

    def prompt_of(kind, body):
        if getattr(body, "prompt", None) == "boom":
            raise KeyError("a bug")
        raise QueueFullError("the waiting queue is full")

    server = SimpleNamespace(cfg=SimpleNamespace(serve=SimpleNamespace(max_request_bytes=64)), prompt_of=prompt_of)
    behind = []

    async def app(scope, receive, send) -> None:
        behind.append(scope["path"])

    routes = GenerationRoutes(app, server)

    def call(method: str, path: str, body: bytes, headers=()) -> tuple[int, dict, dict]:
        sent, parts = [], [body[:10], body[10:]]

        async def receive():
            chunk = parts.pop(0) if parts else b""
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

        async def send(message) -> None:
            sent.append(message)

        scope = {"type": "http", "method": method, "path": "/arm" + path, "root_path": "/arm", "headers": list(headers)}
        asyncio.run(routes(scope, receive, send))
        if not sent:
            return 0, {}, {}
        return sent[0]["status"], json.loads(sent[1]["body"]), dict(sent[0]["headers"])

    assert call("GET", "/v1/completions", b"")[0] == 405
    assert call("POST", "/v1/completions", b"{}", [(b"content-length", b"65")])[0] == 413
    assert call("POST", "/v1/completions", b'{"prompt": "' + b"x" * 70 + b'"}')[0] == 413
    status, body, _ = call("POST", "/v1/completions", b'{"prompt": "Hi", "n": "two"}')
    assert status == 400 and body["error"]["param"] == "n"
    status, body, headers = call("POST", "/v1/chat/completions", b'{"messages": []}')
    assert status == 429 and headers[b"retry-after"] == b"1" and body["error"]["code"] == "queue_full"
    status, body, _ = call("POST", "/v1/completions", b'{"prompt": "boom"}')
    assert status == 500 and body["error"]["type"] == "server_error"
    assert call("GET", "/v1/models", b"")[0] == 0 and behind == ["/arm/v1/models"]


def test_generation_routes_take_post_only(base_url):
    status, body = http(base_url, "/v1/completions")
    assert status == 405 and "takes POST" in body["error"]["message"], body


def collect(loop, until, deadline_s: float = 120.0) -> list:
    """Poll an EngineLoop until `until(updates so far)`; every update, in order."""
    seen, start = [], time.monotonic()
    while not until(seen):
        assert time.monotonic() - start < deadline_s, "the engine loop stalled"
        seen += loop.poll(0.5)
    return seen


def test_engine_loop_batches_coalesces_and_aborts(expected):
    """Concurrent requests share steps; a poll coalesces a sample's updates (its new tokens
    joined); an aborted request leaves the engine and sends nothing more."""
    from cluster.engine.request import RequestError, RequestParams
    from cluster.serving.engine_loop import EngineLoop

    engine = local_engine(tiny_config(*SERVER_SETTINGS))
    running: list[int] = []
    step = engine.step
    engine.step = lambda: (running.append(len(engine.scheduler.running)), step())[1]
    loop = EngineLoop(engine)
    try:
        for i, p in enumerate(PROMPTS[:4]):
            loop.add(f"r{i}", p, greedy(MAX_TOKENS))
        time.sleep(0.3)  # let several steps' updates pile up before the first poll
        updates = collect(loop, lambda seen: sum(u.finished for u in seen) == 4)
        finals = {u.request_id: u for u in updates if u.finished}
        assert [finals[f"r{i}"].text for i in range(4)] == [e.text for e in expected[:4]]
        for i in range(4):  # the new tokens of every update, joined, are the output
            joined = [t for u in updates if u.request_id == f"r{i}" for t in u.new_token_ids]
            assert joined == finals[f"r{i}"].token_ids
        assert len(updates) < 4 * MAX_TOKENS  # coalesced: fewer updates than tokens
        assert max(running) >= 2
        with pytest.raises(RequestError, match="max_tokens"):
            loop.add("bad", "Hi", RequestParams(max_tokens=0))

        loop.add("long", PROMPTS[0], greedy(400))
        collect(loop, lambda seen: any(u.request_id == "long" for u in seen))
        assert loop.abort("long") == 1
        blocks = engine.scheduler.blocks
        assert not engine.has_work() and not engine.seqs and len(blocks.free_blocks) == len(blocks.refs)
        time.sleep(0.2)
        assert all(u.request_id != "long" or not u.finished for u in loop.poll(0.1))
        assert loop.abort("long") == 0  # already gone
    finally:
        loop.shutdown()
        engine.shutdown()


def test_load_streaming_clients_for_a_bounded_time(client, expected):
    """12 streaming clients loop for a bounded time (loopback only): no errors but
    intended 429s, and every completed stream joins to the engine's greedy text."""
    import time

    import openai

    deadline, clients = time.monotonic() + 20.0, 12
    done, errors, refused = [], [], []

    def loop(c: int) -> None:
        for r in range(50):  # bounded in count as well as in time
            if time.monotonic() > deadline:
                return
            i = (c + r) % len(PROMPTS)
            try:
                chunks = list(complete(client, PROMPTS[i], stream=True))
                done.append((i, "".join(ch.choices[0].text for ch in chunks if ch.choices)))
            except openai.RateLimitError:
                refused.append(i)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    threads = [threading.Thread(target=loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(done) >= clients
    assert all(text == expected[i].text for i, text in done)


FIELDS = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "stream", "ignore_eos")


def _json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=False),
                        st.text(max_size=40))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                        st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)


def test_fuzzed_requests_never_500(base_url):
    """Random bodies (random JSON under the API's field names, and raw bytes) get an
    answer below 500, quickly: no crash, no hang."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    small_tokens = st.integers(-3, 6)  # keep accepted generations short
    body = st.fixed_dictionaries({}, optional={f: (small_tokens if f == "max_tokens" else _json_values())
                                               for f in FIELDS})

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
           payload=st.one_of(body.map(lambda d: json.dumps(d).encode()), st.binary(max_size=64)))
    def check(path, payload):
        status, _ = http(base_url, path, payload or b"{}")
        assert status < 500, (path, payload[:200], status)

    check()


def test_client_that_goes_away_is_aborted(base_url):
    """A streaming client that disconnects after two chunks: the engine drops its request
    (counted as aborted) instead of generating all of it."""
    import http.client as httpclient

    host, port = base_url.removeprefix("http://").split(":")
    _, before = http(base_url, "/metrics")
    conn = httpclient.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                    "Authorization": f"Bearer {API_KEY}"})
    response = conn.getresponse()
    assert response.status == 200
    chunks = 0
    while chunks < 2:
        chunks += response.readline().startswith(b"data: ")
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, metrics = http(base_url, "/metrics")
        if metric(metrics, "adaspec_aborted_sequences_total") == metric(before, "adaspec_aborted_sequences_total") + 1:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the disconnected request was not aborted")
    assert metric(metrics, "adaspec_running_sequences") == 0


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_worker_death_mid_stream_is_survived(base_url, client):
    """Last in this module, since it kills the server's TP worker: SIGKILL the rank's
    process while three streams are in flight. The Engine rebuilds the worker group and
    recomputes the requests; every stream still ends with exactly its undisturbed text."""
    import os
    import signal
    import subprocess

    tokens, prompts = 160, PROMPTS[:3]
    kw = dict(model=MODEL, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})
    reference = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    started = [threading.Event() for _ in prompts]
    results: dict[int, tuple[str, str, bool]] = {}

    def stream(i: int) -> None:
        pieces, reason = [], None
        for chunk in client.completions.create(prompt=prompts[i], stream=True, **kw):
            pieces.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
            started[i].set()
        results[i] = "".join(pieces), reason

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    pids = subprocess.run(["pgrep", "-f", "^ray::TPWorker"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, pids  # this server's one rank
    in_flight = len(results) < len(prompts)
    os.kill(int(pids[0]), signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert in_flight, "the streams ended before the kill; make them longer"
    assert [results[i] for i in range(len(prompts))] == [(text, "length") for text in reference]
    _, metrics = http(base_url, "/metrics")
    assert "adaspec_worker_recoveries_total 1.0" in metrics
    assert client.completions.create(prompt=prompts[0], **kw).choices[0].text == reference[0]  # still serving


def test_served_model_name_follows_the_checkpoint(tmp_path):
    """serve.model_name when set; else the checkpoint directory's name (adaspec-tiny for the bundled pair)."""
    import shutil

    from cluster.serving.app import served_model_name
    from models.config import TINY_DIR
    from tests.conftest import tiny_config

    other = tmp_path / "my-llama-7b"
    shutil.copytree(TINY_DIR / "target", other)
    assert served_model_name(tiny_config()) == "adaspec-tiny"
    assert served_model_name(tiny_config(f"model.target={other}")) == "my-llama-7b"
    assert served_model_name(tiny_config(f"model.target={other}", "serve.model_name=prod")) == "prod"

