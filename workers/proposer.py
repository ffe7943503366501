"""Draft proposers: the MTP module and a small draft LM, behind one interface.

Each step a proposer first *catches up*: it computes, in one packed forward, every
position that became final since it last ran (the tokens accepted by the last validation)
and so produces the distribution of draft 1. Then `next` runs one autoregressive draft
step for all sequences at once. The step's drafting state is the `DraftRun` that `begin`
returns and `next` advances; a proposer keeps nothing between the two. Draft-cache slots
written by `next` are speculative; they are overwritten by a later catch-up, since KV
writes are indexed by position.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.attention import AttnBatch
from models.decoder import CausalLM
from models.deepseek import DeepseekMTPLayer
from models.mtp import MTPModule
from models.parallel import ParallelLMHead
from workers.hidden_log import HiddenLog


@dataclass
class SeqState:
    """One sequence on one rank. Positions 0..num_computed-1 are in the target cache;
    tokens[-1] (the last emitted token) is not, during decode."""

    seq_id: int
    tokens: list[int]
    block_table: list[int]
    num_computed: int = 0
    draft_len: int = 0  # proposer cache positions below this are final
    # MTP: where the target hiddens of positions hidden_start..num_computed-1 lie in the proposer's log
    # (workers/hidden_log.py), one row number per position
    hidden_rows: list[int] = field(default_factory=list)
    hidden_start: int = 0

    def reset_hidden(self, start: int) -> None:
        """Hold the hiddens of positions start.. (none yet)."""
        self.hidden_rows, self.hidden_start = [], start


@dataclass
class DraftRun:
    """One step's drafting: where each drafting sequence's next draft goes."""

    positions: list[int]  # position of the draft fed next, per sequence
    tables: list[list[int]]
    block_size: int
    catchup_tokens: int  # tokens `begin` caught up on (all sequences together)
    hidden: torch.Tensor | None = None  # MTP: the last draft position's hidden states, (n, H)

    def advance(self, device) -> AttnBatch:
        """The next draft step's batch: one query per sequence, one position further."""
        self.positions = [p + 1 for p in self.positions]
        return AttnBatch.build(self.positions, [1] * len(self.positions), self.tables, self.block_size, device)


class Proposer:
    def begin(self, seqs: list[SeqState], block_size: int) -> tuple[DraftRun, torch.Tensor]:
        """Catch up; the step's drafting state and the logits of draft 1, (n, V)."""
        raise NotImplementedError

    def next(self, run: DraftRun, tokens: torch.Tensor) -> torch.Tensor:
        """Feed draft j (n,) and return the logits of draft j+1, (n, V)."""
        raise NotImplementedError

    def commit(self, seq: SeqState, accepted: int, draft_steps: int) -> None:
        """After validation: `accepted` of the drafts were accepted, `draft_steps` were drafted."""

    def keep(self, seqs: list[SeqState], hidden: torch.Tensor, firsts: list[int], counts: list[int]) -> None:
        """A target forward's output (T, H): seqs[i]'s next positions are its rows firsts[i] ..
        firsts[i] + counts[i] - 1. Only the MTP module reads them."""

    def tidy(self, live) -> None:
        """live: every sequence on this rank (SeqState); what none of them reads may go."""


class DraftModelProposer(Proposer):
    """A small LM replicated on every rank, with its own cache in the target's block layout."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        self.model = model
        self.cache = model.new_kv_cache(num_blocks, block_size)

    def begin(self, seqs: list[SeqState], block_size: int) -> torch.Tensor:
        starts = [s.draft_len for s in seqs]
        lens = [len(s.tokens) - s.draft_len for s in seqs]
        device = self.model.lm_head.weight.device
        ids = torch.tensor([t for s in seqs for t in s.tokens[s.draft_len:]], device=device)
        tables = [s.block_table for s in seqs]
        batch = AttnBatch.build(starts, lens, tables, block_size, device)
        hidden = self.model(ids, batch, self.cache)[batch.last_index]
        for s in seqs:
            s.draft_len = len(s.tokens)
        run = DraftRun([len(s.tokens) - 1 for s in seqs], tables, block_size, len(ids))
        return run, self.model.logits(hidden)

    def next(self, run: DraftRun, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.logits(self.model(tokens, run.advance(tokens.device), self.cache))

    def commit(self, seq: SeqState, accepted: int, draft_steps: int) -> None:
        # drafts 1..draft_steps-1 were fed to the cache; those accepted are final
        seq.draft_len += min(accepted, max(draft_steps - 1, 0))


class MTPProposer(Proposer):
    """The MTP module, sharded like the target, reading the target's hidden states: a
    separate module (the target's head gives its logits) or the target checkpoint's own
    MTP layer (DeepSeek-V3: its own `shared_head`)."""

    def __init__(self, mtp: MTPModule | DeepseekMTPLayer, target: CausalLM, num_blocks: int, block_size: int,
                 head: ParallelLMHead | None = None):
        """head: the draft's own copy of the target's head (models.parallel.draft_head), whose
        weights the kernels may stream in another dtype than the target's; default: the target's."""
        self.mtp, self.target, self.head = mtp, target, head
        if isinstance(mtp, DeepseekMTPLayer):
            self.logits = mtp.logits
        else:
            self.logits = target.logits if head is None else (lambda hidden: head(hidden).float())
        self.cache = mtp.new_kv_cache(num_blocks, block_size)
        self.log = HiddenLog()

    def keep(self, seqs: list[SeqState], hidden: torch.Tensor, firsts: list[int], counts: list[int]) -> None:
        base = self.log.add(hidden)
        for s, first, count in zip(seqs, firsts, counts):
            if count == 1:
                s.hidden_rows.append(base + first)
            else:
                s.hidden_rows.extend(range(base + first, base + first + count))

    def tidy(self, live) -> None:
        if self.log.due():
            self.log.join(min((s.hidden_rows[0] for s in live if s.hidden_rows), default=self.log.end))

    def begin(self, seqs: list[SeqState], block_size: int) -> torch.Tensor:
        # pair at position p: (target hidden at p-1, token at p), for p = draft_len .. len(tokens)-1
        starts, lens, hid = [], [], []
        for s in seqs:
            start = max(s.draft_len, 1)
            starts.append(start)
            lens.append(len(s.tokens) - start)
            hid.append(self.log.gather(s.hidden_rows[start - 1 - s.hidden_start:]))
        device = self.mtp.eh_proj.weight.device
        ids = torch.tensor([t for s, a in zip(seqs, starts) for t in s.tokens[a:]], device=device)
        tables = [s.block_table for s in seqs]
        batch = AttnBatch.build(starts, lens, tables, block_size, device)
        out = self.mtp(self.target.model.embed_tokens(ids), torch.cat(hid), batch, self.cache)
        for s in seqs:
            s.draft_len = len(s.tokens)
            s.reset_hidden(s.num_computed)
        run = DraftRun([len(s.tokens) - 1 for s in seqs], tables, block_size, len(ids), out[batch.last_index])
        return run, self.logits(run.hidden)

    def next(self, run: DraftRun, tokens: torch.Tensor) -> torch.Tensor:
        run.hidden = self.mtp(self.target.model.embed_tokens(tokens), run.hidden, run.advance(tokens.device),
                              self.cache)
        return self.logits(run.hidden)
