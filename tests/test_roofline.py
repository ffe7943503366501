"""The simulator's roofline cost model (cluster/sim) and its spec files (yamls/models, yamls/hardware)."""
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from cluster.sim.roofline import RooflineCost, experts_touched, params_per_rank
from cluster.sim.specs import DTYPE_BYTES, HardwareSpec, ModelSpec, SpecError, load_hardware, load_model

ROOT = Path(__file__).resolve().parents[1] / "yamls"
DSV3, L70, L8 = (ROOT / "models" / f for f in ("deepseek-v3.yaml", "llama-3-70b.yaml", "llama-3-8b.yaml"))
H200, ASCEND = ROOT / "hardware" / "h200.yaml", ROOT / "hardware" / "ascend-910b.yaml"

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100}


def flat_hw(tflops=1.0, gbps=1.0, **kw) -> HardwareSpec:
    """A chip with round figures and no overheads, so times are bytes/bandwidth or flops/peak exactly."""
    figures = dict(name="flat", peak_tflops={"bf16": tflops}, hbm_bandwidth_GBps=gbps, link_bandwidth_GBps=1.0,
                   allreduce_latency_us=0.0, flops_efficiency=1.0, bw_efficiency=1.0, forward_overhead_ms=0.0,
                   step_overhead_ms=0.0, host_ms_per_token=0.0, sources=("test",))
    return HardwareSpec(**(figures | kw))


def batch(n, q, kv=2048):
    return np.full(n, float(q)), np.full(n, float(kv))


def test_dense_bytes_and_flops_match_hand_count_at_tp1():
    model = ModelSpec.from_hf_config(TINY, dtype="bf16")
    q, kv = np.array([1.0, 3.0]), np.array([10.0, 20.0])
    attn = 64 * 16 * (4 + 2 + 2) + 4 * 16 * 64  # q, k, v, o
    mlp = 3 * 64 * 128
    head = 100 * 64
    weight_bytes = (2 * (attn + mlp) + head) * 2
    kv_bytes = 2 * 2 * 16 * 2 * 2 * (11 + 23)  # K and V x kv heads x head_dim x bf16 x layers x positions
    pairs = 1 * 11 + 3 * 23
    flops = 2 * (2 * (attn + mlp) + head) * 4 + pairs * 4 * 4 * 16 * 2  # 2 x params x T + pairs x 4 x heads x head_dim x layers
    work = RooflineCost(model, flat_hw(), 1).work(q, kv)
    assert work == {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops, "allreduce_bytes": 0.0}
    # memory-bound chip: time is bytes / bandwidth; compute-bound chip: flops / peak
    assert RooflineCost(model, flat_hw(tflops=1e6), 1).validate_ms(q, kv) == pytest.approx((weight_bytes + kv_bytes) / 1e9 * 1e3)
    assert RooflineCost(model, flat_hw(gbps=1e9), 1).validate_ms(q, kv) == pytest.approx(flops / 1e12 * 1e3)
    assert params_per_rank(model) == 2 * (attn + mlp) + 2 * head


def test_decode_is_memory_bound_at_batch_1_and_compute_bound_at_256():
    cost = RooflineCost(load_model(L70), load_hardware(H200), 8)
    one, four = cost.validate_ms(*batch(1, 1)), cost.validate_ms(*batch(1, 4))
    assert one < four < 1.05 * one
    b = cost.breakdown(*batch(256, 4))
    assert b["flops"] > b["weights"] + b["kv"]
    assert b["total"] == pytest.approx(cost.validate_ms(*batch(256, 4)))
    ratio = cost.validate_ms(*batch(256, 8)) / cost.validate_ms(*batch(256, 4))
    assert 1.6 < ratio < 2.05  # twice the tokens, nearly twice the time


def test_allreduce_only_with_tp_and_grows_with_tp():
    model, hw = load_model(L70), load_hardware(H200)
    q, kv = batch(64, 4)
    assert RooflineCost(model, hw, 1).breakdown(q, kv)["allreduce"] == 0.0
    assert RooflineCost(model, hw, 1).work(q, kv)["allreduce_bytes"] == 0.0
    times = [RooflineCost(model, hw, tp).breakdown(q, kv)["allreduce"] for tp in (2, 4, 8, 16)]
    assert 0 < times[0] < times[1] < times[2] < times[3]
    # 16 ranks span two 8-GPU nodes: the internode hop costs more than the step from 4 to 8
    assert times[3] - times[2] > times[2] - times[1]
    twelve = ModelSpec.from_hf_config(TINY | {"num_attention_heads": 12, "num_key_value_heads": 12, "intermediate_size": 144})
    with pytest.raises(ValueError, match="devices_per_node"):
        RooflineCost(twelve, hw, 12)  # shards, but 12 ranks do not fill whole 8-GPU nodes


def test_mla_caches_the_latent_replicated_on_every_rank():
    model, hw = load_model(DSV3), load_hardware(H200)
    assert DTYPE_BYTES[model.kv_dtype] == 2
    q, kv = batch(4, 1, 1000)
    per_tp = {}
    for tp in (1, 8, 16):
        cost = RooflineCost(model, hw, tp)
        assert cost.shard.kv_per_pos * DTYPE_BYTES[model.kv_dtype] == (512 + 64) * 2
        per_tp[tp] = cost.work(q, kv)["kv_bytes"]
    assert per_tp[1] == per_tp[8] == per_tp[16] == (512 + 64) * 2 * 61 * 4 * 1001
    # GQA by contrast shards KV heads until there is one per rank, then replicates it
    l8 = load_model(L8)
    kv_elems = {tp: RooflineCost(l8, hw, tp).shard.kv_per_pos for tp in (1, 8, 16)}
    assert kv_elems == {1: 2 * 8 * 128, 8: 2 * 128, 16: 2 * 128}


def test_moe_touches_expected_distinct_experts():
    assert experts_touched(256, 8, 1) == pytest.approx(8)
    assert experts_touched(256, 8, 2) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 2))
    assert experts_touched(256, 8, 4096) == pytest.approx(256, rel=1e-6)
    cost = RooflineCost(load_model(DSV3), load_hardware(H200), 8)
    expert_bytes = 3 * 7168 * 2048 // 8  # one expert's shard, fp8
    grown = cost.work(*batch(512, 1))["weight_bytes"] - cost.work(*batch(1, 1))["weight_bytes"]
    assert grown == pytest.approx(58 * expert_bytes * (experts_touched(256, 8, 512) - 8))
    w1, w256 = cost.work(*batch(1, 1))["flops"], cost.work(*batch(256, 1))["flops"]
    assert w256 / w1 == pytest.approx(256, rel=0.05)  # FLOPs count active experts only


def test_deepseek_v3_parameter_count_and_per_rank_bytes():
    model = load_model(DSV3)
    total, with_mtp = params_per_rank(model), params_per_rank(model, include_mtp=True)
    assert abs(total - 671e9) < 0.05 * 671e9
    # the MTP module adds one MoE layer and eh_proj (its embedding and head are shared): ~682.6B, near the 685B quoted
    assert abs(with_mtp - 685e9) < 0.05 * 685e9
    assert with_mtp - total == pytest.approx(11.61e9, rel=0.01)
    cost = RooflineCost(model, load_hardware(ASCEND), 16)
    assert cost.weight_bytes_per_rank() == pytest.approx(671e9 / 16, rel=0.10)
    assert cost.compute_dtype == "bf16"  # the 910B has no FP8 units: FP8 weights multiply at bf16 rate
    assert RooflineCost(model, load_hardware(H200), 8).compute_dtype == "fp8"
    for path, expect in ((L70, 70.6e9), (L8, 8.03e9)):
        assert params_per_rank(load_model(path)) == pytest.approx(expect, rel=0.01)


def _write(tmp_path, name, data) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_missing_field_is_named_with_the_file(tmp_path):
    raw = yaml.safe_load(DSV3.read_text())
    del raw["hf_config"]["kv_lora_rank"]
    with pytest.raises(SpecError, match=r"broken\.yaml.*'kv_lora_rank'"):
        load_model(_write(tmp_path, "broken.yaml", raw))
    raw = yaml.safe_load(DSV3.read_text())
    del raw["source"]
    with pytest.raises(SpecError, match="'source'"):
        load_model(_write(tmp_path, "nosource.yaml", raw))
    hw = yaml.safe_load(H200.read_text())
    del hw["hbm_bandwidth_GBps"]
    with pytest.raises(SpecError, match=r"hw\.yaml.*'hbm_bandwidth_GBps'"):
        load_hardware(_write(tmp_path, "hw.yaml", hw))
    hw = yaml.safe_load(H200.read_text()) | {"bw_efficiency": 1.5}
    with pytest.raises(SpecError, match="'bw_efficiency'"):
        load_hardware(_write(tmp_path, "hw.yaml", hw))


def test_unshardable_config_names_the_field():
    with pytest.raises(ValueError, match="num_attention_heads"):
        RooflineCost(load_model(L70), load_hardware(H200), 3)
    odd_kv = ModelSpec.from_hf_config(TINY | {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        RooflineCost(odd_kv, flat_hw(), 2)
    odd_mlp = ModelSpec.from_hf_config(TINY | {"intermediate_size": 130})
    with pytest.raises(ValueError, match="intermediate_size"):
        RooflineCost(odd_mlp, flat_hw(), 4)


def test_spec_files_load_with_sources():
    for path in (DSV3, L70, L8):
        model = load_model(path)
        assert model.source and model.draft.kind == "mtp"
    for path in (H200, ASCEND):
        hw = load_hardware(path)
        assert len(hw.sources) >= 3 and "bf16" in hw.peak_tflops
    assert "fp8" not in load_hardware(ASCEND).peak_tflops


def test_draft_costs(tmp_path):
    hw = load_hardware(H200)
    for path, tp in ((DSV3, 8), (L70, 8), (L8, 1)):
        cost = RooflineCost(load_model(path), hw, tp)
        for n in (1, 32, 256):
            q, kv = batch(n, 1)
            assert 0 < cost.draft_ms(n, kv) < 0.5 * cost.validate_ms(q, kv)
        assert cost.draft_ms(0, np.zeros(0)) == 0.0
    raw = yaml.safe_load(L70.read_text()) | {"draft": {"model": "llama-3-8b.yaml", "tp": 1}}
    (tmp_path / "llama-3-8b.yaml").write_text(L8.read_text())
    cost = RooflineCost(load_model(_write(tmp_path, "pair.yaml", raw)), hw, 8)
    q, kv = batch(16, 1)
    assert cost.draft_ms(16, kv) == RooflineCost(load_model(L8), hw, 1).validate_ms(q, kv)
    assert cost.other_ms(16, 40) == pytest.approx(hw.step_overhead_ms + 16 * hw.host_ms_per_seq + 40 * hw.host_ms_per_token)


def test_a_call_at_batch_256_is_cheap():
    cost = RooflineCost(load_model(DSV3), load_hardware(H200), 8)
    rng = np.random.default_rng(0)
    q, kv = rng.integers(1, 5, 256).astype(float), rng.integers(100, 4000, 256).astype(float)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(50):
            cost.validate_ms(q, kv)
            cost.draft_ms(256, kv)
        best = min(best, (time.perf_counter() - start) / 100)
    assert best < 1e-3
