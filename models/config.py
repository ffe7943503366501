"""Model configuration: which checkpoints to load, and the architecture read from them."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

TINY_DIR = Path(__file__).parent / "tiny"
SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass
class ModelConfig:
    """The `model:` section of a config file."""

    target: str = str(TINY_DIR / "target")  # local Hugging Face checkpoint directory
    draft: str = str(TINY_DIR / "draft")  # small LM for speculative.method=draft_model
    mtp: str | None = str(TINY_DIR / "mtp")  # MTP module for speculative.method=mtp; null: the target's own
    # MTP layer (a DeepSeek-V3 checkpoint with num_nextn_predict_layers >= 1)
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16
    max_model_len: int = 2048  # prompt + output tokens per sequence


@dataclass(frozen=True)
class DeepseekArch:
    """DeepSeek-V3's extra shape: multi-head latent attention, MoE, MTP layers."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    attention_bias: bool
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    num_nextn_predict_layers: int

    @staticmethod
    def from_dict(cfg: dict) -> DeepseekArch:
        return DeepseekArch(
            q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)), n_routed_experts=cfg["n_routed_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"], n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            moe_intermediate_size=cfg["moe_intermediate_size"], n_shared_experts=cfg.get("n_shared_experts") or 0,
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            num_nextn_predict_layers=cfg.get("num_nextn_predict_layers") or 0)

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the compressed latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelArch:
    """The decoder shape, from a Hugging Face `config.json` (Llama, Qwen2, Qwen3, DeepSeek-V3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...] = field(default=())
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before rotary
    deepseek: DeepseekArch | None = None  # DeepSeek-V3 only

    @staticmethod
    def from_dir(path: str | Path) -> "ModelArch":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"model path {str(path)!r} has no config.json (expected a local Hugging Face "
                                    f"checkpoint directory)")
        return ModelArch.from_dict(json.loads(cfg_file.read_text()))

    @staticmethod
    def from_dict(cfg: dict) -> "ModelArch":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return ModelArch(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            qk_norm=arch == "Qwen3ForCausalLM",
            deepseek=DeepseekArch.from_dict(cfg) if arch == "DeepseekV3ForCausalLM" else None,
        )

    def check_tp(self, tp_size: int) -> None:
        """Raise a ValueError naming the dimension that `tp_size` does not divide."""
        dims = [("num_attention_heads", self.num_heads), ("intermediate_size", self.intermediate_size)]
        if self.deepseek is not None:
            dims.append(("moe_intermediate_size", self.deepseek.moe_intermediate_size))
        for name, value in dims:
            if value % tp_size:
                raise ValueError(f"parallel.tp_size={tp_size} does not divide {name}={value}")
        if self.deepseek is not None:
            return  # MLA: heads split over ranks, the latent replicated; no KV heads to place
        kv = self.num_kv_heads
        if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
            raise ValueError(f"parallel.tp_size={tp_size} and num_key_value_heads={kv}: one must divide the other")
