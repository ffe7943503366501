"""DeepSeek-V3 mixture of experts: shared experts plus routed ones, tensor parallel.

Every expert's intermediate dimension is split over the ranks (gate/up column-parallel,
down row-parallel without its own reduce), so each rank holds a slice of every expert,
computes the partial sum of the experts its tokens were routed to plus the shared
experts', and the layer all-reduces once. The router is replicated.
"""
from __future__ import annotations

import torch
from torch import nn

from models.config import ModelArch
from models.decoder import MLP
from models.module import Module
from models.parallel import TPGroup


class Router(Module):
    """Sigmoid scores; experts chosen on scores + e_score_correction_bias, within the
    topk_group best of n_group groups (a group scored by its two best experts); weights
    are the chosen experts' plain scores, normalised if norm_topk_prob, times
    routed_scaling_factor. Computed in float32, as transformers does."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        ds = arch.deepseek
        self.num_experts, self.top_k = ds.n_routed_experts, ds.num_experts_per_tok
        self.n_group, self.topk_group = ds.n_group, ds.topk_group
        self.norm_topk_prob, self.scaling = ds.norm_topk_prob, ds.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, arch.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(full)

    def _apply(self, fn, recurse=True):
        """Moved with the model but kept in float32 (transformers and vLLM keep the router
        and its bias so): a rounded bias would change which experts are chosen."""
        device = fn(torch.empty(0, device=self.weight.device)).device
        return super()._apply(lambda t: t.to(device), recurse)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: (T, H) -> weights (T, top_k) float32, experts (T, top_k)
        scores = torch.sigmoid(x.float() @ self.weight.float().t())  # (T, E)
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)  # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()  # (T, G)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(-1, self.num_experts)
        experts = choice.topk(self.top_k, dim=-1, sorted=False).indices  # (T, top_k)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class MoE(Module):
    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__()
        ds = arch.deepseek
        self.tp = tp
        self.gate = Router(arch)
        self.experts = nn.ModuleList([MLP(arch, tp, ds.moe_intermediate_size, reduce=False)
                                      for _ in range(ds.n_routed_experts)])
        self.shared_experts = (MLP(arch, tp, ds.moe_intermediate_size * ds.n_shared_experts, reduce=False)
                               if ds.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, H)
        weights, experts = self.gate(x)  # (T, top_k) each
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)  # this rank's slice of every expert, summed over ranks
