"""When running sequences outgrow the KV cache, the youngest is preempted and recomputed
later: every request still finishes with its undisturbed greedy output."""
from __future__ import annotations

from tests.conftest import greedy, local_engine, tiny_config, token_ids

TOKENS = 40


def test_kv_pressure_preempts_and_recomputes(sharegpt_prompts):
    prompts = sharegpt_prompts[:6]
    roomy = local_engine(tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=3"))
    try:
        reference = token_ids(roomy.generate(prompts, greedy(TOKENS)))
    finally:
        roomy.shutdown()
    # 12 blocks of 16 positions: one long sequence needs up to 7, so two cannot both grow
    tight = local_engine(tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=3",
                                     "model.max_model_len=128", "cache.kv_tokens=192"))
    try:
        preempted = []
        original = tight.scheduler._preempt

        def spy(seq):
            preempted.append(seq.seq_id)
            original(seq)

        tight.scheduler._preempt = spy
        assert token_ids(tight.generate(prompts, greedy(TOKENS))) == reference
        assert preempted, "the cache was never full: the test did not exercise preemption"
    finally:
        tight.shutdown()


def test_full_waiting_queue_is_refused_with_429():
    from cluster.engine.request import QueueFullError, RequestParams
    from cluster.serving.asgi import error_answer

    engine = local_engine(tiny_config("parallel.tp_size=1", "engine.max_waiting=2"))
    try:
        accepted = [engine.add_request("Hello", RequestParams(max_tokens=3, ignore_eos=True)) for _ in range(2)]
        try:
            engine.add_request("Hello", RequestParams(max_tokens=3))
            raise AssertionError("a third request was queued beyond engine.max_waiting=2")
        except QueueFullError as e:
            status, body, headers = error_answer(e)
            assert status == 429 and (b"retry-after", b"1") in headers and body["error"]["code"] == "queue_full"
        done = []
        while engine.has_work():
            done += [o.request_id for o in engine.step() if o.finished]
        assert sorted(done) == sorted(accepted)  # nothing already accepted was lost
    finally:
        engine.shutdown()
