"""Roofline cost of one speculative-decoding step of a model on `tp` ranks of one accelerator type.

A forward is a sum of blocks (per layer: attention and MLP; then the LM head; for an MTP draft also eh_proj),
each timed on one rank as a roofline:

    time = max(bytes / (hbm_bandwidth * bw_efficiency), flops / (peak_flops[dtype] * flops_efficiency))
    bytes = the rank's weight shard (read once per forward, whatever the token count; of an MoE MLP only
            the experts the batch touches, E * (1 - (1 - k/E)^T) of E under uniform top-k routing)
          + KV cache: sum_i (kv[i] + q[i]) positions x the rank's cache elements per position
    flops = 2 x active params x T tokens + sum_i q[i] (kv[i] + q[i]) x attention-core FLOPs per pair

where sequence i computes q[i] new tokens after kv[i] cached ones and T = sum_i q[i]. Linear layers run at
the weights' dtype where the chip has it (else bf16), the attention core at the activations' dtype.
Added: two all-reduces per layer of T x hidden activations (latency + 2(g-1)/g x bytes / link bandwidth
within a node of g ranks; a TP group over m nodes adds 2(m-1)/m x bytes/g over the internode links;
none at tp=1), the fixed per-forward overhead and a per-layer launch overhead. Embedding rows are gathered,
not streamed, and are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.sim.specs import DTYPE_BYTES, HardwareSpec, ModelSpec, SpecError


@dataclass(frozen=True)
class Shard:
    """One TP rank's share of a model, in elements: weights of one attention block, one dense MLP, the
    always-read part of one MoE MLP (router + shared experts), one routed expert, the LM head, the embedding
    and eh_proj; KV-cache elements per position per layer; attention-core FLOPs per (query, key) pair per layer."""
    attn: int
    mlp_dense: int
    moe_fixed: int
    expert: int
    head: int
    embed: int
    eh_proj: int
    kv_per_pos: int
    pair_flops: int


def shard(m: ModelSpec, tp: int) -> Shard:
    """One rank's share of `m` at tensor-parallel size `tp`. Heads, MLP intermediate dims, every expert's
    intermediate dim and the vocabulary (padded) are split over ranks; MLA's down-projections (q_a, kv_a), its
    latent cache, the MoE router and eh_proj are replicated; GQA KV heads are replicated when fewer than tp.
    MLA attention is costed in the absorbed form: per head, scores over kv_lora_rank + rope dims, values over
    kv_lora_rank. Raises ValueError (SpecError) naming the field that does not divide by tp."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SpecError(f"{m.name}: tp must be a positive integer, got {tp!r}")
    H = m.hidden_size
    if m.num_heads % tp:
        raise SpecError(f"{m.name}: field 'num_attention_heads' ({m.num_heads}) is not divisible by tp={tp}")
    hp = m.num_heads // tp
    if m.mla:
        a = m.mla
        qk, latent = a.qk_nope_head_dim + a.qk_rope_head_dim, a.kv_lora_rank + a.qk_rope_head_dim
        q = (H * a.q_lora_rank + a.q_lora_rank * hp * qk) if a.q_lora_rank else H * hp * qk
        attn = q + H * latent + a.kv_lora_rank * hp * (a.qk_nope_head_dim + a.v_head_dim) + hp * a.v_head_dim * H
        kv_per_pos, pair_flops = latent, 2 * hp * latent + 2 * hp * a.kv_lora_rank
    else:
        kv = m.num_kv_heads
        if kv % tp and tp % kv:
            raise SpecError(f"{m.name}: field 'num_key_value_heads' ({kv}) neither divides nor is divisible by tp={tp}")
        kvp = max(kv // tp, 1)
        attn = H * m.head_dim * (2 * hp + 2 * kvp)
        kv_per_pos, pair_flops = 2 * kvp * m.head_dim, 4 * hp * m.head_dim
    mlp_dense = moe_fixed = expert = 0
    if m.moe is None or m.moe.first_k_dense_replace > 0:
        if m.intermediate_size % tp:
            raise SpecError(f"{m.name}: field 'intermediate_size' ({m.intermediate_size}) is not divisible by tp={tp}")
        mlp_dense = 3 * H * m.intermediate_size // tp
    if m.moe:
        e = m.moe
        if e.moe_intermediate_size % tp:
            raise SpecError(f"{m.name}: field 'moe_intermediate_size' ({e.moe_intermediate_size}) is not divisible by tp={tp}")
        expert = 3 * H * e.moe_intermediate_size // tp
        moe_fixed = e.n_routed_experts * H + e.n_shared_experts * expert
    vocab = -(-m.vocab_size // tp) * H
    return Shard(attn, mlp_dense, moe_fixed, expert, vocab, vocab, 2 * H * H, kv_per_pos, pair_flops)


def params_per_rank(m: ModelSpec, tp: int = 1, include_mtp: bool = False) -> int:
    """Parameters one rank stores at `tp` (tp=1: the model's total; norms ignored, < 0.01%); with the MTP
    draft's layers and eh_proj when asked, its embedding and LM head being the target's."""
    s = shard(m, tp)
    moe_mlp = s.moe_fixed + (m.moe.n_routed_experts * s.expert if m.moe else 0)
    total = m.num_layers * s.attn + (m.num_layers - m.moe_layers) * s.mlp_dense + m.moe_layers * moe_mlp
    total += s.embed + (0 if m.tie_word_embeddings else s.head)
    if include_mtp:
        total += m.mtp_layers * (s.attn + (moe_mlp if m.moe else s.mlp_dense) + s.eh_proj)
    return total


def experts_touched(E: float, k: float, T: float) -> float:
    """Expected distinct experts hit when T tokens each route to k of E experts uniformly: E (1 - (1 - k/E)^T)."""
    return E * (1.0 - (1.0 - k / E) ** T)


class RooflineCost:
    """Step times (ms) of `model` on `tp` ranks of `hw`; see the module docstring for the formulas."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int, compute_dtype: str | None = None):
        self.model, self.hw, self.tp = model, hw, tp
        self.shard = shard(model, tp)
        self.compute_dtype = compute_dtype or (model.dtype if model.dtype in hw.peak_tflops else "bf16")
        for dt in (self.compute_dtype, model.act_dtype):
            if dt not in hw.peak_tflops:
                raise SpecError(f"{hw.name}: field 'peak_tflops' has no {dt!r} entry (needed by {model.name})")
        per_node = hw.devices_per_node or tp
        if tp > per_node and tp % per_node:
            raise SpecError(f"{hw.name}: tp={tp} does not fill whole nodes of field 'devices_per_node' ({per_node})")
        self._group, self._nodes = min(tp, per_node), max(tp // per_node, 1)
        self._bw = hw.hbm_bandwidth_GBps * 1e9 * hw.bw_efficiency
        self._lin_rate = hw.peak_tflops[self.compute_dtype] * 1e12 * hw.flops_efficiency
        self._attn_rate = hw.peak_tflops[model.act_dtype] * 1e12 * hw.flops_efficiency
        self._act_row = model.hidden_size * DTYPE_BYTES[model.act_dtype]
        L, moe_layers = model.num_layers, model.moe_layers
        self._target = self._blocks(L, L - moe_layers, moe_layers, eh=0)
        self._draft = self._draft_cost = None
        if model.draft and model.draft.kind == "mtp":
            self._draft = self._blocks(1, 0 if model.moe else 1, 1 if model.moe else 0, eh=1)
        elif model.draft and model.draft.kind == "model":
            self._draft_cost = RooflineCost(model.draft.model, hw, model.draft.tp or tp, compute_dtype)

    def _blocks(self, attn: int, dense: int, moe: int, eh: int) -> dict:
        """Rows of (count, fixed weight bytes, bytes per touched expert, E, k, KV bytes per position,
        linear FLOPs per token, attention FLOPs per pair), one row per kind of block, as arrays."""
        s, m = self.shard, self.model
        wb, kb = DTYPE_BYTES[m.dtype], DTYPE_BYTES[m.kv_dtype]
        E, k = (m.moe.n_routed_experts, m.moe.num_experts_per_tok) if m.moe else (1, 1)
        rows = [(attn, s.attn * wb, 0, 1, 1, s.kv_per_pos * kb, 2 * s.attn, s.pair_flops),
                (dense, s.mlp_dense * wb, 0, 1, 1, 0, 2 * s.mlp_dense, 0),
                (moe, s.moe_fixed * wb, s.expert * wb, E, k, 0, 2 * (s.moe_fixed + k * s.expert), 0),
                (eh, s.eh_proj * wb, 0, 1, 1, 0, 2 * s.eh_proj, 0),
                (1, s.head * wb, 0, 1, 1, 0, 2 * s.head, 0)]
        cols = np.array([r for r in rows if r[0] > 0], dtype=np.float64).T
        names = ("count", "fixed", "expert", "E", "k", "kv_pos", "flops_tok", "flops_pair")
        return dict(zip(names, cols)) | {"layers": attn}

    @staticmethod
    def _batch(q, kv) -> tuple[float, float, float]:
        """(tokens T, cache positions read sum(kv+q), attention pairs sum(q (kv+q))) of a ragged batch."""
        q, kv = np.broadcast_arrays(np.asarray(q, dtype=np.float64), np.asarray(kv, dtype=np.float64))
        ctx = kv + q
        return float(q.sum()), float(ctx.sum()), float(q @ ctx) if q.ndim else float(q * ctx)

    def _work(self, b: dict, T: float, pos: float, pairs: float) -> dict:
        """Per-block arrays for one forward: weight bytes, KV bytes, memory time and compute time (s)."""
        wbytes = b["fixed"] + b["expert"] * experts_touched(b["E"], b["k"], T)
        kvbytes = b["kv_pos"] * pos
        flops_lin, flops_attn = b["flops_tok"] * T, b["flops_pair"] * pairs
        return {"weight_bytes": wbytes, "kv_bytes": kvbytes, "flops": flops_lin + flops_attn,
                "t_mem": (wbytes + kvbytes) / self._bw, "t_cmp": flops_lin / self._lin_rate + flops_attn / self._attn_rate}

    def allreduce_ms(self, nbytes: float) -> float:
        """One all-reduce of `nbytes` per rank: ring within a node, plus the internode hop when tp spans nodes."""
        if self.tp == 1 or nbytes <= 0:
            return 0.0
        g, m, hw = self._group, self._nodes, self.hw
        t = hw.allreduce_latency_us * 1e-6 + 2 * (g - 1) / g * nbytes / (hw.link_bandwidth_GBps * 1e9)
        if m > 1:
            t += hw.internode_latency_us * 1e-6 + 2 * (m - 1) / m * (nbytes / g) / (hw.internode_bandwidth_GBps * 1e9)
        return t * 1e3

    def _forward_ms(self, b: dict, T: float, pos: float, pairs: float) -> float:
        if T <= 0:
            return 0.0
        w = self._work(b, T, pos, pairs)
        blocks = float(b["count"] @ np.maximum(w["t_mem"], w["t_cmp"])) * 1e3
        return blocks + 2 * b["layers"] * self.allreduce_ms(T * self._act_row) + self._overhead_ms(b)

    def _overhead_ms(self, b: dict) -> float:
        return self.hw.forward_overhead_ms + b["layers"] * self.hw.layer_overhead_us * 1e-3

    def validate_ms(self, q: np.ndarray, kv: np.ndarray) -> float:
        """One target forward over a ragged batch: sequence i computes q[i] tokens at context kv[i]."""
        return self._forward_ms(self._target, *self._batch(q, kv))

    def draft_ms(self, n: int, kv: np.ndarray, steps: int = 1) -> float:
        """`steps` draft steps, each of n sequences computing 1 token after kv[i] cached ones: the MTP
        module (one decoder layer, eh_proj, the shared head) or a forward of the separate draft model."""
        if n <= 0 or steps <= 0:
            return 0.0
        if steps > 1:
            return steps * self.draft_ms(n, kv, 1)
        kv = np.broadcast_to(np.asarray(kv, dtype=np.float64), (n,))
        if self._draft_cost is not None:
            return self._draft_cost.validate_ms(np.ones(n), kv)
        if self._draft is None:
            raise SpecError(f"{self.model.name}: no 'draft' in the model spec")
        return self._forward_ms(self._draft, *self._batch(np.ones(n), kv))

    def other_ms(self, n: int, emitted: int) -> float:
        """The rest of a step (scheduling, sampling, bookkeeping) for n sequences emitting `emitted` tokens."""
        hw = self.hw
        return hw.step_overhead_ms + hw.host_ms_per_seq * n + hw.host_ms_per_token * emitted

    def control_ms(self, policy: str, n: int) -> None:
        """The controller's time is not modelled: the simulator measures its own."""
        return None

    def work(self, q: np.ndarray, kv: np.ndarray) -> dict:
        """Per-rank totals of one target forward: weight_bytes, kv_bytes, flops, allreduce_bytes (summed
        over all all-reduces)."""
        b = self._target
        T, pos, pairs = self._batch(q, kv)
        w = self._work(b, T, pos, pairs)
        out = {key: float(b["count"] @ w[key]) for key in ("weight_bytes", "kv_bytes", "flops")}
        return out | {"allreduce_bytes": 2 * b["layers"] * T * self._act_row if self.tp > 1 else 0.0}

    def breakdown(self, q: np.ndarray, kv: np.ndarray) -> dict:
        """Milliseconds per component of validate_ms: each resource alone (weights and kv at the achievable
        bandwidth, flops at the achievable peak), allreduce, overhead, and the roofline total."""
        b = self._target
        T, pos, pairs = self._batch(q, kv)
        w = self._work(b, T, pos, pairs)
        ms = lambda x: float(b["count"] @ x) * 1e3  # noqa: E731
        return {"weights": ms(w["weight_bytes"] / self._bw), "kv": ms(w["kv_bytes"] / self._bw), "flops": ms(w["t_cmp"]),
                "allreduce": 2 * b["layers"] * self.allreduce_ms(T * self._act_row) if T > 0 else 0.0,
                "overhead": self._overhead_ms(b) if T > 0 else 0.0, "total": self._forward_ms(b, T, pos, pairs)}

    def weight_bytes_per_rank(self) -> float:
        """Bytes of the target's weights one rank stores (embedding and LM head shards included)."""
        return float(params_per_rank(self.model, self.tp) * DTYPE_BYTES[self.model.dtype])
