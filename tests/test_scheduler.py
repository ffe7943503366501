"""Continuous batching without a model: block accounting, admission, preemption of the
youngest, ref-counted forks, and exactly the cache positions a decode step may write."""
from __future__ import annotations

from cluster.engine.blocks import BlockAllocator
from cluster.engine.request import RequestParams, Sequence, Status
from cluster.engine.scheduler import Scheduler, decode_positions
from workers.plan import SamplingParams

BS = 4  # positions per block


def seq(seq_id: int, prompt_len: int, n: int = 1) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(1, prompt_len + 1)), RequestParams(max_tokens=64, n=n),
                    SamplingParams())


def test_blocks_are_counted_and_shared():
    alloc = BlockAllocator(num_blocks=5, block_size=BS)
    a, b = seq(0, 1), seq(1, 1)
    assert alloc.grow(a, 9) and len(a.block_table) == 3  # ceil(9 / 4)
    assert not alloc.grow(b, 12) and b.block_table == []  # 3 more do not fit: nothing is taken
    alloc.share(b, a.block_table[:2])
    alloc.release(a)
    assert sorted(alloc.free_blocks) == [2, 3, 4]  # a's shared blocks stay held by b
    alloc.release(b)
    assert sorted(alloc.free_blocks) == [0, 1, 2, 3, 4] and set(alloc.refs) == {0}


def _prefill_all(s: Scheduler) -> None:
    """Run prefill plans until none is left, emitting one token per finished prompt."""
    while True:
        plan, seqs = s.schedule()
        if plan.decode:
            return
        for p, q in zip(plan.seqs, seqs):
            if p.prefill_last and not q.output_ids:
                q.output_ids.append(7)


def test_admission_waits_for_blocks_and_decode_covers_exactly_k_drafts():
    k = 2
    s = Scheduler(num_blocks=4, block_size=BS, max_num_seqs=8, max_prefill_tokens=64, num_spec=k, max_model_len=64)
    a, b, c = seq(0, 5), seq(1, 5), seq(2, 5)
    for x in (a, b, c):
        s.add(x)
    _prefill_all(s)
    # after its prefill a holds 6 tokens; a decode step writes positions 5..5+k: 8 positions, 2 blocks
    assert decode_positions(6, k) == 8 and len(a.block_table) == 2 and len(b.block_table) == 2
    assert [x.status for x in (a, b, c)] == [Status.RUNNING, Status.RUNNING, Status.WAITING]  # no blocks for c


def test_the_youngest_is_preempted_when_the_running_outgrow_the_cache():
    k = 3
    s = Scheduler(num_blocks=6, block_size=BS, max_num_seqs=8, max_prefill_tokens=64, num_spec=k, max_model_len=64)
    a, b = seq(0, 5), seq(1, 5)
    s.add(a)
    s.add(b)
    _prefill_all(s)
    a.output_ids += [7] * 4  # a grows to 10 tokens: its next step needs 13 positions, 4 blocks
    plan, seqs = s.schedule()
    assert plan.decode and [x.seq_id for x in seqs] == [0]
    assert b.status is Status.WAITING and s.waiting[0] is b and b.block_table == []
    assert len(a.block_table) == 4 and plan.free == [1]  # the ranks forget b's state


def test_forks_share_the_full_prompt_blocks_and_own_the_rest():
    s = Scheduler(num_blocks=16, block_size=BS, max_num_seqs=8, max_prefill_tokens=64, num_spec=2, max_model_len=64)
    parent, child = seq(0, 6), seq(1, 6)
    child.prompt_ids = parent.prompt_ids
    parent.forks = [child]
    s.add(parent)
    plan, seqs = s.schedule()
    assert [x.seq_id for x in seqs] == [0, 1] and [f.seq_id for f in plan.seqs[0].forks] == [1]
    assert child.block_table[0] == parent.block_table[0]  # the one full prompt block (positions 0..3)
    assert child.block_table[1] != parent.block_table[1]  # the partial one is the child's own (copied by ranks)
    assert s.blocks.refs[parent.block_table[0]] == 2
    s.finish(parent)
    assert s.blocks.refs[child.block_table[0]] == 1 and parent.block_table == []


def _prefill_order(s: Scheduler) -> list[int]:
    """Seq ids in the order their prompts finish prefilling."""
    done = []
    while True:
        plan, seqs = s.schedule()
        if plan.decode:
            return done
        for p, q in zip(plan.seqs, seqs):
            if p.prefill_last and not q.output_ids:
                q.output_ids.append(7)
                done.append(q.seq_id)


def _scheduler(order: str, max_wait_steps: int = 64, max_prefill_tokens: int = 8) -> Scheduler:
    return Scheduler(num_blocks=64, block_size=BS, max_num_seqs=8, max_prefill_tokens=max_prefill_tokens, num_spec=2,
                     max_model_len=64, prefill_order=order, max_wait_steps=max_wait_steps)


def test_shortest_prompts_are_prefilled_first_and_fcfs_keeps_arrival_order():
    lens = [12, 3, 7, 3, 1]
    for order, expected in (("shortest", [4, 1, 3, 2, 0]), ("fcfs", [0, 1, 2, 3, 4])):
        s = _scheduler(order)
        for i, n in enumerate(lens):
            s.add(seq(i, n))
        assert _prefill_order(s) == expected, order


def test_a_prompt_that_waited_max_wait_steps_goes_first():
    s = _scheduler("shortest", max_wait_steps=2, max_prefill_tokens=4)
    s.add(seq(0, 12))  # long: passed over by the short ones until it has waited 2 steps
    for i in range(1, 6):
        s.add(seq(i, 4))
    assert _prefill_order(s) == [1, 2, 0, 3, 4, 5]  # steps 0 and 1 prefill 1 and 2; from step 2 on 0 goes first


def test_a_preempted_sequence_is_recomputed_before_shorter_new_prompts():
    s = _scheduler("shortest", max_prefill_tokens=64)
    a = seq(0, 9)
    s.add(a)
    _prefill_all(s)
    s._preempt(a)
    s.add(seq(1, 2))
    plan, seqs = s.schedule()
    assert [q.seq_id for q in seqs] == [0, 1] and plan.seqs[0].prefill == a.prefill_ids


def test_the_shortest_waiting_prompts_take_the_free_slots():
    s = Scheduler(num_blocks=64, block_size=BS, max_num_seqs=2, max_prefill_tokens=64, num_spec=2, max_model_len=64)
    for i, n in enumerate([9, 5, 1, 3]):
        s.add(seq(i, n))
    s.schedule()
    assert [q.seq_id for q in s.running] == [2, 3] and [q.seq_id for q in s.waiting] == [0, 1]
