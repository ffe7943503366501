"""Token choice and draft acceptance.

Vocabulary (as vLLM's rejection sampler):
  draft tokens    d_1..d_L proposed by the proposer and kept for validation
  accepted tokens the longest prefix of drafts the target agrees with
  bonus token     one more token after the accepted prefix: the target's own choice at the
                  first rejection; after all L were accepted, the next unverified draft's
                  accept/residual test where one was drafted, else a sample from the target
The greedy path is apart from the random one. Every random draw comes from a generator
seeded by (request seed and sample index, position, stream), so every rank draws the same
numbers.
"""
from __future__ import annotations

import torch

from models import kernels
from workers.plan import SamplingParams

# Random streams: one per kind of draw, so draws at the same position never share numbers.
STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 64 bits
_MASK64 = (1 << 64) - 1


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request: n samples of one request draw apart."""
    return ((request_seed * _SEED_MIX) ^ (sample_index * 0xD6E8FEB86659FD93)) & ((1 << 63) - 1)


def generator_for(seed: int, position: int, stream: int) -> torch.Generator:
    """Deterministic generator for one draw of one sequence; `stream` separates draws at
    the same position (draft sample, accept test, residual)."""
    mixed = ((seed * _SEED_MIX) ^ (position * 0xBF58476D1CE4E5B9) ^ (stream * 0x94D049BB133111EB)) & _MASK64
    return torch.Generator().manual_seed(mixed & ((1 << 63) - 1))


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution after temperature, top-k and top-p. logits: (..., V)."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draft_top2(logits: torch.Tensor, tokens: torch.Tensor, top: torch.Tensor, margin: torch.Tensor) -> None:
    """A draft step's confidence inputs, per row of logits (n, V): the softmax's top token
    into tokens (n,) int64, its probability into top and the margin to the second largest
    into margin (n,) float64; both 0 for a row that is no distribution (NaN or infinite
    logits: a draft that overflowed). On the CPU one kernel call (models/csrc/elementwise.cpp),
    elsewhere torch's softmax and top-2 (the same values to float32 rounding)."""
    ops = _row_kernels(logits)
    if ops is not None:
        ops.draft_top2(logits, tokens, top, margin)
        return
    two = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1).values
    tokens.copy_(logits.argmax(dim=-1))  # the first of equal maxima, as the kernel (topk takes any)
    valid = two.isfinite().all(dim=-1)  # a row that is no distribution gives no confidence, as the kernel's
    top.copy_(torch.where(valid, two[:, 0], 0.0))
    margin.copy_(torch.where(valid, two[:, 0] - two[:, 1], 0.0))


def draft_top2_at(logits: torch.Tensor, tokens: torch.Tensor, inputs: torch.Tensor, j: int) -> None:
    """draft_top2 into draft position j of the draft loop's buffers: tokens (budget, n) int64 and
    inputs (3, budget, n) float64 (top probability, margin, and the drafted token's probability,
    set to the top one: a greedy row's). On the CPU one kernel call, where the three views and
    the row copy had cost a draft step a few microseconds between forward passes."""
    ops = _row_kernels(logits)
    if ops is not None and tokens.is_contiguous() and inputs.stride(2) == 1:
        ops.draft_top2_at(logits, tokens, inputs, j)
        return
    draft_top2(logits, tokens[j], inputs[0, j], inputs[1, j])
    inputs[2, j] = inputs[0, j]


def uniform(vocab: int) -> torch.Tensor:
    """The uniform distribution over vocab tokens, (vocab,) float32."""
    return torch.full((vocab,), 1.0 / vocab)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's greedy token (the first of equal maxima), logits (T, V): on the CPU one
    kernel call, where torch's argmax took 48 us for 4 x 4096 (137 after a forward pass)."""
    ops = _row_kernels(logits)
    return (logits.argmax(dim=-1) if ops is None else ops.argmax_rows(logits)).tolist()


def _row_kernels(logits: torch.Tensor):
    """The CPU kernels where they take logits (T, V) as they are (float32, contiguous rows), else None."""
    return kernels.ops_for(logits) if logits.dim() == 2 and logits.stride(-1) == 1 else None


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token from logits (V,) for the token at `position`."""
    if params.greedy:
        return int(logits.argmax())
    probs = probs_from_logits(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator_for(params.seed, position, STREAM_SAMPLE)))


def draft_sample(q: torch.Tensor, params: SamplingParams, position: int) -> int:
    """A sampled draft token for `position` from the draft distribution q (V,)."""
    return int(torch.multinomial(q, 1, generator=generator_for(params.seed, position, STREAM_DRAFT)))


def rejection_accept(drafts: list[int], q: torch.Tensor, p: torch.Tensor, params: SamplingParams,
                     start: int) -> tuple[int, list[int]]:
    """Speculative sampling (Leviathan et al.; Chen et al.): exact samples from the target.

    p: (L+1, V) target distributions at positions start..start+L (after the last emitted
    token and after each of the L verified drafts). drafts: m >= L draft tokens for
    positions start..start+m-1, drawn from q: (m, V). Draft j is accepted with probability
    min(1, p_j(d)/q_j(d)); at the first rejection the token is drawn from the residual
    max(0, p_j - q_j) (normalised) and the step ends. If all L verified drafts are
    accepted, the token at start+L is the bonus: when a draft for that position exists
    (drafted but not verified), the same accept/residual test decides it, so the token is
    the one verifying that draft would have given; otherwise it is drawn from p_L. Each
    position's token is therefore a function of the seed alone, whatever the decision
    verified, which keeps any keep rule lossless. Returns (accepted verified drafts, emitted)."""
    L = p.shape[0] - 1
    out = []
    for j in range(L + 1):
        pos = start + j
        if j == len(drafts):  # no draft for this position: a plain sample from the target
            gen = generator_for(params.seed, pos, STREAM_SAMPLE)
            return L, out + [int(torch.multinomial(p[j], 1, generator=gen))]
        d = drafts[j]
        u = torch.rand((), generator=generator_for(params.seed, pos, STREAM_ACCEPT))
        if u * q[j, d] < p[j, d]:  # u < p/q without dividing (q[d] > 0: d was drawn from q)
            out.append(d)
            continue
        residual = (p[j] - q[j]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the residual is p itself
            residual = p[j]
        gen = generator_for(params.seed, pos, STREAM_RESIDUAL)
        return j, out + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))]
    return L, out  # the unverified draft at start+L was accepted as the bonus token


def greedy_accept(drafts: list[int], target: list[int]) -> int:
    """Accepted drafts: the longest prefix of the verified `drafts` that equals the target's
    choices (`target[j]` is the target's argmax at the position of `drafts[j]`)."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return a
