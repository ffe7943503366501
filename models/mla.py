"""DeepSeek-V3 multi-head latent attention (MLA), tensor parallel, over the paged cache.

Per token and layer the cache keeps what `kv_a_proj_with_mqa` makes, not the heads:
the normalised latent (kv_lora_rank values) and the shared rotated key
(qk_rope_head_dim), in two block tensors (num_blocks, B, kv_lora_rank) and
(num_blocks, B, qk_rope_head_dim), replicated on every rank. Attention expands each
sequence's gathered latents into this rank's heads of k_nope and v with `kv_b_proj`.
The pair has the block-first layout of the other caches, so code that copies a block
(`ModelRunner._fork`) copies both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.attention import AttnBatch, KVCache
from models.config import ModelArch
from models.layers import RMSNorm, RotaryEmbedding, yarn_mscale
from models.module import Module
from models.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, TPGroup


def new_latent_cache(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                     device: torch.device | str) -> KVCache:
    latent = torch.zeros(num_blocks, block_size, kv_lora_rank, dtype=dtype, device=device)
    rope = torch.zeros(num_blocks, block_size, rope_dim, dtype=dtype, device=device)
    return latent, rope


def softmax_scale(arch: ModelArch) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared (as transformers)."""
    ds = arch.deepseek
    scale = (ds.qk_nope_head_dim + ds.qk_rope_head_dim) ** -0.5
    rope = arch.rope_scaling or {}
    if rope and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


class MLAttention(Module):
    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__()
        ds, hidden = arch.deepseek, arch.hidden_size
        self.nope, self.rope, self.v_dim, self.rank = (ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim,
                                                       ds.kv_lora_rank)
        qk_dim = self.nope + self.rope
        if ds.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, arch.num_heads * qk_dim, tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, ds.q_lora_rank, bias=ds.attention_bias)
            self.q_a_layernorm = RMSNorm(ds.q_lora_rank, arch.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(ds.q_lora_rank, arch.num_heads * qk_dim, tp)  # split by heads
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.rope, bias=ds.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, arch.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, arch.num_heads * (self.nope + self.v_dim), tp)
        self.o_proj = RowParallelLinear(arch.num_heads * self.v_dim, hidden, tp, bias=ds.attention_bias)
        self.rotary = RotaryEmbedding(self.rope, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.interleave = ds.rope_interleave
        self.nh = arch.num_heads // tp.size
        self.scale = softmax_scale(arch)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        w = self.kv_a_proj_with_mqa.weight
        return new_latent_cache(num_blocks, block_size, self.rank, self.rope, w.dtype, w.device)

    def forward(self, x: torch.Tensor, batch: AttnBatch, cache: KVCache) -> torch.Tensor:
        # x: (T, H)
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.nh, self.nope + self.rope)  # (T, nh, nope + rope)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # (T, rank)
        rot = torch.cat([q[:, :, self.nope:], k_rot[:, None]], dim=1)  # (T, nh + 1, rope): queries and the shared key
        if self.interleave:  # pairs (x0, x1), (x2, x3)... as halves: the same rotation, dims permuted alike
            rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        rot = self.rotary(batch.positions, rot.contiguous(), batch.memo)
        q = torch.cat([q[:, :, :self.nope], rot[:, :self.nh]], dim=-1)
        write_latent(latent, rot[:, self.nh], cache, batch)
        out = self._attend(q, cache, batch)  # (T, nh, v)
        return self.o_proj(out.flatten(1))

    def _attend(self, q: torch.Tensor, cache: KVCache, batch: AttnBatch) -> torch.Tensor:
        """Per sequence: its queries against positions 0..last of its gathered latents,
        expanded to this rank's heads."""
        out = q.new_empty(q.shape[0], self.nh, self.v_dim)
        first = 0
        for i, (start, length) in enumerate(zip(batch.starts, batch.lens)):
            context = start + length
            latent, k_rot = gather_latent(cache, batch.tables[i], context)  # (C, rank), (C, rope)
            kv = self.kv_b_proj(latent).view(context, self.nh, self.nope + self.v_dim)
            keys = torch.cat([kv[..., :self.nope], k_rot[:, None].expand(context, self.nh, self.rope)], dim=-1)
            values = kv[..., self.nope:]
            q_pos = start + torch.arange(length, device=q.device)
            mask = torch.arange(context, device=q.device)[None, :] <= q_pos[:, None]  # (L, C)
            o = F.scaled_dot_product_attention(q[first:first + length].transpose(0, 1), keys.transpose(0, 1),
                                               values.transpose(0, 1), attn_mask=mask, scale=self.scale)
            out[first:first + length] = o.transpose(0, 1)
            first += length
        return out


def write_latent(latent: torch.Tensor, k_rot: torch.Tensor, cache: KVCache, batch: AttnBatch) -> None:
    """latent: (T, rank), k_rot: (T, rope), written at each token's slot."""
    cache[0].view(-1, cache[0].shape[-1])[batch.slots] = latent
    cache[1].view(-1, cache[1].shape[-1])[batch.slots] = k_rot


def gather_latent(cache: KVCache, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions 0..length-1 of one sequence (table: (W,) its blocks): (length, rank), (length, rope)."""
    blocks = table[: -(-length // cache[0].shape[1])]
    return (cache[0][blocks].flatten(0, 1)[:length], cache[1][blocks].flatten(0, 1)[:length])
