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


def test_tp16_matches_tp1(ray_session, sharegpt_prompts, reference):
    engine = Engine(tiny_config("parallel.tp_size=16", "speculative.num_speculative_tokens=3",
                                "parallel.placement_strategy=PACK"))
    try:
        results = engine.generate(sharegpt_prompts[:3], greedy(6))
        assert token_ids(results) == [r[:6] for r in reference[:3]]
    finally:
        engine.shutdown()
