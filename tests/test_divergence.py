"""The Engine compares every rank's digest of what it decided and emitted."""
from __future__ import annotations

import pytest

from cluster.engine.core import Engine, RankDivergenceError
from tests.conftest import greedy, tiny_config


def test_injected_divergence_is_caught(ray_session, sharegpt_prompts):
    import ray

    engine = Engine(tiny_config("parallel.tp_size=2"))
    try:
        assert engine.generate(sharegpt_prompts[:2], greedy(4))  # agreeing ranks: no error
        ray.get(engine.workers.actors[1].inject_divergence.remote())
        with pytest.raises(RankDivergenceError, match=r"step \d+: ranks \[1\]"):
            engine.generate(sharegpt_prompts[:2], greedy(4))
    finally:
        engine.shutdown()
