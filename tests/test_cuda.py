"""The CUDA path (parallel.device=cuda): run where a GPU is present, skipped elsewhere.

    python -m pytest -q tests/test_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import greedy, local_engine, tiny_config, token_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_logits_match_transformers_on_cuda(tmp_path):
    from transformers import AutoModelForCausalLM

    from models.attention import AttnBatch
    from models.loader import load_causal_lm
    from models.parallel import TPGroup
    from tests.test_models_vs_hf import TAILS, _save_hf

    _save_hf("llama", tmp_path)
    seqs = [[int(x) for x in torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n))]
            for n in (5, 17, 40)]
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).to("cuda").eval()
    model = load_causal_lm(tmp_path, TPGroup(), torch.float32, "cuda")
    caches = model.new_kv_cache(64, 16)
    tables = [[4 * i + j for j in range(4)] for i in range(len(seqs))]
    with torch.no_grad():
        for phase in (0, 1):  # a long ragged prefill, then short ragged queries
            starts = [0 if phase == 0 else len(s) - t for s, t in zip(seqs, TAILS)]
            lens = [len(s) - t if phase == 0 else t for s, t in zip(seqs, TAILS)]
            batch = AttnBatch.build(starts, lens, tables, 16, "cuda")
            ids = torch.tensor([t for s, a, n in zip(seqs, starts, lens) for t in s[a:a + n]], device="cuda")
            ours = model.logits(model(ids, batch, caches)).split(lens)
            for s, a, n, o in zip(seqs, starts, lens, ours):
                ref = ref_model(torch.tensor([s], device="cuda")).logits[0, a:a + n]
                assert (o - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("extra", [("speculative.method=mtp",), ("speculative.method=draft_model",),
                                   ("speculative.adaptive.enabled=true",
                                    "speculative.adaptive.profile_on_start=false")])
def test_speculative_greedy_equals_target_on_cuda(sharegpt_prompts, extra):
    base = ("parallel.tp_size=1", "parallel.device=cuda")
    target_only = local_engine(tiny_config(*base, "speculative.enabled=false"))
    try:
        reference = token_ids(target_only.generate(sharegpt_prompts, greedy(24)))
    finally:
        target_only.shutdown()
    engine = local_engine(tiny_config(*base, "speculative.num_speculative_tokens=5", *extra))
    try:
        assert token_ids(engine.generate(sharegpt_prompts, greedy(24))) == reference
        assert engine.stats.accepted > 0
    finally:
        engine.shutdown()
