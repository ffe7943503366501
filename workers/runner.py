"""One rank's model state and step, without Ray: prefill, and the speculative decode step

    draft (proposer; workers/drafting.py) -> decide keep[i] -> validate [last, d_1..d_keep[i]] -> accept -> commit

The validate forward packs ragged queries, so its cost follows sum(keep[i] + 1), not
batch * (k + 1). Every rank runs this same code on the same inputs and so reaches the
same tokens; `digest` lets the driver check that.
"""
from __future__ import annotations

import hashlib
import time
from itertools import accumulate

import numpy as np
import torch

from controller import history
from controller.catchup import DraftStretches, switch_cost
from controller.policy import SpecPolicy
from controller.yields import above

from models.attention import AttnBatch
from models.decoder import CausalLM
from workers import drafting
from workers.plan import ForkPlan, SeqOutput, StepPlan, StepResult, StepStats, StepTrace
from workers.proposer import Proposer, SeqState
from workers.sampler import argmax_rows, greedy_accept, probs_from_logits, rejection_accept, sample_token


class ModelRunner:
    def __init__(self, rank: int, target: CausalLM, proposer: Proposer | None, policy: SpecPolicy, num_blocks: int,
                 block_size: int, device: torch.device | str = "cpu"):
        self.rank, self.device, self.policy = rank, torch.device(device), policy
        self.target, self.proposer = target, proposer
        self.block_size = block_size
        self.cache = target.new_kv_cache(num_blocks, block_size)
        self.seqs: dict[int, SeqState] = {}
        self.corrupt_digest = False  # fault injection: make this rank's digest disagree
        # Tests only (the lossless test's negative control): draw the bonus token fresh from
        # p even where an unverified draft exists, as xLLM does. Verifying then depends on
        # the decision, and a token-dependent decision skews the output distribution.
        self.fresh_bonus = False
        self._marks = (0, 0, -1)  # calibration batches after the last two decode steps, the last one's time model
        self.stretches = DraftStretches()  # how long drafting lasts (controller/catchup.py), for a switch's price

    def weight_modules(self) -> dict[str, torch.nn.Module]:
        """The modules that hold this rank's weights, by role (models/share.py shares them between engines)."""
        return {"target": self.target} | (self.proposer.weight_modules() if self.proposer is not None else {})

    # ------------------------------------------------------------------ entry
    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for seq_id in plan.free:
            self.seqs.pop(seq_id, None)
        stats = StepStats(num_seqs=len(plan.seqs))
        outputs = self._decode(plan, stats) if plan.decode else self._prefill(plan, stats)
        stats.step_ms = (time.perf_counter() - t0) * 1e3
        if plan.decode:
            stats.steady, stats.draft_steady = self._steady(plan.time_model_version)
        digest = _digest(plan.step, outputs) ^ int(self.corrupt_digest)
        if self.rank != 0:
            return StepResult(self.rank, plan.step, digest)
        return StepResult(self.rank, plan.step, digest, outputs, stats)

    def _steady(self, version: int) -> tuple[bool, bool]:
        """Were this decode step's rest and its draft free of one-offs? The rest is not where a
        calibration batch ran at its end, nor in the step after one or after a new time model
        (the batch 1 OneRow and the budget's terms they made stale are rebuilt in that step's
        begin_step); the draft is not in the step after either, which runs on the caches they
        went through. A cold start runs a calibration batch at every drafting step: counted,
        those steps made a drafting step's rest 0.4-2.1 ms dearer than a plain one's and its
        draft 1.3-1.9x the startup sweep's (batch 1's steady steps: 1.0-1.07x) in a served
        engine's first fits after a warm-up at saturation, and batch 1 stood down."""
        before, last, last_version = self._marks
        now = self.policy.calibrations
        self._marks = (last, now, version)
        draft = last == before and version == last_version
        return draft and now == last, draft

    # ------------------------------------------------------------------ prefill
    def _prefill(self, plan: StepPlan, stats: StepStats) -> list[SeqOutput]:
        seqs = []
        for p in plan.seqs:
            if p.prefill_start == 0:
                self.seqs[p.seq_id] = SeqState(p.seq_id, [], p.block_table)
                if self.proposer is not None:
                    self.proposer.start(self.seqs[p.seq_id])
            s = self.seqs[p.seq_id]
            assert s.num_computed == p.prefill_start, f"seq {p.seq_id}: prefill at {p.prefill_start}, has {s.num_computed}"
            s.tokens.extend(p.prefill)
            s.prompt_len = len(s.tokens)
            s.block_table = p.block_table
            seqs.append(s)
        lens = [len(p.prefill) for p in plan.seqs]
        batch = AttnBatch.build([s.num_computed for s in seqs], lens, [s.block_table for s in seqs], self.block_size,
                                self.device)
        ids = torch.tensor([t for p in plan.seqs for t in p.prefill], device=self.device)
        out = self._out_rows(sum(lens))
        hidden = self.target(ids, batch, self.cache, out)
        stats.num_tokens = len(ids)
        last = [i for i, p in enumerate(plan.seqs) if p.prefill_last]
        logits = self.target.logits(hidden[batch.last_index[last]]).cpu() if last else None
        outputs = []
        for s, n in zip(seqs, lens):
            s.num_computed += n
        if self.proposer is not None:
            self.proposer.keep(seqs, hidden, [0, *accumulate(lens[:-1])], lens, self.seqs, out is not None)
        for row, i in enumerate(last):
            s, p = seqs[i], plan.seqs[i]
            if p.next_token is not None:  # recomputed after a preemption: the token is known
                s.tokens.append(p.next_token)
                continue
            for f in p.forks:
                outputs.append(self._fork(s, f, logits[row]))
            token = sample_token(logits[row], p.sampling, position=len(s.tokens))
            s.tokens.append(token)
            outputs.append(SeqOutput(p.seq_id, [token]))
        return outputs

    def _fork(self, parent: SeqState, f: ForkPlan, logits: torch.Tensor) -> SeqOutput:
        """Another sample of parent's prompt (just prefilled; logits: (V,) at its last
        position). Full prompt blocks are shared; the partial one, where this sample writes
        its first token, is copied. The proposer has not run on the prompt yet, so only the
        target cache holds anything to copy."""
        prompt = len(parent.tokens)
        child = SeqState(f.seq_id, list(parent.tokens), f.block_table, num_computed=parent.num_computed,
                         hidden_start=parent.hidden_start)
        if self.proposer is not None:
            self.proposer.start(child, self.proposer.hidden(parent))  # the parent's rows, as its own
        if prompt % self.block_size:
            src, dst = parent.block_table[prompt // self.block_size], f.block_table[prompt // self.block_size]
            for cache_k, cache_v in self.cache:
                cache_k[dst] = cache_k[src]
                cache_v[dst] = cache_v[src]
        token = sample_token(logits, f.sampling, position=prompt)
        child.tokens.append(token)
        self.seqs[f.seq_id] = child
        return SeqOutput(f.seq_id, [token])

    # ------------------------------------------------------------------ decode
    def _decode(self, plan: StepPlan, stats: StepStats) -> list[SeqOutput]:
        seqs = [self.seqs[p.seq_id] for p in plan.seqs]
        for s, p in zip(seqs, plan.seqs):
            s.block_table = p.block_table
        # lists, not arrays: at small batches a numpy call costs several microseconds here (cold caches)
        kv = [s.num_computed for s in seqs]
        max_keep = [p.num_spec for p in plan.seqs]
        k = max(max_keep) if self.proposer is not None else 0
        t0 = time.perf_counter()
        step = None
        counted = False  # the step's end counted already (held_plain's `counted`)
        if k and plan.mode == "adaptive":
            if len(seqs) == 1 and not self.policy.seq_history and _behind(seqs[0]) <= k + 1:
                # batch 1's usual step: no catch-up to price, no record to hand (one call)
                step = self.policy.begin_alone(kv, max_keep, plan.time_model_version, k)
            else:  # standing down as the step before did: the policy's held answer, asked first, its end counted
                step = self.policy.held_plain(kv, max_keep, plan.time_model_version, k, counted=True)
                counted = step is not None
        if step is None:
            step = self.policy.decide_step(plan.mode, kv, max_keep, plan.time_model_version, k, _oracle(plan, k),
                                           _catchup(seqs, plan, k, self.stretches) if k and plan.mode == "adaptive"
                                           else None,
                                           (seqs[0].hits, seqs[0].trials) if len(seqs) == 1 and self.policy.seq_history
                                           else None)
        t1 = time.perf_counter()
        if step.budget == 0:
            stats.control_ms = (t1 - t0) * 1e3
            return self._decode_plain(plan, seqs, kv, step, stats, counted)
        draft = drafting.draft(self.proposer, seqs, [p.sampling for p in plan.seqs], step, plan.trace,
                               self.block_size, self.device)
        t2 = time.perf_counter()
        keep = step.keep(draft.top_prob, draft.token_prob, draft.margin, draft.tokens)  # (n,) list
        t3 = time.perf_counter()
        stats.draft_ms = (t2 - t1) * 1e3 - draft.control_ms  # the draft forwards, without the early stop
        stats.control_ms = (t1 - t0 + t3 - t2) * 1e3 + draft.control_ms
        stats.draft_control_ms = (t3 - t2) * 1e3 + draft.control_ms
        t1 = t3
        lens = [c + 1 for c in keep]
        batch = AttnBatch.build(kv, lens, [s.block_table for s in seqs], self.block_size,
                                self.device)
        drafted = draft.tokens.tolist()  # (n, m) as lists: per-sequence work below stays in Python, not torch
        ids = torch.tensor([t for s, d, n in zip(seqs, drafted, lens) for t in [s.tokens[-1]] + d[:n - 1]],
                           device=self.device)
        out = self._out_rows(sum(lens))
        hidden = self.target(ids, batch, self.cache, out)
        logits = self.target.logits(hidden).cpu()  # (T, V); decisions and sampling run on the CPU
        stats.validate_ms = (time.perf_counter() - t1) * 1e3
        stats.num_tokens, stats.draft_steps, stats.catchup_tokens = len(ids), draft.steps, draft.catchup_tokens
        stats.draft_seqs = (len(seqs) if draft.rows is None else len(draft.rows)) if draft.steps else 0
        stats.kv_tokens = sum(q * c for q, c in zip(lens, kv))
        stats.predicted_validate_ms = step.model.validate_ms_from(stats.num_tokens, stats.kv_tokens, draft.steps > 0)
        outputs = self._accept(plan, seqs, draft, drafted, keep, lens, hidden, logits, stats, out is not None)
        if plan.mode == "adaptive":
            if step.wants:
                self.stretches.extend(sum(len(o.new_tokens) for o in outputs) / len(outputs))
            else:
                self.stretches.end()
        t0 = time.perf_counter()
        accepted = [o.accepted for o in outputs]
        self.policy.end_step(step, draft.top_prob, draft.margin, keep, accepted, draft.catchup_tokens)
        stats.control_ms += (time.perf_counter() - t0) * 1e3
        if plan.trace:
            stats.predicted_draft_ms = step.model.draft_ms(stats.draft_seqs, draft.steps)
            stats.trace = StepTrace(kv, step.max_keep.tolist(), _rounded(draft.top_prob), _rounded(draft.margin),
                                    _rounded(draft.entropy), keep, accepted, step.probe)
        return outputs

    def _decode_plain(self, plan: StepPlan, seqs: list[SeqState], kv: list[int], step, stats: StepStats,
                      counted: bool = False):
        """A step that drafts nothing (plain decoding, or adaptive standing down): one token per
        sequence, with none of the draft block's arrays (what `_decode` would do with an empty
        draft, about 20 us less a step at batch 1). counted: the policy counted its end already."""
        n = len(seqs)
        t1 = time.perf_counter()
        batch = AttnBatch.build(kv, [1] * n, [s.block_table for s in seqs], self.block_size, self.device)
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=self.device)
        # the proposer keeps the rows before the forward writes them (one call, not reserve's and keep's)
        out = self.proposer.take(seqs, self.seqs) if self.proposer is not None else None
        hidden = self.target(ids, batch, self.cache, out)
        logits = self.target.logits(hidden).cpu()
        stats.validate_ms = (time.perf_counter() - t1) * 1e3
        stats.num_tokens, stats.kv_tokens = n, sum(kv)
        stats.predicted_validate_ms = step.model.validate_ms_from(stats.num_tokens, stats.kv_tokens)
        keep = [0] * n
        outputs = self._accept(plan, seqs, drafting.NO_DRAFTS, [[]] * n, keep, [1] * n, hidden, logits, stats,
                               kept=out is not None)
        if plan.mode == "adaptive":
            if step.wants:  # the budget would draft, and the rows' catch-up or a plain probe said no
                self.stretches.extend(1.0)
            elif self.stretches.open:
                self.stretches.end()
        if not counted:
            t0 = time.perf_counter()
            self.policy.end_plain_step(step)
            stats.control_ms += (time.perf_counter() - t0) * 1e3
        if plan.trace:
            stats.trace = StepTrace(kv, step.max_keep.tolist(), [[]] * n, [[]] * n, [[]] * n, keep,
                                    [0] * n, step.probe)
        return outputs

    def _out_rows(self, n: int) -> tuple[torch.Tensor, int] | None:
        """Where a target forward of n rows also writes its output: the rows the proposer keeps it in, if any."""
        return self.proposer.reserve(n) if self.proposer is not None else None

    def _accept(self, plan, seqs, draft, drafted, keep, lens, hidden, logits, stats,
                written: bool = False, kept: bool = False) -> list[SeqOutput]:
        """drafted: (n, m) draft tokens as lists; keep: (n,) verified drafts (a list); lens: keep + 1,
        the rows of `logits` (T, V) each sequence owns, in order; written: the forward also wrote
        `hidden` where the proposer reserved (_out_rows); kept: ... and the proposer keeps it already
        (Proposer.take)."""
        target = argmax_rows(logits)  # the target's choice after each validated token
        accepted, emitted, row = [], [], 0
        for i, (s, p) in enumerate(zip(seqs, plan.seqs)):
            verified = lens[i] - 1
            if p.sampling.greedy:
                a = greedy_accept(drafted[i][:verified], target[row:row + verified])
                accepted.append(a)
                emitted.append(drafted[i][:a] + [target[row + a]])
            else:
                p_target = probs_from_logits(logits[row:row + verified + 1], p.sampling)  # (L+1, V)
                # drafts that may decide their position: those this sequence asked for (the batch
                # may draft further for others), so the text does not depend on the batch
                usable = verified if self.fresh_bonus else min(draft.steps_of(i), p.num_spec)
                q = draft.q[i][:usable] if usable else torch.zeros(0, logits.shape[-1])
                a, out = rejection_accept(drafted[i][:usable], q, p_target, p.sampling, start=len(s.tokens))
                accepted.append(a)
                emitted.append(out)
            row += lens[i]
        stats.accepted_per_position = above(accepted, draft.steps)
        stats.verified_per_position = above(keep, draft.steps)
        outputs = []
        commit = self.proposer.commit if self.proposer is not None and draft.steps else None  # drafted nothing: no-op
        records = self.policy.seq_history  # each sequence's draft record, where the policy reads them
        for i, (s, p, a, new, verified) in enumerate(zip(seqs, plan.seqs, accepted, emitted, lens)):
            s.tokens.extend(new)
            s.num_computed += a + 1
            steps = draft.steps_of(i) if draft.steps else 0
            if commit is not None:
                commit(s, a, steps)
            if records and verified > 1:  # it verified drafts (lens: verified drafts + 1)
                s.hits, s.trials = history.record(s.hits, s.trials, verified - 1, a)
            elif records and s.trials:  # none: what it holds fades all the same
                s.hits, s.trials = history.fade(s.hits, s.trials)
            outputs.append(SeqOutput(p.seq_id, new, drafted=min(p.num_spec, steps), verified=verified - 1, accepted=a))
        if self.proposer is not None and not kept:  # each sequence's rows start where the one before it ends
            if draft.steps:  # (a + 1 are final)
                self.proposer.keep(seqs, hidden, [0, *accumulate(lens[:-1])], [a + 1 for a in accepted], self.seqs,
                                   written)
            else:  # one row each
                self.proposer.keep(seqs, hidden, None, None, self.seqs, written)
        return outputs


def _rounded(a: np.ndarray) -> list[list[float]]:
    return np.round(a, 4).tolist()


def _catchup(seqs: list[SeqState], plan: StepPlan, k: int, stretches: DraftStretches | None = None):
    """For decide_step: the rows' catch-up (RowsBehind); None for one sequence no further behind
    than a steady step (batch 1's usual step, where its OneRow decides)."""
    if len(seqs) == 1 and _behind(seqs[0]) <= k + 1:
        return None
    return RowsBehind(seqs, plan, stretches)


class RowsBehind:
    """A step's rows' catch-up, computed only if asked: called with k, the rows' catch-up past a
    steady step's per token left, or per token drafting is expected to last where that is fewer
    (stretches.horizon(); catchup.switch_cost), counted from where the draft last ran or the
    prompt ends, whichever is later (controller/catchup.py); `cheapest`, the row a stand-down
    probe drafts for, and `least_lag`, what it would catch up on (which a probe's wait is priced by:
    policy.stand_down_price)."""

    __slots__ = ("seqs", "plan", "stretches")

    def __init__(self, seqs: list[SeqState], plan: StepPlan, stretches: DraftStretches | None):
        self.seqs, self.plan, self.stretches = seqs, plan, stretches

    def __call__(self, k: int) -> float:
        return switch_cost([_behind(s) for s in self.seqs], [p.left for p in self.plan.seqs], k,
                           self.stretches.horizon() if self.stretches is not None else None)

    def least_lag(self) -> int:
        """The fewest tokens a row's draft has to catch up on (the `cheapest` row's: _lag)."""
        return min(_lag(s) for s in self.seqs)

    def cheapest(self, start: int) -> int:
        """The row whose draft has the fewest tokens to catch up on (_lag), the first from row
        `start` on among equals."""
        lags = [_lag(s) for s in self.seqs]
        n = len(lags)
        return min(range(n), key=lambda i: (lags[i], (i - start) % n))


def _lag(s: SeqState) -> int:
    """Tokens s's next draft forward runs over before its first position: all since its draft last
    ran, its prompt's included (unlike _behind, which prices a switch)."""
    return len(s.tokens) - s.draft_len


def _behind(s: SeqState) -> int:
    """Tokens s's draft is behind on, its prompt's left out."""
    return len(s.tokens) - max(s.draft_len, s.prompt_len)


def _oracle(plan: StepPlan, k: int) -> np.ndarray | None:
    """(n, k) reference continuation of each sequence for oracle mode, -1 past its end."""
    if plan.mode != "oracle":
        return None
    ref = np.full((len(plan.seqs), k), -1, dtype=np.int64)
    for i, p in enumerate(plan.seqs):
        got = (p.oracle or [])[:k]
        ref[i, :len(got)] = got
    return ref


def _digest(step: int, outputs: list[SeqOutput]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(step.to_bytes(8, "little"))
    for o in outputs:
        h.update(repr((o.seq_id, o.verified, o.new_tokens)).encode())
    return int.from_bytes(h.digest(), "little")
