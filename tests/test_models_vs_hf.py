"""Our tensor-parallel decoder's logits equal Hugging Face transformers' own forward."""
from __future__ import annotations

import pytest
import torch

from models.attention import AttnBatch
from models.loader import load_causal_lm
from tests.tp_util import run_tp

BLOCK = 16


def _save_hf(kind: str, path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen3":  # explicit head_dim (not hidden / heads), per-head q/k norms, no qkv bias
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    with torch.no_grad():  # random norms and biases, so a loader that skips them fails
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)


TAILS = (1, 3, 5)  # tokens of each sequence left for the second forward


def _ours(tp, path, seqs):
    """Prefill all but the last 1, 3 and 5 tokens (a long ragged batch: padded attention),
    then the rest in one forward shaped like a verification (short ragged queries:
    attention per query length). Exercises the KV cache and both attention paths."""
    torch.manual_seed(0)
    model = load_causal_lm(path, tp)
    caches = model.new_kv_cache(64, BLOCK)
    tables = [[4 * i + j for j in range(4)] for i in range(len(seqs))]
    out = [None] * len(seqs)
    with torch.no_grad():
        for phase in (0, 1):
            starts = [0 if phase == 0 else len(s) - t for s, t in zip(seqs, TAILS)]
            lens = [len(s) - t if phase == 0 else t for s, t in zip(seqs, TAILS)]
            batch = AttnBatch.build(starts, lens, tables, BLOCK)
            ids = torch.tensor([t for s, a, b in zip(seqs, starts, lens) for t in s[a:a + b]])
            logits = model.logits(model(ids, batch, caches))
            for i, chunk in enumerate(logits.split(lens)):
                out[i] = chunk if out[i] is None else torch.cat([out[i], chunk])
    return out


@pytest.fixture(params=["kernel", "torch"])
def attention_path(request, monkeypatch):
    """Both attention paths: the paged CPU kernel, and torch ops (what other devices and
    dtypes use)."""
    from models import kernels

    if request.param == "torch":
        monkeypatch.setitem(kernels._state, "ops", None)
    elif kernels.cpu_ops() is None:
        pytest.skip("the CPU kernels could not be built here")
    return request.param


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_logits_match_transformers(tmp_path, kind, tp_size, attention_path):
    from transformers import AutoModelForCausalLM

    _save_hf(kind, tmp_path)
    seqs = [[int(x) for x in torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n))]
            for n in (5, 17, 40)]
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [ref_model(torch.tensor([s])).logits[0] for s in seqs]
    if tp_size == 1:
        from models.parallel import TPGroup

        ranks = [_ours(TPGroup(), tmp_path, seqs)]
    else:
        ranks = run_tp(_ours, tp_size, tmp_path, seqs)
    for ours in ranks:  # every rank holds the full logits
        for r, o in zip(ref, ours):
            assert o.shape == r.shape
            assert (o - r).abs().max().item() <= 1e-4


CHUNKS = ((0, 12), (12, 33), (33, 40))  # a prompt prefilled in chunks (the second continues the first), then 7 more


def test_chunked_prefill_matches_transformers(tmp_path, attention_path):
    from transformers import AutoModelForCausalLM

    from models.parallel import TPGroup

    _save_hf("llama", tmp_path)
    seq = [int(x) for x in torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(1))]
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    model = load_causal_lm(tmp_path, TPGroup())
    caches = model.new_kv_cache(8, BLOCK)
    with torch.no_grad():
        ref = ref_model(torch.tensor([seq])).logits[0]
        for a, b in CHUNKS:
            batch = AttnBatch.build([a], [b - a], [[3, 1, 6]], BLOCK)
            ours = model.logits(model(torch.tensor(seq[a:b]), batch, caches))
            assert (ours - ref[a:b]).abs().max().item() <= 1e-4, (a, b)


def test_a_batch_of_long_and_short_queries_matches_transformers(tmp_path, attention_path):
    """Short queries continuing cached sequences beside a long one (a draft's catch-up where a
    sequence is new: torch ops take the long query alone and pad the short ones together)."""
    from transformers import AutoModelForCausalLM

    from models.parallel import TPGroup

    _save_hf("llama", tmp_path)
    gen = torch.Generator().manual_seed(2)
    seqs = [[int(x) for x in torch.randint(0, 250, (n,), generator=gen)] for n in (30, 24, 35, 28)]
    cached = (27, 21, 33, 0)  # positions already in the cache; the last sequence's whole prompt comes now
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    model = load_causal_lm(tmp_path, TPGroup())
    caches = model.new_kv_cache(24, BLOCK)
    tables = [list(range(i * 6, i * 6 + 6)) for i in range(4)]
    with torch.no_grad():
        refs = [ref_model(torch.tensor([s])).logits[0] for s in seqs]
        first = AttnBatch.build([0, 0, 0], list(cached[:3]), tables[:3], BLOCK)
        model(torch.tensor([t for s, c in zip(seqs, cached) for t in s[:c]]), first, caches)
        lens = [len(s) - c for s, c in zip(seqs, cached)]
        batch = AttnBatch.build(list(cached), lens, tables, BLOCK)
        assert not batch.short
        ours = model.logits(model(torch.tensor([t for s, c in zip(seqs, cached) for t in s[c:]]), batch, caches))
    at = 0
    for s, c, ref in zip(seqs, cached, refs):
        assert (ours[at:at + len(s) - c] - ref[c:]).abs().max().item() <= 1e-4, c
        at += len(s) - c


def _rank_and_sum(tp, values):
    return tp.rank, tp.all_reduce(torch.tensor(values)).tolist()


def test_tp_ranks_start_over_when_their_rendezvous_port_is_taken(monkeypatch):
    """The TP tests' harness: a port another process took after free_port() found it free
    makes the ranks start over on a fresh one, instead of waiting out the queue's timeout."""
    import socket

    from tests import tp_util

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], tp_util.free_port()])
        monkeypatch.setattr(tp_util, "free_port", lambda: next(ports))
        assert run_tp(_rank_and_sum, 2, [1.0, 2.0]) == [(0, [2.0, 4.0]), (1, [2.0, 4.0])]
