"""Model and hardware specs of the simulator, read from yamls/models/*.yaml and yamls/hardware/*.yaml.

A model yaml holds `name`, `source` (where the shape comes from), `dtype` (weights), optional `kv_dtype`
(the cache; default `dtype`), optional `draft` (`mtp`, or `{model: other.yaml, tp: N}`) and `hf_config`
(a Hugging Face config.json inline). A hardware yaml holds the figures of `HardwareSpec` and a `sources`
list. Every error names the file and the field. How a model splits over TP ranks is in roofline.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8": "fp8", "float8_e4m3fn": "fp8"}
DENSE_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
MLA_ARCHS = ("DeepseekV3ForCausalLM",)
_REQUIRED = object()


class SpecError(ValueError):
    """A spec is missing a field or holds a bad value; the message names the file (or config) and the field."""


def _num(d: dict, key: str, where: str, kind=int, minimum=1, maximum=None, default=_REQUIRED):
    """d[key] as an int (kind=int) or float, checked against [minimum, maximum]; `default` when absent."""
    if d.get(key) is None:
        if default is _REQUIRED:
            raise SpecError(f"{where}: missing field {key!r}")
        return default
    v = d[key]
    ok = not isinstance(v, bool) and (isinstance(v, int) if kind is int else isinstance(v, (int, float)))
    if not ok or v < minimum or (maximum is not None and v > maximum):
        span = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise SpecError(f"{where}: field {key!r} must be {'an integer' if kind is int else 'a number'} {span}, got {v!r}")
    return kind(v)


def dtype_name(value, where: str, key: str) -> str:
    """The canonical dtype name (bf16, fp16, fp8, fp32, int8) of `value`, or a SpecError naming `key`."""
    name = DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if name not in DTYPE_BYTES:
        raise SpecError(f"{where}: field {key!r} must be one of {sorted(DTYPE_BYTES)}, got {value!r}")
    return name


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V3): queries through a rank-`q_lora_rank` bottleneck (None: one
    full projection); keys and values from a shared latent of `kv_lora_rank` plus one rotary key of
    `qk_rope_head_dim`, which is what the cache stores."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of `moe_intermediate_size` (top-`num_experts_per_tok` of `n_routed_experts`) plus
    always-on shared experts; the first `first_k_dense_replace` layers keep a dense MLP."""
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int


@dataclass(frozen=True)
class DraftSpec:
    """`mtp`: one extra decoder layer of the target plus eh_proj (2H x H) and the target's LM head.
    `model`: a separate small model, run at `tp` ranks (None: the target's TP)."""
    kind: str
    model: ModelSpec | None = None
    tp: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only model: dense GQA (mla and moe None) or MLA + MoE (DeepSeek-V3); dtypes
    of weights, KV cache and activations; the draft used for speculation; where the shape comes from."""
    name: str
    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    act_dtype: str = "bf16"
    tie_word_embeddings: bool = False
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    num_mtp_layers: int = 0
    draft: DraftSpec | None = None
    source: str = ""

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.moe.first_k_dense_replace if self.moe else 0

    @property
    def mtp_layers(self) -> int:
        """Layers of the MTP draft: the config's `num_nextn_predict_layers`, or 1 for an EAGLE-style head."""
        return max(self.num_mtp_layers, 1) if self.draft and self.draft.kind == "mtp" else self.num_mtp_layers

    @classmethod
    def from_hf_config(cls, d: dict, *, name: str | None = None, dtype: str = "bf16", kv_dtype: str | None = None,
                       draft: DraftSpec | None = None, source: str = "", where: str = "hf_config") -> ModelSpec:
        """A spec from a Hugging Face config.json dict (dense Llama/Qwen2/Qwen3/Mistral or DeepseekV3)."""
        archs = d.get("architectures")
        if not archs:
            raise SpecError(f"{where}: missing field 'architectures'")
        arch = archs[0]
        if arch not in DENSE_ARCHS + MLA_ARCHS:
            raise SpecError(f"{where}: field 'architectures' names {arch!r}; supported: {', '.join(DENSE_ARCHS + MLA_ARCHS)}")
        H, heads = _num(d, "hidden_size", where), _num(d, "num_attention_heads", where)
        mla = moe = None
        if arch in MLA_ARCHS:
            mla = MLASpec(_num(d, "q_lora_rank", where, default=None), _num(d, "kv_lora_rank", where),
                          _num(d, "qk_nope_head_dim", where), _num(d, "qk_rope_head_dim", where), _num(d, "v_head_dim", where))
            moe = MoESpec(_num(d, "n_routed_experts", where), _num(d, "n_shared_experts", where, minimum=0),
                          _num(d, "num_experts_per_tok", where), _num(d, "moe_intermediate_size", where),
                          _num(d, "first_k_dense_replace", where, minimum=0))
            if moe.num_experts_per_tok > moe.n_routed_experts:
                raise SpecError(f"{where}: field 'num_experts_per_tok' exceeds 'n_routed_experts'")
            if moe.first_k_dense_replace > _num(d, "num_hidden_layers", where):
                raise SpecError(f"{where}: field 'first_k_dense_replace' exceeds 'num_hidden_layers'")
        head_dim = _num(d, "head_dim", where, default=None) or H // heads
        dt = dtype_name(dtype, where, "dtype")
        return cls(name=name or d.get("_name_or_path") or arch, arch=arch, hidden_size=H,
                   intermediate_size=_num(d, "intermediate_size", where), num_layers=_num(d, "num_hidden_layers", where),
                   num_heads=heads, num_kv_heads=_num(d, "num_key_value_heads", where, default=heads), head_dim=head_dim,
                   vocab_size=_num(d, "vocab_size", where), dtype=dt,
                   kv_dtype=dtype_name(kv_dtype, where, "kv_dtype") if kv_dtype else dt,
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), mla=mla, moe=moe,
                   num_mtp_layers=_num(d, "num_nextn_predict_layers", where, minimum=0, default=0),
                   draft=draft, source=source)

@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator and its links. Bandwidths in GB/s (1e9 bytes), link and internode per direction per
    device; a TP group larger than `devices_per_node` spans nodes joined at `internode_bandwidth_GBps`."""
    name: str
    peak_tflops: dict
    hbm_bandwidth_GBps: float
    link_bandwidth_GBps: float
    allreduce_latency_us: float
    flops_efficiency: float
    bw_efficiency: float
    forward_overhead_ms: float
    step_overhead_ms: float
    host_ms_per_token: float
    sources: tuple
    host_ms_per_seq: float = 0.0
    layer_overhead_us: float = 0.0
    devices_per_node: int | None = None
    internode_bandwidth_GBps: float | None = None
    internode_latency_us: float | None = None


def _read_yaml(path: str | Path) -> tuple[dict, str]:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"spec file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: must hold a mapping of fields")
    return raw, str(path)


def _text(raw: dict, key: str, where: str) -> str:
    v = raw.get(key)
    if not isinstance(v, str) or not v.strip():
        raise SpecError(f"{where}: missing field {key!r}" if v is None else f"{where}: field {key!r} must be a non-empty string")
    return v


def load_model(path: str | Path, _depth: int = 0) -> ModelSpec:
    """A ModelSpec from a model yaml; a `draft: {model: ...}` path is read relative to this file."""
    raw, where = _read_yaml(path)
    name, source = _text(raw, "name", where), _text(raw, "source", where)
    if "dtype" not in raw:
        raise SpecError(f"{where}: missing field 'dtype'")
    hf = raw.get("hf_config")
    if not isinstance(hf, dict):
        raise SpecError(f"{where}: missing field 'hf_config'" if hf is None else f"{where}: field 'hf_config' must be a mapping")
    d, draft = raw.get("draft"), None
    if d == "mtp" or isinstance(d, dict) and d.get("kind") == "mtp":
        draft = DraftSpec("mtp")
    elif isinstance(d, dict) and "model" in d and _depth == 0:
        draft = DraftSpec("model", load_model(Path(where).parent / str(d["model"]), _depth + 1),
                          _num(d, "tp", f"{where}: draft", default=None))
    elif d is not None and _depth == 0:
        raise SpecError(f"{where}: field 'draft' must be 'mtp' or a mapping with 'model: other.yaml', got {d!r}")
    dtype = dtype_name(raw["dtype"], where, "dtype")
    kv_dtype = dtype_name(raw["kv_dtype"], where, "kv_dtype") if raw.get("kv_dtype") is not None else None
    return ModelSpec.from_hf_config(hf, name=name, dtype=dtype, kv_dtype=kv_dtype, draft=draft,
                                    source=source, where=f"{where}: hf_config")


def load_hardware(path: str | Path) -> HardwareSpec:
    """A HardwareSpec from a hardware yaml; every figure is checked for presence and range."""
    raw, where = _read_yaml(path)
    peak = raw.get("peak_tflops")
    if not isinstance(peak, dict) or not peak:
        raise SpecError(f"{where}: missing field 'peak_tflops'" if peak is None else f"{where}: field 'peak_tflops' must map dtype to TFLOP/s")
    peak = {dtype_name(k, where, "peak_tflops"): _num(peak, k, f"{where}: peak_tflops", float, 1e-9) for k in peak}
    sources = raw.get("sources")
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s.strip() for s in sources):
        raise SpecError(f"{where}: missing field 'sources'" if sources is None else f"{where}: field 'sources' must be a list of strings")
    f = lambda key, lo=0.0, hi=None, **kw: _num(raw, key, where, float, lo, hi, **kw)  # noqa: E731
    per_node = _num(raw, "devices_per_node", where, default=None)
    return HardwareSpec(
        name=_text(raw, "name", where), peak_tflops=peak, hbm_bandwidth_GBps=f("hbm_bandwidth_GBps", 1e-9),
        link_bandwidth_GBps=f("link_bandwidth_GBps", 1e-9), allreduce_latency_us=f("allreduce_latency_us"),
        flops_efficiency=f("flops_efficiency", 1e-9, 1.0), bw_efficiency=f("bw_efficiency", 1e-9, 1.0),
        forward_overhead_ms=f("forward_overhead_ms"), step_overhead_ms=f("step_overhead_ms"),
        host_ms_per_token=f("host_ms_per_token"), sources=tuple(sources),
        host_ms_per_seq=f("host_ms_per_seq", default=0.0), layer_overhead_us=f("layer_overhead_us", default=0.0),
        devices_per_node=per_node,
        internode_bandwidth_GBps=f("internode_bandwidth_GBps", 1e-9) if per_node else None,
        internode_latency_us=f("internode_latency_us") if per_node else None)
