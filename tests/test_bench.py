"""A small bench run: every arm, our own and the Hugging Face peers, reproduces the
target-only greedy reference; rounds, intervals, ratios and the control arm are in
bench.json; the step trace holds what each decode step saw and decided."""
from __future__ import annotations

import json

import pytest

from cluster.bench.offline import run_bench
from cluster.bench.stats import bootstrap_ci, ratio_summary
from cluster.engine.trace import read_trace
from tests.conftest import tiny_config

ROUNDS = 2


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cfg = tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=3",
                      "speculative.adaptive.enabled=true", "speculative.adaptive.profile_on_start=false",
                      "bench.num_prompts=3", "bench.output_len=12", "bench.batch_sizes=[1,2]", "bench.ks=[3]",
                      "bench.hf_prompts=2", "bench.hf_tune=false", f"bench.rounds={ROUNDS}", "bench.min_round_s=0.05")
    return run_bench(cfg, out, trace=str(out / "trace.jsonl")), out


def test_bench_smoke(bench_run):
    result, out = bench_run
    assert result["outputs_identical"] and result["engine_outputs_identical"]
    names = [a["name"] for a in result["arms"]]
    ours = ["nospec", "static-3", "adaptive-3", "oracle-3", "nospec-again"]
    assert names == [f"{n}@b1" for n in ours + ["hf-target", "hf-assisted"]] + [f"{n}@b2" for n in ours]
    for arm in result["arms"]:
        assert arm["outputs_identical"] and len(arm["rounds"]) == ROUNDS
        low, high = arm["tok_per_s_ci"]
        assert low <= arm["tok_per_s"] <= high and min(arm["rounds"]) <= arm["tok_per_s"] <= max(arm["rounds"])
    decode = [a["decode_tpot_ms"] for a in result["arms"] if not a["policy"].startswith("hf")]
    assert all(t is not None and t > 0 for t in decode)
    oracle = next(a for a in result["arms"] if a["policy"] == "oracle")
    assert oracle["acceptance_rate"] == 1.0  # the oracle verifies exactly what will be accepted
    kinds = {(r["arm"], r["to"]): r["kind"] for r in result["ratios"]}
    assert kinds[("nospec-again@b2", "nospec@b2")] == "control"
    assert kinds[("adaptive-3@b1", "static-3@b1")] == "to best static"
    assert kinds[("adaptive-3@b1", "oracle-3@b1")] == "to oracle"
    for r in result["ratios"]:
        assert r["ci"][0] <= r["median"] <= r["ci"][1] and r["no_difference"] == (r["ci"][0] <= 1 <= r["ci"][1])
    assert result["control_ok"] == all(r["no_difference"] for r in result["ratios"] if r["kind"] == "control")
    assert result["vllm"] == {"skipped": "bench.vllm_python is not set"}
    saved = json.loads((out / "bench.json").read_text())
    assert saved["arms"] == result["arms"] and "control_ok" in saved
    md = (out / "bench.md").read_text()
    assert md.startswith("| arm") and "nospec-again@b1 / nospec@b1" in md
    assert (out / "bench.png").stat().st_size > 10_000


def test_step_trace(bench_run):
    result, out = bench_run
    lines = list(read_trace(out / "trace.jsonl"))
    labels = {line["label"].split("/")[0] for line in lines}
    assert {"static-3@b2", "adaptive-3@b2", "oracle-3@b1", "nospec@b1"} <= labels
    steps = sum(a["steps"] for a in result["arms"] if a["policy"] == "static" and a["batch"] == 2)
    static = [x for x in lines if x["label"].startswith("static-3@b2/r")]
    assert len(static) == steps  # one line per measured decode step
    for line in lines:
        n, m = line["batch"], line["draft_steps"]
        assert len(line["kv"]) == len(line["keep"]) == len(line["accepted"]) == n
        for key in ("top_prob", "margin", "entropy"):
            assert len(line[key]) == n and all(len(row) == m for row in line[key])
        for i in range(n):
            assert 0 <= line["accepted"][i] <= line["keep"][i] <= min(m, line["num_spec"][i])
            for j in range(m):
                assert 0 <= line["margin"][i][j] <= line["top_prob"][i][j] <= 1 and line["entropy"][i][j] >= 0
    for line in static:  # static k verifies every draft it may
        assert line["keep"] == [min(line["draft_steps"], s) for s in line["num_spec"]]


def test_bootstrap_interval():
    values = [100.0, 104.0, 98.0, 101.0, 130.0]
    low, high = bootstrap_ci(values, seed=1)
    assert 98.0 <= low <= 101.0 <= high <= 130.0
    assert bootstrap_ci(values, seed=1) == (low, high)  # seeded
    assert bootstrap_ci([5.0]) == (5.0, 5.0)
    med, ci = ratio_summary([110.0, 121.0, 99.0], [100.0, 110.0, 90.0])
    assert med == pytest.approx(1.1) and ci == (pytest.approx(1.1), pytest.approx(1.1))


def test_arm_check_finds_the_first_difference():
    from cluster.bench.arms import Arm

    arm = Arm("vllm-nospec", "vllm-nospec", 0, 2)
    arm.check([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]])
    assert arm.identical and arm.first_difference is None
    arm.check([[1, 9, 3], [4, 5, 6, 7]], [[1, 2, 3], [4, 5, 6]])  # a different token, then a longer output
    assert not arm.identical and arm.differing == 2 and arm.first_difference == 1


def test_a_refilled_wave_decodes_at_most_b_sequences_at_once(sharegpt_prompts):
    """bench.refill: a wave of more prompts than its batch size decodes at most b at once, admits
    the next as one finishes, still emits the target-only greedy tokens, and leaves the engine's
    own cap as it was."""
    from cluster.bench.arms import Arm
    from cluster.bench.offline import EngineArms
    from tests.conftest import local_engine

    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=3"))
    try:
        ours = EngineArms(engine)
        prompts = sharegpt_prompts[:5]
        reference = ours.run_wave(Arm("reference", "nospec", 0, 5), prompts, [], 10).token_ids
        running, step = [], engine.step

        def counted():
            out = step()
            running.append(len(engine.scheduler.running))
            return out

        engine.step = counted
        got = ours.run_wave(Arm("static-3@b2", "static", 3, 2), prompts, [], 10)
        assert got.token_ids == reference
        assert max(running) == 2 and running.count(2) > len(running) // 2  # refilled as sequences finished
        assert engine.scheduler.max_num_seqs == engine.cfg.engine.max_num_seqs
    finally:
        engine.shutdown()
