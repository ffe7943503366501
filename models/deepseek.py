"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): MLA attention, dense MLPs in the first
`first_k_dense_replace` layers and MoE after, tensor parallel; and its own MTP layers,
stored after the last decoder layer as `model.layers.{num_hidden_layers + i}.*`.

The decoder shares `CausalLM`'s embedding, head and interface with Llama / Qwen; only
the layers differ, and its KV cache holds latents (models/mla.py).
"""
from __future__ import annotations

import torch

from models.attention import AttnBatch, KVCache
from models.config import ModelArch
from models.decoder import MLP, CausalLM, DecoderModel
from models.layers import RMSNorm
from models.mla import MLAttention
from models.module import Module
from models.moe import MoE
from models.parallel import ParallelLMHead, ReplicatedLinear, TPGroup


class DeepseekDecoderLayer(Module):
    def __init__(self, arch: ModelArch, tp: TPGroup, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = MLAttention(arch, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MoE(arch, tp) if index >= arch.deepseek.first_k_dense_replace else MLP(arch, tp)

    def forward(self, x: torch.Tensor, batch: AttnBatch, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(DecoderModel):
    layer_class = DeepseekDecoderLayer


class DeepseekV3CausalLM(CausalLM):
    model_class = DeepseekModel


class SharedHead(Module):
    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """One of the checkpoint's MTP layers: at position p, the target's hidden state at
    p-1 and the embedding of the token at p, through enorm / hnorm / eh_proj and a full
    decoder block (MLA, MoE). The block's output is the hidden state the next draft
    step feeds back (as vLLM's DeepSeek MTP); `logits` normalises it with
    `shared_head.norm` and applies the layer's own head, `shared_head.head`."""

    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__(arch, tp, arch.num_layers)
        hidden = arch.hidden_size
        self.enorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        self.shared_head = SharedHead(arch, tp)

    def forward(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, batch: AttnBatch,
                cache: KVCache) -> torch.Tensor:
        # embeds, prev_hidden: (T, H) -> (T, H)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        return super().forward(x, batch, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden)).float()  # (N, V)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return self.self_attn.new_kv_cache(num_blocks, block_size)
