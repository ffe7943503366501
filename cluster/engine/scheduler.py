"""Continuous batching: which sequences run this step, and the StepPlan that says so.

A step is either a prefill step (prompt chunks of admitted sequences, up to
`max_prefill_tokens`) or a decode step (every running sequence). New sequences are
admitted while there are sequence slots and KV blocks; when running sequences outgrow
the cache, the youngest is preempted (its blocks freed, recomputed later from its prompt
and outputs), so nothing crashes and nothing is dropped.

Prompts are admitted and prefilled shortest first (`prefill_order="shortest"`), which
minimises the mean time to first token of the prompts waiting together: a burst of 48
ShareGPT prompts got its median first token after the shortest half's tokens instead of
after half of all of them. A prompt that has waited `max_wait_steps` steps, and a
sequence recomputed after a preemption, go first, in arrival order, so a long prompt is
delayed by at most that many steps. `prefill_order="fcfs"` is arrival order throughout.
"""
from __future__ import annotations

from collections import deque

from cluster.engine.blocks import BlockAllocator
from cluster.engine.request import Sequence, Status
from workers.plan import ForkPlan, SeqPlan, StepPlan


def decode_positions(seq_len: int, k: int) -> int:
    """Cache positions a decode step of a sequence of seq_len tokens may write: its last
    token (not in the cache yet) at seq_len - 1, then up to k drafts after it (validation
    writes the kept ones, the proposers their own caches at the same positions)."""
    return seq_len + k


PREFILL_ORDERS = ("shortest", "fcfs")


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_prefill_tokens: int,
                 num_spec: int, max_model_len: int, prefill_order: str = "shortest", max_wait_steps: int = 64):
        if prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {prefill_order!r}")
        self.blocks = BlockAllocator(num_blocks, block_size)
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.num_spec, self.max_model_len = num_spec, max_model_len
        self.shortest_first, self.max_wait_steps = prefill_order == "shortest", max_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.to_free: list[int] = []  # seq ids the workers should forget
        self.step_index = 0

    def add(self, seq: Sequence) -> None:
        seq.queued_step = self.step_index
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.release(seq)
        self.to_free.append(seq.seq_id)

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop sequences wherever they are: waiting, running, or not yet forked."""
        for seq in seqs:
            if seq.status is Status.WAITING and any(w is seq for w in self.waiting):
                self.waiting.remove(seq)
            seq.forks = []
            self.finish(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[StepPlan, list[Sequence]] | None:
        plan = self._prefill_plan() or self._decode_plan()
        if plan is not None:
            self.step_index += 1
        return plan

    # ------------------------------------------------------------------ prefill
    def _order(self, seq: Sequence) -> tuple[int, ...]:
        """Sort key of a prompt to admit or prefill under shortest-first: recomputed sequences
        and prompts that waited max_wait_steps first, oldest first; then the fewest prompt
        tokens left (ties: oldest first)."""
        if seq.output_ids or self.step_index - seq.queued_step >= self.max_wait_steps:
            return 0, seq.seq_id
        return 1, len(seq.prompt_ids) - seq.num_prefilled, seq.seq_id

    def _admit(self) -> None:
        """Waiting sequences, in prefill order, while there are slots and blocks (the first
        that does not fit stops admission: nothing overtakes it)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return
        admitted = 0
        for seq in sorted(self.waiting, key=self._order) if self.shortest_first else self.waiting:
            # after its prefill the sequence holds one more token: the one the prefill emits
            if len(self.running) >= self.max_num_seqs or not self.blocks.grow(
                    seq, decode_positions(len(seq.prefill_ids) + 1, self.num_spec)):
                break
            seq.status, seq.num_prefilled, seq.prefill_len = Status.RUNNING, 0, len(seq.prefill_ids)
            self.running.append(seq)
            admitted += 1
        if admitted:
            self.waiting = deque(seq for seq in self.waiting if seq.status is Status.WAITING)

    def _prefill_plan(self) -> tuple[StepPlan, list[Sequence]] | None:
        self._admit()
        budget, seqs, plans = self.max_prefill_tokens, [], []
        prompts = [seq for seq in self.running if seq.num_prefilled < seq.prefill_len]
        for seq in sorted(prompts, key=self._order) if self.shortest_first else prompts:
            if budget == 0:
                break
            todo = seq.prefill_ids[seq.num_prefilled:seq.prefill_len]
            chunk = todo[:budget]
            last = len(chunk) == len(todo)
            forks = self._fork(seq) if last and seq.forks else []
            plans.append(SeqPlan(seq.seq_id, list(seq.block_table), seq.sampling, prefill=chunk,
                                 prefill_start=seq.num_prefilled, prefill_last=last,
                                 next_token=seq.output_ids[-1] if last and seq.output_ids else None,
                                 forks=[ForkPlan(c.seq_id, list(c.block_table), c.sampling) for c in forks]))
            seq.num_prefilled += len(chunk)
            budget -= len(chunk)
            seqs.append(seq)
            seqs.extend(forks)
        if not plans:
            return None
        return StepPlan(self.step_index, plans, decode=False, free=self._take_free()), seqs

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of parent's prompt, started from its prefill: they share its full
        prompt blocks (the block holding the last prompt position and the first output is
        copied by the workers). Those without a free slot or blocks are queued to prefill
        on their own, ahead of later requests."""
        prompt = parent.prefill_len
        shared = parent.block_table[:prompt // self.blocks.block_size]
        forked, queued = [], []
        for child in parent.forks:
            self.blocks.share(child, shared)
            if len(self.running) < self.max_num_seqs and self.blocks.grow(child,
                                                                           decode_positions(prompt + 1, self.num_spec)):
                child.status, child.num_prefilled, child.prefill_len = Status.RUNNING, prompt, prompt
                self.running.append(child)
                forked.append(child)
            else:
                self.blocks.release(child)
                child.queued_step = parent.queued_step
                queued.append(child)
        parent.forks = []
        self.waiting.extendleft(reversed(queued))
        return forked

    # ------------------------------------------------------------------ decode
    def _decode_plan(self) -> tuple[StepPlan, list[Sequence]] | None:
        plans: list[SeqPlan] = []
        i = 0
        while i < len(self.running):  # preemption shrinks the list from its (youngest) end
            seq = self.running[i]
            if not self._make_room(seq):
                break  # seq itself was the youngest and was preempted: nothing after it is left
            num_spec = self._num_spec(seq)
            done = len(seq.output_ids)
            oracle = seq.oracle_ids[done:done + num_spec] if seq.oracle_ids is not None else None
            plans.append(SeqPlan(seq.seq_id, list(seq.block_table), seq.sampling, num_spec=num_spec, oracle=oracle,
                                 left=self._left(seq)))
            i += 1
        if not plans:
            return None
        return StepPlan(self.step_index, plans, decode=True, free=self._take_free()), self.running[:len(plans)]

    def _make_room(self, seq: Sequence) -> bool:
        """Blocks for seq's next step (drafting runs the batch's largest k for every
        sequence, so cover k for all), preempting the youngest until they fit. False if
        seq itself had to go."""
        while not self.blocks.grow(seq, decode_positions(seq.total_len, self.num_spec)):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _num_spec(self, seq: Sequence) -> int:
        return max(0, min(self.num_spec, self._left(seq) - 1))

    def _left(self, seq: Sequence) -> int:
        """Tokens seq may still emit: what max_tokens and max_model_len leave."""
        return min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.total_len)

    def requeue_all(self) -> None:
        """The workers were replaced: every running sequence is recomputed from its prompt
        and the tokens it already emitted (oldest first); the new workers hold no state."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)
        self.to_free = []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        self.to_free.append(seq.seq_id)
        seq.status, seq.num_prefilled = Status.WAITING, 0
        self.waiting.appendleft(seq)

    def _take_free(self) -> list[int]:
        out, self.to_free = self.to_free, []
        return out
