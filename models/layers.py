"""Normalisation and rotary position embedding (default, llama3 and YaRN scaling)."""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from models import kernels
from models.module import Module


class RMSNorm(Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(full)

    def forward(self, x: torch.Tensor, out: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """out: (rows, first): the result is also copied into rows[first:first + len(x)] (the MTP's
        hidden log), past the caches where the kernels run; what it returns is its own tensor."""
        ops = kernels.ops_for(x, self.weight) if x.dim() == 2 else None
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps) if out is None else ops.rms_norm(x, self.weight, self.eps,
                                                                                            *out)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            y = nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused op
        else:  # normalise in float32, then scale in the weights' dtype (as transformers does)
            y = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        if out is None:
            return y
        rows, first = out
        rows[first:first + len(y)].copy_(y)
        return y


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short kept, a
    smooth blend in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, blended, out)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, theta: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (as transformers computes it): low frequencies divided by `factor`, high ones
    kept, a linear ramp between; cos and sin scaled by the attention factor."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


@functools.lru_cache(maxsize=8)
def _tables(max_positions: int, inv_freq: tuple[float, ...], scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), torch.tensor(inv_freq, dtype=torch.float64))
    return (freqs.cos() * scale).float(), (freqs.sin() * scale).float()


class RotaryEmbedding(Module):
    """Neox-style rotation (halves), indexed by absolute position per token."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        scale = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "yarn":
            inv_freq, scale = _yarn_inv_freq(inv_freq, scaling, theta, head_dim)
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3, yarn)")
        cos, sin = _tables(max_positions, tuple(inv_freq.tolist()), scale)
        self.register_buffer("cos", cos, persistent=False)  # (P, hd/2), one tensor shared by every layer
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor, memo: dict | None = None) -> torch.Tensor:
        """qk: (T, heads, hd), query and key heads side by side, rotated in one pass (in place
        where the CPU kernel applies); positions: (T,). `memo` (one per forward) shares the
        gathered cos/sin between layers."""
        ops = kernels.ops_for(qk) if qk.stride(-1) == 1 and qk.stride(-2) == qk.shape[-1] else None
        if ops is not None:
            ops.rotary_(qk, positions, self.cos, self.sin)
            return qk
        key = ("rope", self.cos.data_ptr())
        cached = memo.get(key) if memo is not None else None
        if cached is None:
            cached = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (T, 1, hd/2)
            if memo is not None:
                memo[key] = cached
        cos, sin = cached
        x1, x2 = qk.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(qk.dtype)
