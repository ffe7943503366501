"""bench-paired: each engine on its own clock (idle time jumps to the next arrival), all
stepped in turn, their tokens compared, one copy of the weights; a small run writes its report."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from cluster.bench.paired import (arrivals, comparisons, group_engines, groups, main, paired_round, rate_point,
                                  share_engine_weights, sweep)
from models.kernels import PACK_OWNER
from tests.conftest import TEST_SIZING, greedy, local_engine, tiny_config


class _Engine:
    """Finishes every request it holds in one step, its tokens `reply(prompt)`."""

    def __init__(self, reply, log: list | None = None, drafts: bool = False):
        self.reply, self.held, self.count, self.steps, self.log = reply, [], 0, 0, log
        self.idles, self.drafts = 0, drafts
        self.stats = SimpleNamespace(decode_steps=0, zero_budget_steps=0, draft_ms=0.0)  # EngineStats' counters

    def has_work(self) -> bool:
        return bool(self.held)

    def idle(self) -> None:
        self.idles += 1

    def add_request(self, prompt, params) -> str:
        self.count += 1
        self.held.append((f"req-{self.count}", prompt, params.max_tokens))
        return f"req-{self.count}"

    def step(self) -> list:
        self.steps += 1
        self.stats.decode_steps += 1
        if self.drafts:
            self.stats.draft_ms += 0.5
        else:
            self.stats.zero_budget_steps += 1
        if self.log is not None:
            self.log.append(self)
        out = [SimpleNamespace(request_id=r, finished=True, token_ids=self.reply(p)[:m]) for r, p, m in self.held]
        self.held = []
        return out


SPECS = [SimpleNamespace(prompt=[i, i + 1], max_tokens=3) for i in range(6)]


def test_an_idle_engine_s_clock_moves_to_the_next_arrival():
    """Requests seconds apart, each done in one step of microseconds: each engine's clock ends
    at the last arrival (plus its steps), not at the wall time the round took; both get every
    request, and one step each in turn."""
    engines = [_Engine(lambda p: p * 2), _Engine(lambda p: p * 2)]
    rate = 0.01  # a request every 100 s on average
    runs = paired_round(engines, SPECS, rate, seed=3)
    last = arrivals(SPECS, rate, 3)[-1][0]
    assert last > 10.0
    for r in runs:
        assert last <= r.clock < last + 0.5
        assert r.output_tokens() == 3 * len(SPECS) and len(r.ids) == len(SPECS)
    assert engines[0].steps == engines[1].steps == len(SPECS)


def test_an_engine_does_its_idle_work_in_each_gap_off_its_clock():
    """A server's loop calls Engine.idle when nothing is left to step and nothing has arrived
    (the registry's refits wait for it): each engine does so once per gap between arrivals,
    its clock not moved by it, and never where every request arrives at once."""
    class Slow(_Engine):
        def idle(self) -> None:
            super().idle()
            time.sleep(0.05)

    engines = [Slow(lambda p: p * 2), _Engine(lambda p: p * 2)]
    rate = 0.01  # a request every 100 s on average: every arrival after the first comes in a gap
    runs = paired_round(engines, SPECS, rate, seed=3)
    assert [e.idles for e in engines] == [len(SPECS)] * 2  # (the first arrival's wait is a gap too)
    assert runs[0].clock < arrivals(SPECS, rate, 3)[-1][0] + 0.04  # 0.3 s of idle work left off the clock
    at_once = [_Engine(lambda p: p * 2), _Engine(lambda p: p * 2)]
    paired_round(at_once, SPECS, float("inf"), seed=3)
    assert [e.idles for e in at_once] == [0, 0]


def test_arms_that_emit_different_tokens_fail_the_round():
    engines = [_Engine(lambda p: p * 2), _Engine(lambda p: [p[0], p[1], 0])]
    with pytest.raises(RuntimeError, match="different tokens"):
        paired_round(engines, SPECS, float("inf"), seed=0, first=1)
    three = [_Engine(lambda p: p * 2), _Engine(lambda p: p * 2), _Engine(lambda p: [p[0], p[1], 0])]
    with pytest.raises(RuntimeError, match="different tokens"):  # the third arm differs from the first two
        paired_round(three, SPECS, float("inf"), seed=0)


def test_engines_step_in_turn_from_the_round_s_first():
    log: list = []
    engines = [_Engine(lambda p: p * 2, log) for _ in range(3)]
    paired_round(engines, SPECS, 0.01, seed=1, first=1)
    assert log[:6] == [engines[1], engines[2], engines[0]] * 2
    assert [e.steps for e in engines] == [len(SPECS)] * 3


def test_every_adaptive_arm_is_compared_with_every_fixed_one_and_the_best():
    assert comparisons(["nospec", "adaptive-7"]) == [("adaptive-7", "nospec")]
    assert comparisons(["nospec", "static-3", "adaptive-7"]) == [("adaptive-7", "nospec"), ("adaptive-7", "static-3")]
    assert comparisons(["nospec", "static-3", "static-5"]) == [("static-3", "nospec"), ("static-5", "nospec")]
    arms = ["nospec", "static-3", "adaptive-3", "adaptive-7"]
    tok_s = [[100, 100, 100], [110, 90, 120], [105, 99, 118], [99, 110, 100]]
    for schedule in ("all", "pairs"):
        together = groups(arms, schedule)
        # every arm measured alike in every group: the pairs' points equal the all-together one's
        measured = {g: [tok_s[arms.index(a)] for a in g] for g in together}
        p = rate_point(arms, measured, 0.5, 2.0)
        assert p["tok_s"] == [100, 110, 105, 100]
        assert [(r["arm"], r["over"]) for r in p["ratios"]] == [(a, f) for a in arms[2:] for f in arms[:2]]
        over = {r["arm"]: r for r in p["over_best_fixed"]}
        assert over["adaptive-3"]["over"] == "static-3"  # 105/110 .. 118/120: median 0.983; over nospec 1.05
        assert over["adaptive-3"]["ratios"] == [round(105 / 110, 5), 1.1, round(118 / 120, 5)]
        assert over["adaptive-3"]["median"] == pytest.approx(118 / 120, abs=1e-5)
        # over nospec 0.99 / 1.1 / 1.0 (median 1.0), over static-3 0.9 / 1.222 / 0.833 (median 0.9)
        assert over["adaptive-7"]["over"] == "static-3" and over["adaptive-7"]["median"] == pytest.approx(0.9)
    assert groups(arms, "all") == [tuple(arms)]
    assert groups(arms, "pairs") == [("adaptive-3", "nospec"), ("adaptive-3", "static-3"), ("adaptive-7", "nospec"),
                                     ("adaptive-7", "static-3")]
    assert "over_best_fixed" not in rate_point(arms[:2], {tuple(arms[:2]): tok_s[:2]}, 0.5, 2.0)
    with pytest.raises(ValueError, match="unknown schedule 'some'"):
        groups(arms, "some")


def test_each_pair_runs_on_its_own_engines():
    """With pairs, a round runs the adaptive arm once with each fixed arm, never the fixed arms
    together, each pair on engines of its own (group_engines): the adaptive arm's engine beside
    nospec never steps beside static-3. The saturation round runs the first arm's first pair."""
    arms = ["nospec", "static-3", "adaptive-3"]
    made = []
    engines = group_engines(arms, "pairs", lambda a: made.append((a, _Engine(lambda p: p * 2, drafts=a != "nospec")))
                            or made[-1][1])
    assert list(engines) == [("adaptive-3", "nospec"), ("adaptive-3", "static-3")]
    assert [a for a, _ in made] == ["adaptive-3", "nospec", "adaptive-3", "static-3"]
    assert len({id(e) for g in engines.values() for e in g}) == 4
    result = sweep(engines, arms, SPECS, [0.5], rounds=2, warm_rates=[], warm_rounds=0, seed=0)
    # the saturation round in the first pair, then two rounds of each pair
    assert [e.count for g in engines.values() for e in g] == [3 * len(SPECS)] * 2 + [2 * len(SPECS)] * 2
    (point,) = result["points"]
    assert [(r["arm"], r["over"], len(r["ratios"])) for r in point["ratios"]] == [("adaptive-3", "nospec", 2),
                                                                                   ("adaptive-3", "static-3", 2)]
    # what each arm drafted in the measured rounds, over its engines (the saturation round left out)
    steps = {a: sum(e.steps for g, held in engines.items() for b, e in zip(g, held) if b == a) for a in arms}
    steps["nospec"] -= 1
    steps["adaptive-3"] -= 1
    assert point["drafting"] == {"nospec": {"decode_steps": steps["nospec"], "drafting_steps": 0, "draft_ms": 0.0},
                                 "static-3": {"decode_steps": steps["static-3"], "drafting_steps": steps["static-3"],
                                              "draft_ms": 0.5 * steps["static-3"]},
                                 "adaptive-3": {"decode_steps": steps["adaptive-3"],
                                                "drafting_steps": steps["adaptive-3"],
                                                "draft_ms": 0.5 * steps["adaptive-3"]}}


@pytest.mark.parametrize("stepped_first", [True, False])
def test_engines_read_one_copy_of_each_model(stepped_first):
    """The target is shared by every engine, the draft (MTP module and its head) by those that
    draft, the kernels' packed copies with them, whether the kernels had packed them before
    (engines that stepped) or pack them after (shared before any forward, as bench-paired
    shares them); the engines still emit the same tokens."""
    sizing = ("speculative.adaptive.profile_on_start=false", "parallel.tp_size=1")
    engines = [local_engine(tiny_config(*sizing, *o)) for o in
               (["speculative.enabled=false"], ["speculative.adaptive.enabled=false"], [])]
    try:
        if stepped_first:
            for e in engines:  # a step each, so the kernels have packed their weights
                e.generate([[5, 6, 7, 8]], greedy(4))
        share_engine_weights(engines)
        specs = [SimpleNamespace(prompt=[5 + i, 9, 11 + i], max_tokens=6) for i in range(4)]
        runs = paired_round(engines, specs, float("inf"), seed=0)
        assert all(r.output_tokens() == 24 for r in runs)
        mods = [e.workers.worker.runner.weight_modules() for e in engines]
        assert set(mods[0]) == {"target"} and set(mods[1]) == set(mods[2]) == {"target", "draft", "draft_head"}
        for i, role in ((1, "target"), (2, "target"), (2, "draft"), (2, "draft_head")):
            src = mods[0 if role == "target" else 1][role]
            for (name, a), b in zip(mods[i][role].state_dict(keep_vars=True).items(),
                                    src.state_dict(keep_vars=True).values()):
                assert a.data_ptr() == b.data_ptr(), f"{role}.{name}"
            # every packed copy any engine's module reads is the source module's
            held = [id(m.__dict__["_packed"][1]) for m in src.modules() if "_packed" in m.__dict__]
            assert held
            reads = []
            for m in mods[i][role].modules():
                owner = m.__dict__.get(PACK_OWNER, m)
                if "_packed" in owner.__dict__:
                    reads.append(id(owner.__dict__["_packed"][1]))
            assert sorted(reads) == sorted(held), role
    finally:
        for e in engines:
            e.shutdown()


def test_an_arm_with_other_draft_weights_shares_the_target_alone():
    """A variant whose draft streams int8 weights (speculative.draft_weights) beside one streaming
    bfloat16: both read one target, each its own draft (share_weights refuses other packed
    dtypes), and both emit the target's greedy tokens."""
    sizing = ("speculative.adaptive.profile_on_start=false", "parallel.tp_size=1", "speculative.adaptive.enabled=false")
    engines = [local_engine(tiny_config(*sizing, o)) for o in
               ("speculative.draft_weights=bfloat16", "speculative.draft_weights=int8")]
    try:
        share_engine_weights(engines)
        mods = [e.workers.worker.runner.weight_modules() for e in engines]
        first = {role: {n: t.data_ptr() for n, t in m.state_dict(keep_vars=True).items()} for role, m in mods[0].items()}
        shared = {role: all(first[role][n] == t.data_ptr() for n, t in module.state_dict(keep_vars=True).items())
                  for role, module in mods[1].items()}
        assert shared == {"target": True, "draft": False, "draft_head": True}  # (the head: the target's tensor)
        outs = [e.generate([[5, 6, 7, 8], [9, 10]], greedy(12)) for e in engines]
        assert [o[0].token_ids for o in outs[0]] == [o[0].token_ids for o in outs[1]]

        def packed(m, role):  # the dtypes of the packed copies a role's modules read
            return {o.__dict__["_packed"][1].dtype for o in (x.__dict__.get(PACK_OWNER, x) for x in m[role].modules())
                    if "_packed" in o.__dict__}
        assert [packed(m, "draft") | packed(m, "draft_head") for m in mods] == [{torch.bfloat16}, {torch.int8}]
        assert packed(mods[0], "target") == packed(mods[1], "target") == {torch.float32}
    finally:
        for e in engines:
            e.shutdown()


def test_bench_paired_writes_its_report(tmp_path):
    sets = [f"--set={s}" for s in TEST_SIZING + ("parallel.tp_size=1", "speculative.adaptive.profile_on_start=false",
                                                 "bench.serve_requests=6", "bench.max_output_len=10")]
    rc = main(["--config", "yamls/tiny.yaml", *sets, "--arms", "nospec,static-2,adaptive-3", "--rates", "0.5,1.2",
               "--rounds", "2", "--warm-rates", "0.5", "--warm-rounds", "1", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "paired.json").read_text())
    assert result["arms"] == ["nospec", "static-2", "adaptive-3"] and result["saturation_rps"] > 0
    assert result["shared_weights"] is True and result["schedule"] == "pairs"
    assert [p["rate_fraction"] for p in result["points"]] == [0.5, 1.2]
    for p in result["points"]:
        assert [(r["arm"], r["over"]) for r in p["ratios"]] == [("adaptive-3", "nospec"), ("adaptive-3", "static-2")]
        assert len(p["over_best_fixed"]) == 1 and p["over_best_fixed"][0]["over"] in ("nospec", "static-2")
        for r in p["ratios"] + p["over_best_fixed"]:
            assert len(r["ratios"]) == 2 and r["min"] <= r["median"] <= r["max"]
            assert r["interval"][0] <= r["median"] <= r["interval"][1]
        assert len(p["tok_s"]) == 3 and all(t > 0 for t in p["tok_s"])
        drafted = p["drafting"]
        assert drafted["nospec"]["drafting_steps"] == 0 and drafted["nospec"]["draft_ms"] == 0.0
        assert 0 < drafted["static-2"]["drafting_steps"] <= drafted["static-2"]["decode_steps"]
        assert drafted["static-2"]["draft_ms"] > 0
    table = (tmp_path / "paired.md").read_text()
    assert "adaptive-3 / static-2" in table and "adaptive-3 / best fixed" in table
    assert "Decode steps that drafted" in table and "0 / " in table
    assert (tmp_path / "paired.png").stat().st_size > 5_000


def test_a_variant_of_an_arm_is_the_arm_with_its_overrides_and_is_compared_with_it(tmp_path, monkeypatch):
    """adaptive-3+KEY=VALUE: adaptive-3's overrides, then the variant's, for its engine alone; with
    no fixed arm, the variant is reported over the arm itself."""
    import cluster.engine.core as core
    from cluster.bench.paired import variant_overrides
    from cluster.bench.servers import arm_overrides

    variant = "adaptive-3+speculative.adaptive.min_gain=0.25+speculative.adaptive.early_stop=false"
    assert variant_overrides(variant) == arm_overrides("adaptive-3") + ["speculative.adaptive.min_gain=0.25",
                                                                         "speculative.adaptive.early_stop=false"]
    assert variant_overrides("nospec") == arm_overrides("nospec")
    made = []
    real = core.Engine.__init__

    def record(self, cfg, *args, **kwargs):
        made.append(cfg.speculative)
        real(self, cfg, *args, **kwargs)

    monkeypatch.setattr(core.Engine, "__init__", record)
    sets = [f"--set={s}" for s in TEST_SIZING + ("parallel.tp_size=1", "speculative.adaptive.profile_on_start=false",
                                                 "bench.serve_requests=4", "bench.max_output_len=6")]
    rc = main(["--config", "yamls/tiny.yaml", *sets, "--arms", f"adaptive-3,{variant}", "--rates", "inf",
               "--rounds", "2", "--warm-rates", "", "--warm-rounds", "0", "--out", str(tmp_path)])
    assert rc == 0
    assert sorted((s.num_speculative_tokens, s.adaptive.min_gain, s.adaptive.early_stop) for s in made) == \
        [(3, 0.0, True), (3, 0.25, False)]  # (made in the pair's order: the variant first)
    result = json.loads((tmp_path / "paired.json").read_text())
    assert [(r["arm"], r["over"]) for r in result["points"][0]["ratios"]] == [(variant, "adaptive-3")]


def test_bench_paired_names_bad_arguments(capsys):
    assert main(["--arms", "nospec", "--out", "/nonexistent"]) == 2
    assert "expected two or more different arms" in capsys.readouterr().err
    assert main(["--arms", "nospec,nospec", "--out", "/nonexistent"]) == 2
    assert "expected two or more different arms" in capsys.readouterr().err
    assert main(["--rates", "0.5,fast"]) == 2
    assert "--rates" in capsys.readouterr().err
    assert main(["--arms", "nospec,adaptive-3+min_gain", "--out", "/nonexistent"]) == 2
    assert "'min_gain' is not KEY=VALUE" in capsys.readouterr().err
    assert main(["--arms", "nospec,adaptive-3+speculative.adaptive.nosuch=1", "--out", "/nonexistent"]) == 2
    assert "unknown key 'speculative.adaptive.nosuch'" in capsys.readouterr().err
    assert main(["--arms", "nospec,adaptive+speculative.adaptive.min_gain=0.1", "--out", "/nonexistent"]) == 2
    assert "'adaptive' is not nospec, static-K or adaptive-K" in capsys.readouterr().err


def test_weights_of_another_shape_are_not_shared():
    import torch
    from torch import nn

    from models.share import share_weights

    a, b = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    before = [p.data_ptr() for p in a.parameters()]
    with pytest.raises(ValueError, match=r"1\.weight differs \(\(2, 4\) torch.float32 on cpu here, \(3, 4\)"):
        share_weights(a, b)
    assert [p.data_ptr() for p in a.parameters()] == before  # checked first: nothing shared
    c = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    share_weights(a, c)
    assert [p.data_ptr() for p in a.parameters()] == [p.data_ptr() for p in c.parameters()]
    x = torch.randn(3, 4)
    assert torch.equal(a(x), c(x))
