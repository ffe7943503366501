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

from dataclasses import dataclass

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
    prompt_len: int = 0  # tokens its prefill computed (a recompute's include what it had emitted)
    # MTP: the target hiddens of positions hidden_start..num_computed-1 are hidden_head's rows (a fork's
    # from its parent, the timing sweep's), then this sequence's rows in the proposer's log entries from
    # number hidden_step on (workers/hidden_log.py)
    hidden_start: int = 0
    hidden_step: int = 0
    hidden_head: torch.Tensor | None = None
    # its draft record (controller/history.py): accepted drafts and trials, older outcomes weighing less
    hits: float = 0.0
    trials: float = 0.0


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

    def keep(self, seqs: list[SeqState], hidden: torch.Tensor, firsts: list[int], counts: list[int], live,
             written: bool = False) -> None:
        """A target forward's output (T, H): sequence seqs[i]'s next positions are its rows firsts[i] ..
        firsts[i] + counts[i] - 1 (both None: its one next position is row i; the list is held, not
        copied); live: every sequence on this rank (SeqState values, or the dict of them by id);
        written: the forward also wrote it where `reserve` said. Only the MTP module reads them."""

    def reserve(self, n: int) -> tuple[torch.Tensor, int] | None:
        """Where the next target forward of n rows should also write its output (CausalLM.forward's
        `out`), for `keep` to keep without a copy; None: nowhere."""
        return None

    def take(self, seqs: list[SeqState], live) -> tuple[torch.Tensor, int] | None:
        """reserve and keep at once, before a target forward of one row per sequence (a step that
        drafts nothing): where it must write its output, already kept; None: not kept (call keep)."""
        return None

    def start(self, seq: SeqState, head: torch.Tensor | None = None) -> None:
        """seq's hiddens start here (a new sequence, or one made to draft from hidden_start with
        `head`'s rows: a fork, the timing sweep)."""

    def hidden(self, seq: SeqState) -> torch.Tensor | None:
        """The hiddens seq holds (positions hidden_start..num_computed-1); None without the MTP module."""
        return None

    def weight_modules(self) -> dict:
        """The modules that hold the draft's own weights, by role (ModelRunner.weight_modules)."""
        return {}


class DraftModelProposer(Proposer):
    """A small LM replicated on every rank, with its own cache in the target's block layout."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        self.model = model
        self.cache = model.new_kv_cache(num_blocks, block_size)

    def weight_modules(self) -> dict:
        return {"draft": self.model}

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
        # Proposer.keep and reserve are the log's own, called at every step: not a method's call around each
        self.keep, self.reserve, self.take = self.log.add, self.log.reserve, self.log.take

    def weight_modules(self) -> dict:
        return {"draft": self.mtp} | ({"draft_head": self.head} if self.head is not None else {})

    def start(self, seq: SeqState, head: torch.Tensor | None = None) -> None:
        # a copy: head may be rows of the log's blocks, which are reused once trimmed
        seq.hidden_step, seq.hidden_head = self.log.end, None if head is None else head.clone()

    def hidden(self, seq: SeqState) -> torch.Tensor:
        parts = self.log.rows(seq.seq_id, seq.hidden_step)
        if seq.hidden_head is not None:
            parts.insert(0, seq.hidden_head)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def begin(self, seqs: list[SeqState], block_size: int) -> torch.Tensor:
        # pair at position p: (target hidden at p-1, token at p), for p = draft_len .. len(tokens)-1
        starts, lens, hid = [], [], []
        for s in seqs:
            start = max(s.draft_len, 1)
            starts.append(start)
            lens.append(len(s.tokens) - start)
            hid.append(self.hidden(s)[start - 1 - s.hidden_start:])
        device = self.mtp.eh_proj.weight.device
        ids = torch.tensor([t for s, a in zip(seqs, starts) for t in s.tokens[a:]], device=device)
        tables = [s.block_table for s in seqs]
        batch = AttnBatch.build(starts, lens, tables, block_size, device)
        out = self.mtp(self.target.model.embed_tokens(ids), torch.cat(hid), batch, self.cache)
        for s in seqs:
            s.draft_len = len(s.tokens)
            s.hidden_start = s.num_computed
            self.start(s)
        run = DraftRun([len(s.tokens) - 1 for s in seqs], tables, block_size, len(ids), out[batch.last_index])
        return run, self.logits(run.hidden)

    def next(self, run: DraftRun, tokens: torch.Tensor) -> torch.Tensor:
        run.hidden = self.mtp(self.target.model.embed_tokens(tokens), run.hidden, run.advance(tokens.device),
                              self.cache)
        return self.logits(run.hidden)
