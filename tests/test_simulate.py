"""The simulator (cluster/sim): the trace's draft pool, replay through the real controller,
costs fitted to measured steps, the command; and its check against what this machine
measured (the committed trace, docs/traces)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cluster.sim.costs import ProfileCost
from cluster.sim.replay import SimArm, simulate, startup_model
from cluster.sim.traces import DraftPool, load_pool, measured
from controller.config import AdaptiveConfig, SpeculativeConfig
from controller.samples import StepSample

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "docs" / "traces" / "bench-adaptive.jsonl.gz"  # an earlier run of docs/bench-adaptive's benchmark


class FlatCost:
    """A forward costs `validate` ms whatever it computes; a draft step `draft` ms."""

    def __init__(self, validate: float = 1.0, draft: float = 0.25):
        self.validate, self.draft = validate, draft

    def validate_ms(self, q, kv) -> float:
        return self.validate

    def draft_ms(self, n, kv, steps=1) -> float:
        return self.draft * steps

    def other_ms(self, n, emitted) -> float:
        return 0.0

    def control_ms(self, policy, n) -> None:
        return None


def _spec(k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=k, adaptive=AdaptiveConfig(enabled=True, profile_on_start=False))


def _pool(accepted: list[int], k: int = 3, top: float = 0.9) -> DraftPool:
    n = len(accepted)
    return DraftPool(np.full((n, k), top), np.full((n, k), top / 2), np.array(accepted), np.arange(n),
                     np.ones(n, dtype=np.int64), np.full(n, 100), "synthetic")


def _run(arm: SimArm, pool: DraftPool, cost, output_len: int = 9, seqs: int = 4) -> dict:
    spec = _spec(max(arm.k, 1))
    return simulate(arm, pool, cost, spec, startup_model(cost, spec), output_len, seqs, control_time=False).summary()


def _line(mode: str, steps: int, keep: list[int], accepted: list[int], seq: list[int], label: str = "") -> str:
    n = len(keep)
    return json.dumps({"label": label, "mode": mode, "batch": n, "draft_steps": steps, "keep": keep,
                       "accepted": accepted, "seq": seq, "kv": [50] * n, "top_prob": [[0.5] * steps] * n,
                       "margin": [[0.2] * steps] * n,
                       "draft_ms": 1.0, "validate_ms": 2.0, "step_ms": 3.5, "control_ms": 0.1})


def test_pool_keeps_fully_verified_static_rows_grouped_by_sequence(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([_line("static", 3, [3, 2], [1, 2], [5, 6]),  # seq 6 verified only 2 of 3
                                _line("adaptive", 3, [3, 3], [0, 3], [7, 8]),  # a decision cut these: not used
                                _line("static", 3, [3, 3], [3, 0], [6, 5])]) + "\n")
    pool = load_pool(trace)
    assert pool.k == 3 and len(pool) == 3
    assert pool.sizes.tolist() == [2, 1]  # sequence 5: two rows, sequence 6: one
    assert pool.accepted[pool.starts[0]:pool.starts[0] + 2].tolist() == [1, 0]


def test_static_arm_equals_the_hand_count():
    """Every draft accepted: each step emits k + 1 = 4 of the 8 decode tokens, two steps of
    3 draft steps (0.25 ms) and one forward (1 ms) each."""
    got = _run(SimArm("static", 3, 1), _pool([3] * 10), FlatCost(), output_len=9, seqs=4)
    assert got["steps"] == 8 and got["acceptance_length"] == 4.0
    assert got["tok_per_s"] == pytest.approx(1e3 * 8 / (2 * 1.75), abs=0.01)  # rounded to 0.01


def test_oracle_verifies_exactly_what_is_accepted():
    got = _run(SimArm("oracle", 3, 4), _pool([0, 1, 2, 3] * 5), FlatCost(), output_len=17, seqs=8)
    assert got["acceptance_rate"] == 1.0 and got["verified_per_seq_step"] > 0.5


def test_adaptive_stands_down_where_drafting_cannot_pay():
    """A draft step costing ten forwards: adaptive verifies (nearly) nothing and runs at
    plain decoding's speed; probes are all it pays."""
    pool, cost = _pool([1, 2, 0, 3] * 5), FlatCost(draft=10.0)
    plain = _run(SimArm("nospec", 0, 1), pool, cost, output_len=64, seqs=16)
    adaptive = _run(SimArm("adaptive", 3, 1), pool, cost, output_len=64, seqs=16)
    assert adaptive["verified_per_seq_step"] < 0.05
    assert adaptive["tok_per_s"] >= 0.9 * plain["tok_per_s"]


def test_replay_decides_as_a_rank_does(monkeypatch):
    """The replay's policy takes the compiled decisions a rank's takes (kernels.controller_ops)
    and asks the early stop through the draft loop's (budget, n) buffers, as the runner does:
    steps of 2-4 sequences decide in ManyRows, and decide the same as the policy in Python."""
    from cluster.sim import replay
    from controller.step import SpecStep

    if replay.controller_ops() is None:
        pytest.skip("the compiled kernels do not load here")
    made, many_rows = [], SpecStep._many_rows

    def counted(self, top, margin):
        got = many_rows(self, top, margin)
        made.append(got is not None)
        return got

    monkeypatch.setattr(SpecStep, "_many_rows", counted)
    rng = np.random.default_rng(3)
    n, k = 40, 5
    top = rng.beta(2, 1, (n, k))
    pool = DraftPool(top, top * rng.uniform(0.3, 1, (n, k)), rng.integers(0, k + 1, n), np.arange(0, n, 4),
                     np.full(n // 4, 4), np.full(n, 100), "synthetic")
    arm, cost = SimArm("adaptive", k, 4), FlatCost(validate=1.0, draft=0.12)
    compiled = _run(arm, pool, cost, output_len=33, seqs=8)
    monkeypatch.setattr(replay, "controller_ops", lambda: None)
    assert _run(arm, pool, cost, output_len=33, seqs=8) == compiled
    assert any(made) and compiled["verified_per_seq_step"] > 0


def test_profile_cost_recovers_the_steps_it_was_fitted_on():
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(400):
        n, m = int(rng.integers(1, 33)), int(rng.integers(0, 5))
        q = n * (m + 1)
        kv = q * 300
        emitted = n + int(rng.integers(0, n * m + 1))
        steps.append(StepSample(n, q, kv, 1.0 + 0.05 * q + 1e-5 * kv, m, (0.3 + 0.02 * n) * m + 0.1 * (m > 0),
                                0.2 + 0.01 * n + 0.03 * (emitted - n), emitted))
    cost = ProfileCost.fit(steps, "synthetic")
    assert cost.validate_ms(np.full(8, 4), np.full(8, 300)) == pytest.approx(1.0 + 0.05 * 32 + 1e-5 * 32 * 300, rel=0.02)
    assert cost.draft_ms(8, np.full(8, 300), 3) == pytest.approx((0.3 + 0.16) * 3 + 0.1, rel=0.05)
    assert cost.other_ms(8, 20) == pytest.approx(0.2 + 0.08 + 0.03 * 12, rel=0.05)


def test_simulated_arms_are_within_ten_percent_of_this_machine():
    """The committed trace (bench at batch 1, 8, 32 on this machine): replayed with the
    profile fitted to its own steps, every arm's decode throughput is within 10% of what
    the trace measured."""
    cost = ProfileCost.load(TRACE)
    pool, got = load_pool(TRACE), measured(TRACE)
    spec = _spec(pool.k)
    spec.adaptive.profile_on_start = True
    start = startup_model(cost, spec)
    errors = {}
    for (name, batch), m in got.items():
        if name.endswith("-again"):
            continue
        policy, _, k = name.partition("-")
        sim = simulate(SimArm(policy, int(k or 0), batch), pool, cost, spec, start, 64, 32).summary()
        errors[f"{name}@b{batch}"] = sim["tok_per_s"] / m["decode_tok_per_s"] - 1
    assert len(errors) >= 12
    assert max(abs(e) for e in errors.values()) <= 0.10, errors


def test_command_writes_the_scenario_files(tmp_path):
    from cluster.entrypoints.simulate import main

    out = tmp_path / "sim"
    assert main(["--trace", str(TRACE), "--model", str(REPO / "yamls/models/deepseek-v3.yaml"),
                 "--hardware", str(REPO / "yamls/hardware/ascend-910b.yaml"), "--tp", "16", "--batches", "1,32",
                 "--ks", "3", "--num-seqs", "8", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["simulated"] and "deepseek" in result["cost_model"]
    assert {a["name"] for a in result["arms"]} == {f"{p}@b{b}" for b in (1, 32)
                                                   for p in ("nospec", "static-3", "adaptive-3", "oracle-3")}
    assert "| adaptive-3@b32 |" in (out / "bench.md").read_text() and (out / "bench.png").stat().st_size > 0


@pytest.mark.parametrize("args,message", [(["--ks", "9"], "drafts the trace"),
                                          (["--profile", "x.jsonl", "--model", "m.yaml"], "one or the other")])
def test_command_names_bad_input(tmp_path, capsys, args, message):
    from cluster.entrypoints.simulate import main

    assert main(["--trace", str(TRACE), "--out", str(tmp_path)] + args) != 0
    assert message in capsys.readouterr().err


def test_poisson_load_serves_every_request_at_the_offered_rate(tmp_path):
    """At a light load throughput is the offered load (requests x tokens per second) and
    speculation shows as latency: the static arm's time per output token is below plain
    decoding's (a roofline of Llama-3-8B on one H200, where a draft step is cheap)."""
    from cluster.entrypoints.simulate import main

    out = tmp_path / "load"
    assert main(["--trace", str(TRACE), "--model", str(REPO / "yamls/models/llama-3-8b.yaml"),
                 "--hardware", str(REPO / "yamls/hardware/h200.yaml"), "--poisson", "2", "--max-batch", "16",
                 "--num-seqs", "16", "--ks", "3", "--policies", "nospec,static", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["mode"] == "poisson" and len(result["arms"]) == 2
    plain, static = (next(a for a in result["arms"] if a["policy"] == p) for p in ("nospec", "static"))
    for arm in (plain, static):
        assert arm["tok_per_s"] == pytest.approx(2 * 64, rel=0.35)  # bounded by arrivals, not by the engine
        assert arm["ttft_p50_ms"] < 100
    assert static["tpot_p50_ms"] < 0.7 * plain["tpot_p50_ms"]
    assert "| static-3 | 2 |" in (out / "bench.md").read_text()
