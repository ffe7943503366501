"""The draft loop: a step's draft positions from the proposer, one forward pass each, the
early stop asked between them, and what it hands the keep decision and validation
(`DraftBlock`)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from workers.plan import SamplingParams
from workers.proposer import Proposer, SeqState
from workers.sampler import draft_sample, draft_top2_at, probs_from_logits, uniform


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # (n, m) draft tokens
    top_prob: np.ndarray  # (n, m) the draft's top probability at each position
    token_prob: np.ndarray  # (n, m) the draft's probability of the drafted token
    steps: int  # draft forwards run: m <= k (the budget, or fewer after an early stop)
    q: dict[int, torch.Tensor]  # sampled sequence index -> (m, V) distributions its drafts were drawn from
    margin: np.ndarray | None = None  # (n, m) top-1 minus top-2 probability
    entropy: np.ndarray | None = None  # (n, m) entropy of the draft distribution, nats (step traces only)
    control_ms: float = 0.0  # time spent deciding whether to draft on (the early stop)
    catchup_tokens: int = 0  # tokens the proposer caught up on before draft 1
    rows: list[int] | None = None  # the sequences that drafted (None: every one); the others hold zeros

    def steps_of(self, i: int) -> int:
        """Drafts sequence i made."""
        return self.steps if self.rows is None or i in self.rows else 0

    def placed(self, rows: list[int], n: int) -> DraftBlock:
        """This block, drafted for `rows` alone, as the block of all n sequences."""
        m = self.steps

        def spread(a):
            if a is None:
                return None
            out = torch.zeros(n, m, dtype=a.dtype) if isinstance(a, torch.Tensor) else np.zeros((n, m))
            out[rows] = a
            return out

        return DraftBlock(spread(self.tokens), spread(self.top_prob), spread(self.token_prob), m,
                          {rows[i]: q for i, q in self.q.items()}, spread(self.margin), spread(self.entropy),
                          self.control_ms, self.catchup_tokens, list(rows))


def draft(proposer: Proposer, seqs: list[SeqState], params: list[SamplingParams], step, trace: bool,
          block_size: int, device: torch.device) -> DraftBlock:
    """step.budget draft positions for step.rows (every sequence when None). Greedy
    sequences draft the argmax; sampled ones draw from their sampling distribution q,
    kept for the rejection test. The confidence inputs (top probability, margin to the
    second largest) never depend on the drawn token. `trace` also records each
    position's entropy. Rows that did not draft hold zeros."""
    n, rows = len(seqs), step.rows
    if step.budget == 0:
        empty = np.zeros((n, 0))
        return DraftBlock(torch.zeros(n, 0, dtype=torch.long), empty, empty, 0, {}, empty, empty)
    if rows is None:
        return draft_rows(proposer, seqs, params, step.budget, step.early_stop, trace, block_size, device,
                          step.draft_inputs(step.budget), step.draft_next)
    part = draft_rows(proposer, [seqs[i] for i in rows], [params[i] for i in rows], step.budget,
                      step.early_stop, trace, block_size, device)
    return part.placed(rows, n)

def draft_rows(proposer: Proposer, seqs: list[SeqState], params: list[SamplingParams], budget: int, early_stop,
               trace: bool, block_size: int, device: torch.device, given: np.ndarray | None = None,
               draft_next=None) -> DraftBlock:
    """Up to `budget` draft positions for every one of seqs; early_stop: SpecStep.early_stop
    (its answer None: no early stop).
    Position j's tokens and confidence inputs go into row j of (budget, n) buffers, which
    the early stop and the block read: nothing is stacked or converted between the
    draft's forward passes but one kernel call (sampler.draft_top2_at). given: (3, budget, n)
    float64 buffers to use for the top probability, margin and drafted token's probability
    (SpecStep.draft_inputs), else new ones. draft_next: SpecStep.draft_next, asked once the
    early stop is made; where it gives a callable, a greedy step without a trace makes each
    position's confidence inputs and its early stop with that one call (its time then counts
    as the draft's, not the control's)."""
    n = len(seqs)
    sampled = [i for i, sp in enumerate(params) if not sp.greedy]
    qs = {i: [] for i in sampled}
    tokens = torch.empty(budget, n, dtype=torch.long)
    if given is None:
        inputs = torch.empty(3, budget, n, dtype=torch.float64)  # top probability, margin, drafted token's probability
        top, margin, chosen = inputs.numpy()
    else:
        inputs = torch.from_numpy(given)
        top, margin, chosen = given
    t0 = time.perf_counter()
    keep_drafting = early_stop(top, margin, tokens)
    fused = draft_next() if draft_next is not None and keep_drafting is not None and not sampled and not trace \
        else None
    entropies, control_ms, m = [], (time.perf_counter() - t0) * 1e3, 0
    run, logits = proposer.begin(seqs, block_size)
    for j in range(budget):
        m = j + 1
        logits = logits.float().cpu()
        if fused is not None and j < budget - 1:  # this position's confidence inputs and the early stop, one call
            if not fused(logits, tokens, inputs, j):
                break
            logits = proposer.next(run, tokens[j].to(device))
            continue
        draft_top2_at(logits, tokens, inputs, j)
        d = tokens[j]
        for i in sampled:
            # a row that is no distribution (draft_top2 gave it no confidence) proposes from the
            # uniform one: any q the drafts are drawn from keeps the rejection test exact
            qi = probs_from_logits(logits[i], params[i]) if top[j, i] > 0 else uniform(logits.shape[-1])
            qs[i].append(qi)
            d[i] = draft_sample(qi, params[i], position=len(seqs[i].tokens) + j)
            best = qi.topk(2).values
            top[j, i], chosen[j, i], margin[j, i] = float(best[0]), float(qi[d[i]]), float(best[0] - best[1])
        if trace:
            dist = torch.softmax(logits, dim=-1)
            for i in sampled:
                dist[i] = qs[i][-1]
            entropies.append(-(dist * dist.clamp_min(1e-30).log()).sum(-1))
        if j == budget - 1:
            break
        if keep_drafting is not None:  # None: the whole budget
            t0 = time.perf_counter()
            more = keep_drafting(m)
            control_ms += (time.perf_counter() - t0) * 1e3
            if not more:
                break
        logits = proposer.next(run, d.to(device))
    return DraftBlock(tokens[:m].T, top[:m].T, chosen[:m].T, m, {i: torch.stack(rows) for i, rows in qs.items()},
                      margin[:m].T, torch.stack(entropies, 1).double().numpy() if trace else None, control_ms,
                      run.catchup_tokens)


# what a step that drafted nothing hands the accept loop (it reads only `steps`)
NO_DRAFTS = DraftBlock(torch.zeros(0, 0, dtype=torch.long), np.zeros((0, 0)), np.zeros((0, 0)), 0, {})
