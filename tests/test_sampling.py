"""Seeded sampling: the token at each position is a function of the seed, whatever was
verified, at any TP size and in any batch; `n` samples prefill their prompt once."""
from __future__ import annotations

import dataclasses

import torch

from cluster.engine.core import Engine
from cluster.engine.request import RequestParams
from tests.conftest import local_engine, tiny_config
from workers.plan import SamplingParams
from workers.sampler import draft_sample, rejection_accept

SAMPLED = RequestParams(max_tokens=24, temperature=0.8, top_p=0.95, top_k=40, seed=7, ignore_eos=True)


def test_emitted_tokens_do_not_depend_on_what_was_verified():
    """Verifying L of m drafts emits a prefix of what verifying all m emits."""
    gen = torch.Generator().manual_seed(0)
    vocab, m, start = 12, 4, 10
    for trial in range(300):
        q = torch.softmax(torch.randn(m, vocab, generator=gen) * 2, -1)
        p = torch.softmax(torch.randn(m + 1, vocab, generator=gen) * 2, -1)
        params = SamplingParams(temperature=1.0, seed=trial)
        drafts = [draft_sample(q[j], params, position=start + j) for j in range(m)]
        full = rejection_accept(drafts, q, p, params, start)[1]
        for verified in range(m + 1):
            accepted, out = rejection_accept(drafts, q, p[:verified + 1], params, start)
            assert accepted <= verified and len(out) == accepted + 1
            assert out == full[:len(out)], (trial, verified)


def _texts(engine, prompts, params_list):
    rids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    final = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                final[(out.request_id, out.sample_index)] = out.token_ids
    return [[final[(r, i)] for i in range(params.n)] for r, params in zip(rids, params_list)]


def test_seed_gives_the_same_text_alone_in_a_batch_and_at_tp2(ray_session, sharegpt_prompts):
    prompt, others = sharegpt_prompts[3], sharegpt_prompts[:3] + sharegpt_prompts[4:]
    batch_params = [RequestParams(max_tokens=24, temperature=0.8, seed=100 + i, ignore_eos=True)
                    for i in range(len(others))]
    cfg = ("speculative.num_speculative_tokens=3",)
    engine = local_engine(tiny_config("parallel.tp_size=1", *cfg))
    try:
        alone = _texts(engine, [prompt], [SAMPLED])[0]
        batched = _texts(engine, [prompt] + others, [SAMPLED] + batch_params)[0]
        other_seed = _texts(engine, [prompt], [dataclasses.replace(SAMPLED, seed=8)])[0]
    finally:
        engine.shutdown()
    tp2 = Engine(tiny_config("parallel.tp_size=2", *cfg))
    try:
        at_tp2 = _texts(tp2, [prompt], [SAMPLED])[0]
    finally:
        tp2.shutdown()
    assert alone == batched == at_tp2
    assert alone != other_seed


def test_n_samples_prefill_the_prompt_once(sharegpt_prompts, reference):
    prompts = [sharegpt_prompts[2][:32], sharegpt_prompts[3]]  # 32 tokens fills two blocks; 23 leaves one partial
    params = dataclasses.replace(SAMPLED, n=4)
    forked = local_engine(tiny_config("parallel.tp_size=1"))
    try:
        got = _texts(forked, prompts, [params, params])
        assert forked.stats.prefill_tokens == sum(len(p) for p in prompts)  # one prefill per prompt
        blocks = forked.scheduler.blocks
        assert len(blocks.free_blocks) == len(blocks.refs) and not any(blocks.refs)  # shared blocks all returned
        greedy_n = _texts(forked, [sharegpt_prompts[3]], [RequestParams(max_tokens=24, ignore_eos=True, n=3)])[0]
        assert greedy_n == [reference[3]] * 3
    finally:
        forked.shutdown()
    # one running sequence at a time: no sample can fork, each prefills on its own
    alone = local_engine(tiny_config("parallel.tp_size=1", "engine.max_num_seqs=1"))
    try:
        assert _texts(alone, prompts, [params, params]) == got
        assert alone.stats.prefill_tokens == 4 * sum(len(p) for p in prompts)
    finally:
        alone.shutdown()
    assert all(len(set(map(tuple, samples))) > 1 for samples in got)  # the samples differ from each other


def test_a_request_without_a_seed_gets_one_reported_that_reproduces_it(sharegpt_prompts):
    """The drawn seed is reported; sending it back gives the same text (static k). Seeds come
    from the OS, not from hash(request_id), which PYTHONHASHSEED changes."""
    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=3"))
    try:
        unseeded = dataclasses.replace(SAMPLED, seed=None, max_tokens=12)
        first, second = (engine.generate(sharegpt_prompts[:1], unseeded)[0][0] for _ in range(2))
        assert isinstance(first.seed, int) and first.seed != second.seed
        again = engine.generate(sharegpt_prompts[:1], dataclasses.replace(unseeded, seed=first.seed))[0][0]
        assert again.seed == first.seed and again.token_ids == first.token_ids
        seeds = set()
        for _ in range(2):  # the same request id twice: a seed derived from it would repeat
            engine.add_request(sharegpt_prompts[0], unseeded, request_id="same-id")
            while engine.has_work():
                seeds |= {o.seed for o in engine.step() if o.finished}
        assert len(seeds) == 2
    finally:
        engine.shutdown()


def test_the_offline_engine_takes_more_than_sixteen_samples(sharegpt_prompts):
    """16 is the HTTP server's limit (serve.max_n), not the engine's."""
    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=3"))
    try:
        outs = engine.generate(sharegpt_prompts[:1], dataclasses.replace(SAMPLED, n=20, max_tokens=4))[0]
        assert [o.sample_index for o in outs] == list(range(20)) and len({tuple(o.token_ids) for o in outs}) > 1
    finally:
        engine.shutdown()
