"""bench-paired: each engine on its own clock (idle time jumps to the next arrival), both
stepped in alternation, their tokens compared; a small run writes its report."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cluster.bench.paired import arrivals, main, paired_round
from tests.conftest import TEST_SIZING


class _Engine:
    """Finishes every request it holds in one step, its tokens `reply(prompt)`."""

    def __init__(self, reply):
        self.reply, self.held, self.count, self.steps = reply, [], 0, 0

    def has_work(self) -> bool:
        return bool(self.held)

    def add_request(self, prompt, params) -> str:
        self.count += 1
        self.held.append((f"req-{self.count}", prompt, params.max_tokens))
        return f"req-{self.count}"

    def step(self) -> list:
        self.steps += 1
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
    runs = paired_round(engines, SPECS, rate, seed=3, second_first=False)
    last = arrivals(SPECS, rate, 3)[-1][0]
    assert last > 10.0
    for r in runs:
        assert last <= r.clock < last + 0.5
        assert r.output_tokens() == 3 * len(SPECS) and len(r.ids) == len(SPECS)
    assert engines[0].steps == engines[1].steps == len(SPECS)


def test_arms_that_emit_different_tokens_fail_the_round():
    engines = [_Engine(lambda p: p * 2), _Engine(lambda p: [p[0], p[1], 0])]
    with pytest.raises(RuntimeError, match="different tokens"):
        paired_round(engines, SPECS, float("inf"), seed=0, second_first=True)


def test_bench_paired_writes_its_report(tmp_path):
    sets = [f"--set={s}" for s in TEST_SIZING + ("parallel.tp_size=1", "speculative.adaptive.profile_on_start=false",
                                                 "bench.serve_requests=6", "bench.max_output_len=10")]
    rc = main(["--config", "yamls/tiny.yaml", *sets, "--arms", "nospec,adaptive-3", "--rates", "0.5,1.2",
               "--rounds", "2", "--warm-rates", "0.5", "--warm-rounds", "1", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "paired.json").read_text())
    assert result["arms"] == ["nospec", "adaptive-3"] and result["saturation_rps"] > 0
    assert [p["rate_fraction"] for p in result["points"]] == [0.5, 1.2]
    for p in result["points"]:
        assert len(p["ratios"]) == 2 and p["min"] <= p["median"] <= p["max"]
        assert p["interval"][0] <= p["median"] <= p["interval"][1] and all(t > 0 for t in p["tok_s"])
    assert "adaptive-3 / nospec" in (tmp_path / "paired.md").read_text()
    assert (tmp_path / "paired.png").stat().st_size > 5_000


def test_bench_paired_names_bad_arguments(capsys):
    assert main(["--arms", "nospec", "--out", "/nonexistent"]) == 2
    assert "expected two arms" in capsys.readouterr().err
    assert main(["--rates", "0.5,fast"]) == 2
    assert "--rates" in capsys.readouterr().err
