"""A rank dies mid-generation: the Engine rebuilds the worker group and every request
still finishes with its undisturbed greedy output. The profile actor dies: workers keep
their time model, the actor restarts and refits resume."""
from __future__ import annotations

from cluster.engine.core import Engine
from tests.conftest import greedy, tiny_config

TOKENS = 16


def _run(engine, prompts, kill_after_steps=None, kill=None):
    rids = [engine.add_request(p, greedy(TOKENS)) for p in prompts]
    streamed = {r: [] for r in rids}
    final = {}
    while engine.has_work():
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out.token_ids
        if kill_after_steps is not None and engine.stats.steps == kill_after_steps:
            kill(engine)
            kill_after_steps = None  # once
    return [final[r] for r in rids], [streamed[r] for r in rids]


def test_worker_death_is_survived(ray_session, sharegpt_prompts):
    import ray

    prompts = sharegpt_prompts[:4]
    engine = Engine(tiny_config("parallel.tp_size=2", "speculative.num_speculative_tokens=3"))
    try:
        reference, _ = _run(engine, prompts)
        got, streamed = _run(engine, prompts, kill_after_steps=engine.stats.steps + 4,
                             kill=lambda e: ray.kill(e.workers.actors[1]))
        assert engine.stats.recoveries == 1
        assert got == reference
        assert streamed == reference  # streams saw every token exactly once
    finally:
        engine.shutdown()


def test_profile_actor_death_is_survived(ray_session, sharegpt_prompts):
    import ray

    engine = Engine(tiny_config("parallel.tp_size=2", "speculative.adaptive.enabled=true",
                                "speculative.adaptive.profile_on_start=false", "speculative.adaptive.refit_every=8"))
    try:
        before = engine.time_models.force_refit()
        ray.kill(engine.time_models.actor, no_restart=False)  # Ray restarts it
        got, _ = _run(engine, sharegpt_prompts[:4])
        assert all(len(g) == TOKENS for g in got)  # the engine carried on meanwhile
        # the restarted actor resumes from the version the workers hold, and refits go on
        for _ in range(3):
            _run(engine, sharegpt_prompts[:4])
        after = engine.time_models.force_refit()
        assert after > before
        assert engine.time_model_version >= before
    finally:
        engine.shutdown()
