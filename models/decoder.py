"""Llama / Qwen2 / Qwen3 decoder over packed ragged tokens, tensor parallel.

Parameter names mirror Hugging Face's (`model.layers.0.self_attn...`, `lm_head`), with
q/k/v and gate/up fused; `models.loader` maps checkpoint names onto them.
"""
from __future__ import annotations

import torch
from torch import nn

from models import kernels
from models.attention import AttnBatch, KVCache, new_kv_cache, paged_attention
from models.config import ModelArch
from models.layers import RMSNorm, RotaryEmbedding
from models.module import Module
from models.parallel import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                             TPGroup, VocabParallelEmbedding)


class Attention(Module):
    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, tp,
                                          bias=arch.qkv_bias)
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, tp)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.nh, self.nkv, self.hd = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, arch.head_dim
        self.scale = arch.head_dim ** -0.5
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:  # Qwen3: one RMSNorm over head_dim, shared by every query (key) head
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        w = self.qkv_proj.weight
        return new_kv_cache(num_blocks, block_size, self.nkv, self.hd, w.dtype, w.device)

    def forward(self, x: torch.Tensor, batch: AttnBatch, cache: KVCache) -> torch.Tensor:
        # x: (T, H)
        qkv = self.qkv_proj(x).view(-1, self.nh + 2 * self.nkv, self.hd)
        qk = qkv[:, :self.nh + self.nkv]
        if self.qk_norm:
            q = self.q_norm(qkv[:, :self.nh].reshape(-1, self.hd)).view(-1, self.nh, self.hd)
            k = self.k_norm(qkv[:, self.nh:self.nh + self.nkv].reshape(-1, self.hd)).view(-1, self.nkv, self.hd)
            qk = torch.cat([q, k], dim=1)
        qk = self.rotary(batch.positions, qk, batch.memo)
        q, k, v = qk[:, :self.nh], qk[:, self.nh:], qkv[:, self.nh + self.nkv:]
        out = paged_attention(q, k, v, cache, batch, self.scale)  # (T, nh, hd)
        return self.o_proj(out.flatten(1))


class MLP(Module):
    """SwiGLU, intermediate dimension split over ranks. `reduce=False` leaves the partial
    sum to the caller (an MoE layer reduces its experts' sum once)."""

    def __init__(self, arch: ModelArch, tp: TPGroup, intermediate_size: int | None = None, reduce: bool = True):
        super().__init__()
        inter = intermediate_size or arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [inter] * 2, tp)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = kernels.ops_for(gate_up) if gate_up.dim() == 2 else None
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(Module):
    def __init__(self, arch: ModelArch, tp: TPGroup, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, tp)

    def forward(self, x: torch.Tensor, batch: AttnBatch, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(Module):
    layer_class = DecoderLayer

    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList([self.layer_class(arch, tp, i) for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, ids: torch.Tensor, batch: AttnBatch, caches: list[KVCache],
                out: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, batch, cache)
        return self.norm(x, out)  # (T, H): the hidden state the head and the MTP module read


class CausalLM(Module):
    """Decoder plus vocab-parallel head. `forward` returns final hidden states; `logits`
    turns selected ones into full-vocabulary logits on every rank."""

    model_class = DecoderModel

    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__()
        self.arch, self.tp = arch, tp
        self.model = self.model_class(arch, tp)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, batch: AttnBatch, caches: list[KVCache],
                out: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """The final hidden states (T, H); out: (rows, first): also copied into rows[first:first + T]
        (the rows the MTP's hidden log reserved, HiddenLog.reserve), the states returned being a
        tensor of their own."""
        return self.model(ids, batch, caches, out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (N, V)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> list[KVCache]:
        return [layer.self_attn.new_kv_cache(num_blocks, block_size) for layer in self.model.layers]
