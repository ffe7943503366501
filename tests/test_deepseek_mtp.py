"""The DeepSeek-V3 checkpoint's own MTP layer (`model.layers.{num_hidden_layers}.*`) as
the proposer (`model.mtp: null`): greedy speculation, static and adaptive, emits exactly
the target-only greedy tokens at TP 1 and 2."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.engine.core import Engine
from tests.conftest import greedy, local_engine, tiny_config, token_ids
from tests.test_adaptive import PRUNING_MODEL
from tests.test_deepseek import save_deepseek, small_config

VOCAB = 16  # a small vocabulary, so that random MTP weights still land some drafts
LAYERS = 2
MAX_TOKENS = 16
PROMPTS = [[int(x) for x in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
           for n in (3, 9, 30, 17)]


def add_mtp_layer(path) -> None:
    """Random weights in DeepSeek's MTP layout, appended to the checkpoint: a decoder
    block (MLA, MoE) and enorm, hnorm, eh_proj, shared_head.{norm,head}, embed_tokens."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(1)
    hf = DeepseekV3ForCausalLM(small_config(vocab_size=VOCAB, num_hidden_layers=LAYERS + 1)).float()
    prefix = f"model.layers.{LAYERS}."
    tensors = load_file(f"{path}/model.safetensors")
    state = hf.state_dict()
    extra = {n: t for n, t in state.items() if n.startswith(prefix) and ".experts." not in n}
    gate_up, down = state[prefix + "mlp.experts.gate_up_proj"], state[prefix + "mlp.experts.down_proj"]
    for e in range(gate_up.shape[0]):  # transformers holds experts fused; checkpoints name each one
        gate, up = gate_up[e].chunk(2)
        extra |= {f"{prefix}mlp.experts.{e}.{name}.weight": w
                  for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down[e]))}
    hidden = hf.config.hidden_size
    extra.update({prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden),
                  prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
                  prefix + "eh_proj.weight": 0.08 * torch.randn(hidden, 2 * hidden),
                  prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
                  prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                  prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file({n: t.contiguous() for n, t in (tensors | extra).items()}, f"{path}/model.safetensors",
              metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_mtp")
    save_deepseek(path, vocab_size=VOCAB, num_hidden_layers=LAYERS)
    add_mtp_layer(path)
    return path


def config(path, *overrides):
    return tiny_config(f"model.target={path}", "model.mtp=null", "model.max_model_len=256",
                       "speculative.method=mtp", "speculative.num_speculative_tokens=3",
                       "speculative.adaptive.enabled=true", "speculative.adaptive.profile_on_start=false", *overrides)


@pytest.fixture(scope="module")
def reference(checkpoint):
    engine = local_engine(config(checkpoint, "parallel.tp_size=1", "speculative.enabled=false"))
    try:
        return token_ids(engine.generate(PROMPTS, greedy(MAX_TOKENS)))
    finally:
        engine.shutdown()


def check_static_and_adaptive(engine, reference) -> None:
    engine.set_mode("static")
    for k in (1, 3):
        engine.set_num_speculative_tokens(k)
        before = engine.stats.drafted
        assert token_ids(engine.generate(PROMPTS, greedy(MAX_TOKENS))) == reference, f"static k={k}"
        assert engine.stats.drafted > before
    assert engine.stats.accepted > 0  # some drafts land, so accepting is exercised too
    engine.set_mode("adaptive")
    engine.time_models.install(PRUNING_MODEL)
    assert token_ids(engine.generate(PROMPTS, greedy(MAX_TOKENS))) == reference, "adaptive"


def test_own_mtp_greedy_equals_target_tp1(checkpoint, reference):
    from models.deepseek import DeepseekMTPLayer

    engine = local_engine(config(checkpoint, "parallel.tp_size=1"))
    try:
        assert isinstance(engine.workers.worker.runner.proposer.mtp, DeepseekMTPLayer)
        check_static_and_adaptive(engine, reference)
    finally:
        engine.shutdown()


def test_own_mtp_greedy_equals_target_tp2(checkpoint, reference, ray_session):
    engine = Engine(config(checkpoint, "parallel.tp_size=2"))
    try:
        check_static_and_adaptive(engine, reference)
    finally:
        engine.shutdown()


def test_checkpoint_without_mtp_layers_is_refused(tmp_path):
    save_deepseek(tmp_path, vocab_size=VOCAB, num_hidden_layers=LAYERS, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        local_engine(config(tmp_path, "parallel.tp_size=1"))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):  # not DeepSeek: no MTP layer either
        local_engine(tiny_config("model.mtp=null", "speculative.method=mtp", "parallel.tp_size=1"))


def test_samples_fork_the_latent_cache(checkpoint, reference):
    """n greedy samples of a prompt fork after its prefill: the partial prompt block of
    the (latent, rope) cache is copied, and every sample continues as the target alone."""
    from cluster.engine.request import RequestParams

    engine = local_engine(config(checkpoint, "parallel.tp_size=1"))
    try:
        engine.set_mode("static")
        results = engine.generate(PROMPTS, RequestParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=3))
        assert [[s.token_ids for s in samples] for samples in results] == [[r] * 3 for r in reference]
    finally:
        engine.shutdown()
