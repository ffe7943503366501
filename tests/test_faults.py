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


def _wait_for_restart(actor, timeout_s: float = 60.0):
    """The restarted actor's status (before it, calls fail as the actor restarts)."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = ray.get(actor.status.remote(), timeout=10)
            if status.mae_ms is None:  # the new incarnation: it has not fitted anything yet
                return status
        except ray.exceptions.RayError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def test_profile_actor_death_is_survived(ray_session, sharegpt_prompts):
    """Ray restarts the actor; it resumes from the newest version the ranks hold (a
    restart from v1 would refit to versions the plans already passed, and plans would
    never move again), and its online refits reach every rank and the plans."""
    import ray

    engine = Engine(tiny_config("parallel.tp_size=2", "speculative.adaptive.enabled=true",
                                "speculative.adaptive.profile_on_start=false", "speculative.adaptive.refit_every=8"))
    try:
        reference, _ = _run(engine, sharegpt_prompts[:4])
        before = engine.time_models.force_refit()
        ray.kill(engine.time_models.actor, no_restart=False)  # Ray restarts it
        got, _ = _run(engine, sharegpt_prompts[:4])
        assert got == reference  # the engine carried on meanwhile, with the last model
        restarted = _wait_for_restart(engine.time_models.actor)
        assert restarted.version == before  # resumed from the newest version the ranks hold
        for _ in range(3):  # records sent while it restarted are lost; these reach it
            _run(engine, sharegpt_prompts[:4])
        assert engine.time_model_version > before  # refits of the restarted actor reached the plans
        held = [ray.get(a.current_time_model.remote()).version for a in engine.workers.actors]
        assert min(held) >= engine.time_model_version
    finally:
        engine.shutdown()
