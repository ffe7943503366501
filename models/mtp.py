"""DeepSeek-V3-style multi-token-prediction (MTP) module.

Input pair at position p: the target's final hidden state at p-1 and the embedding of the
token at p. Output: a hidden state whose logits, through the target's own head, predict
the token at p+1. Run k times autoregressively, feeding its own hidden state back, it
drafts k tokens. Checkpoint names (`models/tiny/mtp/model.safetensors`):
`enorm.weight hnorm.weight eh_proj.weight layer.<Hugging Face decoder-layer names> norm.weight`.
A DeepSeek-V3 checkpoint carries its own MTP layer instead (`load_deepseek_mtp`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from models.attention import AttnBatch, KVCache
from models.config import ModelArch
from models.decoder import DecoderLayer
from models.deepseek import DeepseekMTPLayer
from models.layers import RMSNorm
from models.loader import iter_tensors, load_weights
from models.module import Module
from models.parallel import ReplicatedLinear, TPGroup


class MTPModule(Module):
    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__()
        hidden = arch.hidden_size
        self.enorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        self.layer = DecoderLayer(arch, tp)
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, batch: AttnBatch, cache: KVCache) -> torch.Tensor:
        # embeds, prev_hidden: (T, H) -> (T, H), normalised for the shared head
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        return self.norm(self.layer(x, batch, cache))

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return self.layer.self_attn.new_kv_cache(num_blocks, block_size)


def load_mtp(path: str | Path, arch: ModelArch, tp: TPGroup, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> MTPModule:
    """The MTP block has the target's layer shape (`arch`), so it shards like the target."""
    module = MTPModule(arch, tp)
    loaded = load_weights(module, iter_tensors(path))
    missing = {n for n, _ in module.named_parameters()} - loaded
    if missing:
        raise KeyError(f"MTP checkpoint {str(path)!r} lacks parameters: {sorted(missing)[:5]}")
    return module.to(device=device, dtype=dtype).eval()


def load_deepseek_mtp(path: str | Path, arch: ModelArch, tp: TPGroup, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> DeepseekMTPLayer:
    """The first MTP layer of the target checkpoint at `path` (its embedding is the target's)."""
    if arch.deepseek is None or arch.deepseek.num_nextn_predict_layers < 1:
        raise ValueError(f"model.mtp is null, so speculative.method=mtp needs the target's own MTP layer, but "
                         f"{str(path)!r} has num_nextn_predict_layers=0 (or is not a DeepSeek-V3 checkpoint); "
                         f"set model.mtp to a separate MTP module")
    layer = DeepseekMTPLayer(arch, tp)
    prefix = f"model.layers.{arch.num_layers}."
    tensors = ((n, t) for n, t in iter_tensors(path) if n.startswith(prefix) and ".embed_tokens." not in n)
    loaded = load_weights(layer, tensors, prefix)
    missing = {n for n, _ in layer.named_parameters()} - loaded
    if missing:
        raise KeyError(f"checkpoint {str(path)!r} says num_nextn_predict_layers="
                       f"{arch.deepseek.num_nextn_predict_layers} but lacks MTP parameters {prefix}"
                       f"{sorted(missing)[:5]}")
    return layer.to(device=device, dtype=dtype).eval()
