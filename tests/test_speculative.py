"""Greedy speculative decoding emits exactly the target-only greedy tokens."""
from __future__ import annotations

import pytest

from cluster.engine.core import Engine
from tests.conftest import REFERENCE_TOKENS, greedy, local_engine, tiny_config, token_ids

MAX_TOKENS = REFERENCE_TOKENS
KS = (1, 3, 7)



def _check_all_k(engine, prompts, reference):
    for k in KS:
        engine.set_num_speculative_tokens(k)
        before = engine.stats.drafted
        results = engine.generate(prompts, greedy(MAX_TOKENS))
        assert token_ids(results) == reference, f"k={k}"
        assert engine.stats.drafted > before
        for samples in results:
            o = samples[0]
            assert o.accepted <= o.verified <= o.drafted


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_greedy_equals_target_tp1(method, sharegpt_prompts, reference):
    engine = local_engine(tiny_config("parallel.tp_size=1", f"speculative.method={method}",
                                      "speculative.num_speculative_tokens=7"))
    try:
        _check_all_k(engine, sharegpt_prompts, reference)
        assert engine.stats.accepted > 0  # the bundled drafts are trained: some drafts must land
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_greedy_equals_target_tp2(method, ray_session, sharegpt_prompts, reference):
    engine = Engine(tiny_config("parallel.tp_size=2", f"speculative.method={method}",
                                "speculative.num_speculative_tokens=7"))
    try:
        _check_all_k(engine, sharegpt_prompts, reference)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "float32"])
def test_draft_weights_are_streamed_as_configured(weights, ops, sharegpt_prompts, reference):
    """speculative.draft_weights: the MTP layer and its own head pack their weights in that
    dtype, the target's stay float32 (the head's tensor shared, not copied), and greedy
    output is the target's either way."""
    import torch

    engine = local_engine(tiny_config("parallel.tp_size=1", f"speculative.draft_weights={weights}",
                                      "speculative.num_speculative_tokens=3"))
    try:
        assert token_ids(engine.generate(sharegpt_prompts[:4], greedy(MAX_TOKENS))) == reference[:4]
        runner = engine.workers.worker.runner
        head = runner.proposer.head
        assert head is not runner.target.lm_head and head.weight is runner.target.lm_head.weight

        def packed(*modules):
            return {m.__dict__["_packed"][1].dtype for top in modules for m in top.modules() if "_packed" in m.__dict__}

        assert packed(runner.proposer.mtp, head) == {getattr(torch, weights)}
        assert packed(runner.target) == {torch.float32}
        assert engine.stats.accepted > 0
    finally:
        engine.shutdown()


def test_tp16_matches_tp1(ray_session, sharegpt_prompts, reference):
    engine = Engine(tiny_config("parallel.tp_size=16", "speculative.num_speculative_tokens=3",
                                "parallel.placement_strategy=PACK"))
    try:
        results = engine.generate(sharegpt_prompts[:3], greedy(6))
        assert token_ids(results) == [r[:6] for r in reference[:3]]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("block_rows", [4096, 64])
def test_hidden_log_gives_back_each_sequence_s_rows(block_rows, in_place):
    """Sequences' rows interleaved in each forward's output (some a run of rows, some one, a
    sequence absent from some forwards): read back from any entry on, across trims, they are
    the rows added; a trim keeps every entry from the oldest one a live sequence reads. With
    small blocks the outputs fill block after block, the emptied ones are reused, and the
    larger outputs are kept as they are. A step that drafted nothing has one row per sequence, in
    order. in_place: each output is also written where `reserve`
    says, as the target's forward does, and kept there without a copy."""
    from types import SimpleNamespace

    import torch

    from workers.hidden_log import TRIM_EVERY, HiddenLog

    log, gen = HiddenLog(block_rows), torch.Generator().manual_seed(0)
    reused, as_is = set(), 0
    seqs = [SimpleNamespace(seq_id=10 + i, hidden_step=0, rows=[]) for i in range(3)]
    for step in range(5 * TRIM_EVERY + 3):
        present = [s for i, s in enumerate(seqs) if (step + i) % 5]  # each sits out one forward in five
        counts = [1 + (step + i) % 3 + 4 * (step % 11 == 0) for i in range(len(present))]  # now and then > 8 rows
        gaps = [(step + i) % 2 for i in range(len(present))]  # a rejected draft's row after some
        plain = step % 4 == 3  # a step that drafted nothing: one row each, said as firsts = counts = None
        if plain:
            counts, gaps = [1] * len(present), [0] * len(present)
        firsts = [sum(counts[:i]) + sum(gaps[:i]) for i in range(len(present))]
        h = torch.randn(sum(counts) + sum(gaps), 4, generator=gen)
        out = log.reserve(len(h)) if in_place else None
        if out is not None:  # the forward's output, also written into the rows the log reserved
            out[0][out[1]:out[1] + len(h)].copy_(h)
        log.add(present, h, None if plain else firsts, None if plain else counts,
                written=out is not None)
        kept = log.output(-1)
        assert kept.shape == h.shape and torch.equal(kept, h) and torch.equal(log.output(log.end - 1), h)
        assert (kept.data_ptr() == h.data_ptr()) == (out is None and len(h) > block_rows // 8)  # kept as it is
        assert out is None or kept.data_ptr() == out[0][out[1]].data_ptr()  # ... or where it was written
        as_is += log.entries[-1][7] is None
        for s, first, count in zip(present, firsts, counts):
            s.rows.append(h[first:first + count].clone())
        if step % 7 == 6:  # one sequence drafts: reads all it holds, then holds nothing
            s = seqs[step % 3]
            assert torch.equal(torch.cat(log.rows(s.seq_id, s.hidden_step)), torch.cat(s.rows))
            s.hidden_step, s.rows = log.end, []
        oldest = min(s.hidden_step for s in seqs)
        log.trim(seqs)
        reused |= {id(b) for b in log._spare}
        assert all(not b.readers for b in log._spare)  # only blocks no entry reads are kept for reuse
        for s in seqs:  # what every sequence holds, intact after every step (a block reused too soon would not be)
            if s.rows:
                assert torch.equal(torch.cat(log.rows(s.seq_id, s.hidden_step)), torch.cat(s.rows))
        assert log.first <= oldest and (log.first == oldest or (step + 1) % TRIM_EVERY)  # trimmed every TRIM_EVERY
    for s in seqs:
        assert torch.equal(torch.cat(log.rows(s.seq_id, s.hidden_step)), torch.cat(s.rows))
    blocks = {id(e[7]) for e in log.entries if e[7] is not None}
    assert blocks and (block_rows > 100 or blocks & reused)  # small blocks: some held now were reused
    assert block_rows > 100 or as_is  # outputs over 8 rows kept as they are
    assert not in_place or log.reserve(1) is not None  # reserved once the first output gave the rows' shape


def test_hidden_log_trims_once_the_oldest_reader_goes():
    """Steps that drafted nothing, kept with `take` (the rows reserved and kept in one call): the
    entries stay while the sequence that holds the oldest one is live and has not read, however
    many trims pass (the trim then looks at no sequence), and go at the first trim after it
    finishes or reads, back to the oldest entry any sequence still holds."""
    from types import SimpleNamespace

    import torch

    from workers.hidden_log import TRIM_EVERY, HiddenLog

    log = HiddenLog()
    seqs = [SimpleNamespace(seq_id=i, hidden_step=0) for i in range(3)]
    live = {s.seq_id: s for s in seqs}
    log.add(seqs, torch.zeros(3, 4), None, None, live)  # the first output gives the rows' shape
    for _ in range(3 * TRIM_EVERY):
        rows, at = log.take(seqs, live)
        rows[at:at + 3] = 1.0
    assert log.first == 0 and len(log.entries) == 3 * TRIM_EVERY + 1
    seqs[1].hidden_step = seqs[2].hidden_step = log.end - 5  # the others read; seq 0 still holds entry 0
    for _ in range(TRIM_EVERY):
        rows, at = log.take(seqs, live)
        rows[at:at + 3] = 1.0
    assert log.first == 0
    del live[0]  # seq 0 finishes
    for _ in range(TRIM_EVERY):
        rows, at = log.take(list(live.values()), live)
        rows[at:at + 2] = 1.0
    assert log.first == seqs[1].hidden_step
    assert torch.equal(torch.cat(log.rows(1, seqs[1].hidden_step)), torch.ones(5 + 2 * TRIM_EVERY, 4))


def test_mtp_drafts_after_a_long_stretch_without(sharegpt_prompts, reference):
    """Plain decoding for more steps than the hidden log trims after, then drafting: the MTP
    catches up on every position since the prompt, reading the target's hidden state at
    each (as one forward over the sequence computes it), and the tokens stay the target's."""
    import torch

    from models.attention import AttnBatch
    from workers.hidden_log import TRIM_EVERY

    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.method=mtp",
                                      "speculative.num_speculative_tokens=3"))
    try:
        runner = engine.workers.worker.runner
        proposer, caught_up = runner.proposer, []
        begin, hidden = proposer.begin, proposer.hidden

        def first_begin(seqs, block_size):  # the first catch-up's hidden rows, per sequence
            if caught_up:
                return begin(seqs, block_size)
            got = []
            proposer.hidden = lambda s: got.append(hidden(s)) or got[-1]
            try:
                return begin(seqs, block_size)
            finally:
                proposer.hidden = hidden
                caught_up.extend((list(s.tokens), h.clone()) for s, h in zip(seqs, got))

        proposer.begin = first_begin
        engine.set_num_speculative_tokens(0)
        for prompt in sharegpt_prompts:
            engine.add_request(prompt, greedy(MAX_TOKENS))
        got: dict[str, list[int]] = {}
        for step in range(TRIM_EVERY + 3):  # the prompt, then TRIM_EVERY + 3 steps: a trim and the entries since
            for out in engine.step():
                got[out.request_id] = out.token_ids
        before = engine.stats.accepted
        engine.set_num_speculative_tokens(3)
        while engine.has_work():
            for out in engine.step():
                got[out.request_id] = out.token_ids
        assert engine.stats.accepted > before  # drafting resumed, and drafts landed
        assert [got[f"req-{i}"] for i in range(len(sharegpt_prompts))] == reference
        assert len(caught_up) == len(sharegpt_prompts)
        for tokens, hidden in caught_up:
            n = len(tokens) - 1  # every computed position, each paired with the token after it
            assert len(hidden) == n > TRIM_EVERY
            blocks = -(-n // runner.block_size)
            cache = runner.target.new_kv_cache(blocks, runner.block_size)
            batch = AttnBatch.build([0], [n], [list(range(blocks))], runner.block_size, runner.device)
            with torch.inference_mode():
                expected = runner.target(torch.tensor(tokens[:n]), batch, cache)
            torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
        # a sequence that arrives later reads the log from its own prompt on: what came before goes
        engine.set_num_speculative_tokens(0)
        before = proposer.log.end
        engine.add_request(sharegpt_prompts[0], greedy(MAX_TOKENS))
        for step in range(TRIM_EVERY + 1):
            engine.step()
        assert engine.has_work() and proposer.log.first == before
    finally:
        engine.shutdown()


def _overflowing(monkeypatch):
    """The MTP draft's logits turn NaN on even rows and +inf at one token on odd rows (a draft
    that overflowed, as float16 can), from its first draft on."""
    from workers.proposer import MTPProposer

    def spoil(logits):
        logits = logits.clone()
        logits[::2] = float("nan")
        logits[1::2, 7] = float("inf")
        return logits

    begin, step = MTPProposer.begin, MTPProposer.next
    monkeypatch.setattr(MTPProposer, "begin", lambda self, *a: (lambda r: (r[0], spoil(r[1])))(begin(self, *a)))
    monkeypatch.setattr(MTPProposer, "next", lambda self, *a: spoil(step(self, *a)))


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_draft_that_overflows_changes_nothing_emitted(adaptive, monkeypatch, sharegpt_prompts, reference):
    """Draft rows that are no distribution get no confidence and propose from the uniform
    distribution when sampling; validation decides as always. Greedy text stays the target's,
    sampled requests finish (a NaN estimate had stopped the adaptive step, a NaN q the sampler)."""
    from cluster.engine.request import RequestParams
    from tests.test_adaptive import ADAPTIVE, PRUNING_MODEL

    _overflowing(monkeypatch)
    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.method=mtp",
                                      *(ADAPTIVE if adaptive else ("speculative.num_speculative_tokens=3",))))
    try:
        if adaptive:
            engine.time_models.install(PRUNING_MODEL)
        assert token_ids(engine.generate(sharegpt_prompts, greedy(MAX_TOKENS))) == reference
        assert engine.stats.drafted > 0
        sampled = RequestParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, ignore_eos=True)
        assert [len(t) for t in token_ids(engine.generate(sharegpt_prompts[:3], sampled))] == [MAX_TOKENS] * 3
    finally:
        engine.shutdown()
