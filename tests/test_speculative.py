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


@pytest.mark.parametrize("weights", ["bfloat16", "float32"])
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


def test_hidden_pieces_join_to_the_appended_rows():
    """A sequence's MTP hiddens are kept as pieces of each step's tensor; read back from
    any position, joined or compacted, they are the rows appended. A compaction copies the
    pieces since the last one into a tensor of their rows alone (no step's tensor is kept
    alive past COMPACT_AT pieces) and leaves the earlier copies as they are."""
    import torch

    from workers.proposer import COMPACT_AT, SeqState

    s, rows = SeqState(0, [], []), []
    s.reset_hidden(5)
    for step in range(3 * COMPACT_AT + 3):
        h = torch.randn(4, 3)
        first, count = step % 3, 1 + step % 2
        joined_before = [part[0] for part in s.hidden_parts[:s.hidden_joined]]
        s.add_hidden(h, first, count)
        rows.append(h[first:first + count])
        assert len(s.hidden_parts) - s.hidden_joined < COMPACT_AT
        assert all(a is b for a, b in zip(joined_before, (part[0] for part in s.hidden_parts)))  # not copied again
        for t, _, n in s.hidden_parts[:s.hidden_joined]:
            assert t.untyped_storage().nbytes() == n * 3 * t.element_size()  # its own rows, no step's tensor
        assert torch.equal(s.hidden_from(5), torch.cat(rows))
    assert s.hidden_joined == 3
    assert torch.equal(s.hidden_from(9), torch.cat(rows)[4:])


def test_mtp_drafts_after_a_long_stretch_without(sharegpt_prompts, reference):
    """Plain decoding for more steps than a sequence holds hidden pieces, then drafting:
    the MTP catches up on every position since the prompt and the tokens stay the target's."""
    from workers.proposer import COMPACT_AT

    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.method=mtp",
                                      "speculative.num_speculative_tokens=3"))
    try:
        engine.set_num_speculative_tokens(0)
        for prompt in sharegpt_prompts:
            engine.add_request(prompt, greedy(MAX_TOKENS))
        got: dict[str, list[int]] = {}
        for step in range(COMPACT_AT + 3):
            for out in engine.step():
                got[out.request_id] = out.token_ids
        before = engine.stats.accepted
        engine.set_num_speculative_tokens(3)
        while engine.has_work():
            for out in engine.step():
                got[out.request_id] = out.token_ids
        assert engine.stats.accepted > before  # drafting resumed, and drafts landed
        assert [got[f"req-{i}"] for i in range(len(sharegpt_prompts))] == reference
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
