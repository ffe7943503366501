"""DeepSeek-V3 (MLA + MoE), tensor parallel: our logits equal transformers' through
prefill and paged decode steps; the cache holds latents, not heads; shapes that cannot
shard are refused by name."""
from __future__ import annotations

import pytest
import torch

from models.attention import AttnBatch
from models.config import ModelArch
from models.loader import load_causal_lm
from models.parallel import TPGroup
from tests.tp_util import run_tp

BLOCK = 16
VOCAB = 128
SIZES = (5, 20, 37)  # prompt + decoded tokens of each sequence
DECODE = 4  # the last DECODE tokens of each go one per step through the paged cache
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's, a short original


def small_config(**overrides):
    from transformers import DeepseekV3Config

    cfg = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
           "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
           "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
           "max_position_embeddings": 256, "initializer_range": 0.08, "num_nextn_predict_layers": 1,
           "tie_word_embeddings": False}
    return DeepseekV3Config(**(cfg | overrides))


def save_deepseek(path, **overrides) -> None:
    """A random float32 checkpoint; norms and the routing bias are random too, so a
    loader that skips them fails."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(small_config(**overrides)).float()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or "e_score_correction_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)


def prompts() -> list[list[int]]:
    return [[int(x) for x in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
            for n in SIZES]


def reference(path, seqs) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0] for s in seqs]


def ours(tp: TPGroup, path, seqs) -> list[torch.Tensor]:
    """Prefill all but the last DECODE tokens of each sequence in one ragged forward,
    then decode them one per step for all sequences at once."""
    torch.manual_seed(0)
    model = load_causal_lm(path, tp)
    caches = model.new_kv_cache(16, BLOCK)
    tables = [[3 * i + 2, 3 * i + 1, 3 * i] for i in range(len(seqs))]  # blocks out of order
    out = [[] for _ in seqs]
    steps = [(0, len(s) - DECODE) for s in seqs], *[[(len(s) - DECODE + j, 1) for s in seqs] for j in range(DECODE)]
    with torch.no_grad():
        for step in steps:
            batch = AttnBatch.build([a for a, _ in step], [n for _, n in step], tables, BLOCK)
            ids = torch.tensor([t for s, (a, n) in zip(seqs, step) for t in s[a:a + n]])
            logits = model.logits(model(ids, batch, caches))
            for i, chunk in enumerate(logits.split([n for _, n in step])):
                out[i].append(chunk)
    return [torch.cat(o) for o in out]


def max_diff(path, tp_size: int) -> float:
    seqs = prompts()
    ref = reference(path, seqs)
    ranks = [ours(TPGroup(), path, seqs)] if tp_size == 1 else run_tp(ours, tp_size, path, seqs)
    worst = 0.0
    for got in ranks:  # every rank holds the full logits
        for r, o in zip(ref, got):
            assert o.shape == r.shape
            worst = max(worst, (o - r).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek")
    save_deepseek(path)
    return path


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_logits_match_transformers(checkpoint, tp_size):
    diff = max_diff(checkpoint, tp_size)
    print(f"tp={tp_size} max |logits - transformers| = {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.parametrize("tp_size", [1, 2])
def test_yarn_logits_match_transformers(tmp_path, tp_size):
    save_deepseek(tmp_path, rope_parameters=dict(YARN))
    assert ModelArch.from_dir(tmp_path).rope_scaling["rope_type"] == "yarn"
    diff = max_diff(tmp_path, tp_size)
    print(f"yarn tp={tp_size} max |logits - transformers| = {diff:.3g}")
    assert diff <= 1e-4


def test_no_q_lora_matches_transformers(tmp_path):
    save_deepseek(tmp_path, q_lora_rank=None, num_hidden_layers=2)
    assert max_diff(tmp_path, 1) <= 1e-4


def test_cache_holds_latents(checkpoint):
    model = load_causal_lm(checkpoint, TPGroup())
    blocks = 4
    caches = model.new_kv_cache(blocks, BLOCK)
    ds, arch = model.arch.deepseek, model.arch
    per_token = [sum(t.nbytes for t in cache) // (blocks * BLOCK) for cache in caches]
    assert per_token == [(ds.kv_lora_rank + ds.qk_rope_head_dim) * 4] * arch.num_layers  # 40 floats
    expanded = arch.num_heads * (ds.qk_nope_head_dim + ds.qk_rope_head_dim + ds.v_head_dim) * 4  # 320 floats
    assert sum(per_token) * 8 == arch.num_layers * expanded
    for cache in caches:  # block-first, as ModelRunner._fork copies blocks
        assert all(t.shape[:2] == (blocks, BLOCK) for t in cache)


@pytest.mark.parametrize("field, overrides", [
    ("num_attention_heads", {"num_attention_heads": 6, "num_key_value_heads": 6}),
    ("intermediate_size", {"intermediate_size": 90}),
    ("moe_intermediate_size", {"moe_intermediate_size": 30}),
])
def test_unshardable_refused(tmp_path, field, overrides):
    save_deepseek(tmp_path, **overrides)
    with pytest.raises(ValueError, match=f"does not divide {field}="):
        load_causal_lm(tmp_path, TPGroup(0, 4))
