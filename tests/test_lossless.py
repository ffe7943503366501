"""Sampling stays exact under adaptive pruning (DESIGN.md section 3, losslessness).

A 16-token target and a different 16-token draft model are built here; the exact target
distribution of the first three sampled tokens is computed by enumeration, and 20,000
sampled outputs per run are compared with it by a chi-square test.

With the keep rule (the best prefix) and a token-independent estimator (top_prob_logistic,
top_prob_calibrated) the samples follow the target. The token-dependent estimator (xLLM's `token_prob`) makes the choice
to verify draft j depend on the drawn token itself; it stays exact here too, because the
first unverified draft still decides its own position by the accept/residual test (see
`workers.sampler.rejection_accept`): each position's token is then the same function of
the seed whatever was verified. The negative control switches that off and draws the
bonus fresh from p, as xLLM does; with `token_prob` the test must then detect the skew
(drafts the target would likely reject have low draft probability, go unverified, and
are replaced by fresh target samples, so the mixture is no longer p), which shows the
check has teeth.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from controller.time_model import TimeModel
from tests.conftest import local_engine, tiny_config

VOCAB, SAMPLES, CHECKED, GENERATED = 16, 20_000, 3, 4
PROMPT = [1, 5, 9, 2]
# With ~1000 sequences a step, a draft pays when its path probability is above about 1/3:
# the decision keeps some drafts and prunes others, by their estimates (what is tested).
TIME_MODEL = TimeModel(b0=10.0, b1=0.005, b2=0.0, d0=0.01, d1=0.0)


def _save_pair(root) -> None:
    """Target: random, peaked (large init). Draft: the target with perturbed weights, so
    it agrees often but not always (acceptance in between, where pruning matters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.4)
    target = LlamaForCausalLM(cfg)
    target.save_pretrained(root / "target")
    with torch.no_grad():
        for p in target.parameters():
            p.add_(torch.randn_like(p) * 0.15 * p.std())
    target.save_pretrained(root / "draft")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    _save_pair(root)
    return root


def _exact_distribution(target_dir) -> dict[tuple[int, ...], float]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    probs = {}
    with torch.no_grad():
        for prefix in itertools.product(range(VOCAB), repeat=CHECKED - 1):
            ids = torch.tensor([PROMPT + list(prefix)])
            p = torch.softmax(model(ids).logits[0].double(), -1)  # (T, V)
            n = len(PROMPT)
            base = float(p[n - 1, prefix[0]] * p[n, prefix[1]])
            for t3 in range(VOCAB):
                probs[prefix + (t3,)] = base * float(p[n + 1, t3])
    return probs


def _sample(pair, k: int, estimator: str, fresh_bonus: bool = False) -> list[tuple[int, ...]]:
    from cluster.engine.request import RequestParams

    cfg = tiny_config("parallel.tp_size=1", f"model.target={pair / 'target'}", f"model.draft={pair / 'draft'}",
                      "speculative.method=draft_model", f"speculative.num_speculative_tokens={k}",
                      "speculative.adaptive.enabled=true", "speculative.adaptive.profile_on_start=false",
                      f"speculative.adaptive.estimator={estimator}", "model.max_model_len=32",
                      "cache.kv_tokens=32768", "engine.max_num_seqs=1024", f"engine.max_waiting={SAMPLES}")
    engine = local_engine(cfg)
    try:
        engine.time_models.install(TIME_MODEL)
        engine.workers.worker.runner.fresh_bonus = fresh_bonus
        for seed in range(SAMPLES):
            engine.add_request(PROMPT, RequestParams(max_tokens=GENERATED, temperature=1.0, seed=seed, ignore_eos=True))
        outs = []
        while engine.has_work():
            outs += [tuple(o.token_ids[:CHECKED]) for o in engine.step() if o.finished]  # a 4th token lets the 3rd be a draft
        st = engine.stats
        assert 0 < st.verified < st.drafted, "the test needs pruning to happen"
        return outs
    finally:
        engine.shutdown()


def _chi_square_p(samples: list[tuple[int, ...]], probs: dict) -> float:
    from scipy.stats import chisquare

    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    big = [s for s, p in probs.items() if p * n >= 5]  # cells with enough expected mass
    observed = [counts.get(s, 0) for s in big]
    expected = [probs[s] * n for s in big]
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    return float(chisquare(np.array(observed), np.array(expected)).pvalue)


@pytest.fixture(scope="module")
def exact(pair):
    return _exact_distribution(pair / "target")


@pytest.mark.parametrize("k,estimator", [(2, "top_prob_logistic"), (4, "top_prob_logistic"),
                                         (4, "top_prob_calibrated")])
def test_adaptive_sampling_matches_target(pair, exact, k, estimator):
    assert _chi_square_p(_sample(pair, k, estimator), exact) > 0.001


def test_token_dependent_estimator_stays_exact(pair, exact):
    assert _chi_square_p(_sample(pair, 4, "token_prob"), exact) > 0.001


def test_token_dependent_estimator_with_fresh_bonus_is_caught(pair, exact):
    assert _chi_square_p(_sample(pair, 4, "token_prob", fresh_bonus=True), exact) < 0.001
