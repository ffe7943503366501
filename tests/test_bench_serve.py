"""A small serving sweep against our own servers (one Ray Serve application per arm):
the JSON shape, the same greedy text from every arm, and per-arm step traces."""
from __future__ import annotations

import json

import pytest

from cluster.bench.servers import arm_overrides
from cluster.bench.serving import run_sweep
from cluster.config import ConfigError, load_config
from cluster.engine.trace import read_trace
from tests.conftest import TEST_SIZING

ARMS = ["nospec", "static-3", "adaptive-3"]
RATES = [0.5, 2.0]
REQUESTS = 4


def _stopped(pid: int, wait_s: float = 2.0) -> bool:
    """Whether the process is stopped, or stops within wait_s (a SIGSTOP takes effect when the
    process next runs: on a busy machine, a moment later)."""
    import time

    give_up = time.monotonic() + wait_s
    while True:
        stat = open(f"/proc/{pid}/stat").read()
        if stat[stat.rfind(")") + 2] in "Tt":
            return True
        if time.monotonic() > give_up:
            return False
        time.sleep(0.01)


def _watch_stops(monkeypatch) -> list[tuple[str, dict]]:
    """At every measurement (a Poisson load or closed-loop clients): its URL, and per arm of
    ours whether all its processes are stopped."""
    import cluster.bench.clients as clients
    import cluster.bench.serving as serving
    from cluster.bench.servers import OurServers

    seen, servers = [], []
    init = OurServers.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        servers.append(self)

    def watched(load):
        def run(url, *args, **kwargs):
            seen.append((url, {t.arm: all(_stopped(p, 2.0 if t.server.paused else 0.0) for p in t.server.pids)
                               for t in servers[0].targets}))
            return load(url, *args, **kwargs)
        return run

    monkeypatch.setattr(OurServers, "__init__", kept)
    monkeypatch.setattr(serving, "run_load", watched(serving.run_load))
    monkeypatch.setattr(clients, "run_clients", watched(clients.run_clients))
    return seen


def test_bench_serve_smoke(ray_session, tmp_path, monkeypatch):
    seen = _watch_stops(monkeypatch)
    overrides = list(TEST_SIZING) + [
        "parallel.tp_size=1", "speculative.adaptive.profile_on_start=false", f"bench.serve_arms={json.dumps(ARMS)}",
        f"bench.serve_rates={RATES}", f"bench.serve_requests={REQUESTS}", "bench.max_output_len=8",
        "bench.serve_clients=[2]", "bench.serve_client_rounds=2", "bench.serve_rate_rounds=2",
        "serve.stream_interval_ms=1"]  # 8 tokens take a few ms here: stream them in several chunks, so ITL exists
    cfg = load_config("yamls/tiny.yaml", overrides)
    result = run_sweep(cfg, "yamls/tiny.yaml", overrides, tmp_path, trace=str(tmp_path / "trace.jsonl"))
    assert result["arms"] == ARMS and result["requests"] == REQUESTS
    assert result["outputs_identical"] and set(result["texts_vs_base"]) == set(ARMS) | {"offline-nospec"}
    assert result["saturation"]["arm"] == "nospec" and result["saturation_rps"] > 0
    assert sorted((p["rate_fraction"], p["arm"]) for p in result["points"]) == sorted(
        (f, a) for f in RATES for a in ARMS)  # every arm at every rate
    for p in result["points"]:  # two rounds each, merged
        assert p["errors"] == 0 and p["completed"] == 2 * REQUESTS and p["output_tok_per_s"] > 0
        assert len(p["rounds"]) == 2 and p["output_tok_per_s"] == round(sum(p["rounds"]) / 2, 3)
        assert p["rate"] == round(p["rate_fraction"] * result["saturation_rps"], 4)
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert p[key]["p50"] <= p[key]["p90"] <= p[key]["p99"]
    clients = result["client_points"]  # every arm and the offline engine, two closed-loop clients
    assert sorted(p["arm"] for p in clients) == sorted(ARMS + ["offline-nospec"])
    assert all(p["clients"] == 2 and p["completed"] == 2 * REQUESTS and p["errors"] == 0 for p in clients)
    assert all(len(p["rounds"]) == 2 and p["output_tok_per_s"] == round(sum(p["rounds"]) / 2, 3) for p in clients)
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["points"] == result["points"] and "texts" not in saved["points"][0]
    report = (tmp_path / "serve.md").read_text()
    assert report.startswith("| arm") and "| offline-nospec | 2 |" in report
    assert "| adaptive-3 | 50% |" in report and "| adaptive-3 | 200% |" in report
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    # every arm of ours runs while it is measured and is stopped while the others are (after the warm-up:
    # each server its workload at once, then WARMUP_ALONE of its requests one at a time, warm_up)
    from cluster.bench.serving import WARMUP_ALONE

    urls = {arm: url for url, _ in seen for arm in ARMS if url.endswith(f"/{arm}")}
    per_server = 1 + min(WARMUP_ALONE, REQUESTS)
    warm = len(ARMS) * per_server
    assert len(seen) > warm + len(ARMS) and set(urls) == set(ARMS)
    assert [url for url, _ in seen[:warm]] == [urls[arm] for arm in ARMS for _ in range(per_server)]
    for url, stopped in seen[warm:]:
        assert not any(stopped[arm] for arm in ARMS if urls[arm] == url), url
        assert all(stopped[arm] for arm in ARMS if urls[arm] != url), (url, stopped)
    static = list(read_trace(tmp_path / "trace.static-3.jsonl"))
    assert static and {line["label"] for line in static} == {"static-3"}
    assert all(line["keep"] == [min(line["draft_steps"], s) for s in line["num_spec"]] for line in static)


def test_merge_rounds_takes_medians_and_ratios_round_by_round():
    from cluster.bench.clients import merge_rounds, round_ratio

    def point(tok, ttft, errors=0):
        lat = {"p50": ttft, "p90": 2 * ttft, "p99": 3 * ttft}
        return {"arm": "a", "clients": 1, "output_tok_per_s": tok, "request_per_s": tok / 10, "completed": 4,
                "errors": errors, "error_examples": ["boom"] if errors else [], "wall_s": 1.0, "ttft_ms": lat,
                "tpot_ms": lat, "itl_ms": {"p50": None, "p90": None, "p99": None}, "texts": ["x"]}

    merged = merge_rounds([point(100, 10), point(400, 30, errors=1), point(200, 50)])
    assert merged["output_tok_per_s"] == 200 and merged["rounds"] == [100, 400, 200]  # the median, not the mean
    assert merged["ttft_ms"] == {"p50": 30, "p90": 60, "p99": 90} and merged["itl_ms"]["p50"] is None
    assert merged["completed"] == 12 and merged["errors"] == 1 and merged["error_examples"] == ["boom"]
    assert "texts" not in merged
    ref = merge_rounds([point(50, 1), point(200, 1), point(400, 1)])
    # per round 2.0, 2.0, 0.5: the median of the round ratios, not the ratio of the medians (200 / 200)
    assert round_ratio(merged, ref) == (2.0, 0.5, 2.0)


def test_the_adaptive_table_takes_each_ratio_round_by_round_and_names_the_best_fixed_arm():
    from cluster.bench.serve_report import adaptive_table
    from cluster.bench.stats import bootstrap_ci

    def point(arm, fraction, rounds):
        return {"arm": arm, "rate_fraction": fraction, "output_tok_per_s": float(sorted(rounds)[1]),
                "rounds": rounds}

    points = [point("nospec", 0.5, [100, 200, 300]), point("static-3", 0.5, [150, 150, 600]),
              point("adaptive-7", 0.5, [110, 300, 270]), point("nospec", 1.0, [10, 10, 10]),
              point("static-3", 1.0, [8, 8, 8]), point("adaptive-7", 1.0, [9, 10, 11])]
    lines = adaptive_table(points)
    rows = {line.split(" | ")[1]: line for line in lines if line.startswith("| adaptive-7")}
    # at 50%: over nospec per round 1.1, 1.5, 0.9; over static-3 0.733, 2.0, 0.45. The best fixed arm is
    # the one with the higher median (nospec 200 against 150), not the one with the best round; last, the
    # bootstrap interval of the median over it
    low, high = bootstrap_ci([1.1, 1.5, 0.9])
    assert 0.9 <= low < 1.1 < high <= 1.5
    assert rows["50%"] == ("| adaptive-7 | 50% | 1.100 [0.900, 1.500] | 0.733 [0.450, 2.000] "
                           f"| 1.100 [0.900, 1.500] (nospec) | [{low:.3f}, {high:.3f}] |")
    assert rows["100%"].endswith("| 1.000 [0.900, 1.100] (nospec) | [{:.3f}, {:.3f}] |".format(
        *bootstrap_ci([0.9, 1.0, 1.1])))
    assert adaptive_table([p for p in points if p["arm"] != "adaptive-7"]) == []


def test_round_order_keeps_the_reference_arms_back_to_back_and_shuffles_the_rest():
    import random
    from types import SimpleNamespace

    from cluster.bench.clients import ANCHORS, round_order

    arms = ["static-3", "nospec", "adaptive-7", "vllm-draft-3", "offline-nospec", "static-7", "vllm-nospec"]
    runners = [SimpleNamespace(arm=a) for a in arms]
    rng, orders = random.Random(0), set()
    for _ in range(200):
        order = [r.arm for r in round_order(runners, rng)]
        assert sorted(order) == sorted(arms)  # every runner once
        at = sorted(order.index(a) for a in ANCHORS)
        assert at == list(range(at[0], at[0] + len(ANCHORS)))  # back to back
        orders.add(tuple(order))
    starts = {o.index(next(a for a in o if a in ANCHORS)) for o in orders}
    assert len(orders) > 100 and starts == set(range(len(arms) - len(ANCHORS) + 1))  # shuffled, placed anywhere
    # without a vLLM peer the two of ours still pair up
    two = round_order([SimpleNamespace(arm=a) for a in ("static-3", "offline-nospec", "adaptive-7", "nospec")], rng)
    names = [r.arm for r in two]
    assert abs(names.index("nospec") - names.index("offline-nospec")) == 1


def test_a_round_runs_its_requests_in_blocks_every_arm_on_each_block_in_turn(monkeypatch):
    import random
    from types import SimpleNamespace

    from cluster.bench import clients as cl
    from cluster.bench.load import RequestResult, RequestSpec
    from cluster.bench.serving import closed_loop

    specs = [RequestSpec([i], 4) for i in range(20)]
    assert [len(b) for b in cl.blocks(specs, 1)] == [10, 10]  # at least BLOCK_PER_CLIENT per client
    assert cl.blocks(specs, 2) == [specs] and cl.blocks(specs[:3], 1) == [specs[:3]]
    assert [s for b in cl.blocks(specs * 3, 1) for s in b] == specs * 3  # in order, each once
    calls = []

    def fake(target, part, clients):
        calls.append((target.arm, part[0].prompt[0]))
        return [RequestResult(sent=0.0, end=1.0, tokens=4, text=str(s.prompt)) for s in part], 0.5

    monkeypatch.setattr(cl, "client_results", fake)
    targets = [SimpleNamespace(arm=a, settle_s=0.0) for a in ("nospec", "static-3")]
    cfg = SimpleNamespace(bench=SimpleNamespace(serve_clients=[1], serve_client_rounds=2))
    points, rounds = closed_loop(cfg, None, [], targets, specs, False, random.Random(0))
    for r in range(2):  # each block by every arm, the order reversed on the next block
        first, second = calls[4 * r:4 * r + 2], calls[4 * r + 2:4 * r + 4]
        assert {c[1] for c in first} == {0} and {c[1] for c in second} == {10}
        assert [c[0] for c in second] == [c[0] for c in first][::-1]
    assert len(rounds) == 4 and all(p["completed"] == 20 and p["wall_s"] == 1.0 for p in rounds)
    assert all(p["texts"] == [str([i]) for i in range(20)] for p in rounds)  # the round's requests in order
    assert sorted(p["arm"] for p in points) == ["nospec", "static-3"] and all(p["rounds"] == [80.0, 80.0]
                                                                               for p in points)


def _fake_point(target, rate, fraction, **fields) -> dict:
    """What `serving.measure` returns for one pass, for tests that stand in for it: one request
    completed at 10 tok/s in 1 s, every latency 1 ms, unless `fields` say otherwise."""
    latency = {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    return {"arm": target.arm, "rate": rate, "rate_fraction": fraction, "completed": 1, "errors": 0,
            "error_examples": [], "output_tok_per_s": 10.0, "request_per_s": 1.0, "wall_s": 1.0,
            "ttft_ms": latency, "tpot_ms": latency, "itl_ms": latency, "texts": ["x"], **fields}


def test_a_rate_round_takes_each_arm_on_its_servers_in_turn(monkeypatch):
    """bench.serve_replicas: round j measures an arm on its server j % replicas, every arm
    once per round (a peer with one server on it every round), merged per arm with the
    server of each round."""
    import random
    from types import SimpleNamespace

    import cluster.bench.serving as serving
    from cluster.bench.servers import Target
    from cluster.bench.serving import rate_sweep

    calls = []

    def fake(target, specs, rate, seed, fraction=None, api_key=None):
        calls.append((target.arm, target.replica, fraction))
        return _fake_point(target, rate, fraction, output_tok_per_s=10.0 * (1 + target.replica))

    monkeypatch.setattr(serving, "measure", fake)
    targets = [Target(arm, f"u/{arm}/{r}", None, replica=r) for arm in ("nospec", "adaptive-7") for r in range(3)]
    targets.append(Target("vllm-nospec", "v", "m"))
    bench = SimpleNamespace(serve_rates=[0.5, 1.0], serve_rate_rounds=4, serve_min_rate_s=0.0, seed=0)
    points, every = rate_sweep(bench, targets, [], 10.0, random.Random(0))
    assert len(calls) == 2 * 4 * 3  # two rates, four rounds, three arms
    for i in range(8):  # round i % 4 of rate i // 4: every arm once, ours on server (i % 4) % 3
        got = calls[3 * i:3 * i + 3]
        assert sorted(a for a, _, _ in got) == ["adaptive-7", "nospec", "vllm-nospec"]
        assert {r for a, r, _ in got if a != "vllm-nospec"} == {(i % 4) % 3}
    assert sorted(p["arm"] for p in points) == sorted(["nospec", "adaptive-7", "vllm-nospec"] * 2)
    for p in points:
        ours = p["arm"] != "vllm-nospec"
        assert p["replicas"] == ([0, 1, 2, 0] if ours else [0, 0, 0, 0])
        assert p["rounds"] == ([10.0, 20.0, 30.0, 10.0] if ours else [10.0] * 4)
    assert len(every) == 24 and all("replica" in p for p in every)


def test_each_rate_round_has_its_own_request_order_and_arrivals_the_same_for_every_arm(monkeypatch):
    """round_schedule: within a round every arm gets the same requests in the same order at the
    same arrival seed; rounds differ (else the same request comes last in every round, and at low
    rates its lone decoding decides every round); texts come back in the workload's order."""
    import random
    from types import SimpleNamespace

    import cluster.bench.serving as serving
    from cluster.bench.servers import Target
    from cluster.bench.serving import rate_sweep

    calls = []

    def fake(target, specs, rate, seed, fraction=None, api_key=None):
        calls.append((target.arm, fraction, [s.prompt for s in specs], seed))
        return _fake_point(target, rate, fraction, completed=len(specs), texts=[f"reply to {s.prompt}" for s in specs])

    monkeypatch.setattr(serving, "measure", fake)
    specs = [SimpleNamespace(prompt=f"p{i}") for i in range(12)]
    targets = [Target(arm, f"u/{arm}", None) for arm in ("nospec", "static-3", "adaptive-7")]
    bench = SimpleNamespace(serve_rates=[0.1, 0.5], serve_rate_rounds=3, serve_min_rate_s=0.0, seed=0)
    _, every = rate_sweep(bench, targets, specs, 10.0, random.Random(0))
    rounds = [calls[3 * r:3 * r + 3] for r in range(6)]
    for got in rounds:  # one round: every arm on the same order and seed
        assert len({(tuple(order), seed) for _, _, order, seed in got}) == 1
        assert sorted(got[0][2]) == sorted(s.prompt for s in specs)
    schedules = [(tuple(got[0][2]), got[0][3]) for got in rounds]
    assert len({order for order, _ in schedules}) == 6 and len({seed for _, seed in schedules}) == 6
    assert len({order[-1] for order, _ in schedules}) > 1  # not the same request last every time
    assert all(p["texts"] == [f"reply to p{i}" for i in range(12)] for p in every)
    calls.clear()
    rate_sweep(bench, targets, specs, 10.0, random.Random(0))  # seeded: the same schedules again
    assert [(tuple(got[0][2]), got[0][3]) for got in (calls[3 * r:3 * r + 3] for r in range(6))] == schedules


def test_a_server_warms_up_on_the_workload_at_once_then_on_requests_alone(monkeypatch):
    """warm_up: every request at once (the saturation a server will see), then WARMUP_ALONE of
    them one at a time, untimed (an adaptive controller leaves its cold start where a request
    runs alone, not at batch 48)."""
    from types import SimpleNamespace

    import cluster.bench.serving as serving
    from cluster.bench.servers import Target
    from cluster.bench.serving import WARMUP_ALONE, warm_up

    calls = []
    monkeypatch.setattr(serving, "measure", lambda target, specs, rate, seed, *a, **k: calls.append(
        (target.arm, [s.prompt for s in specs], rate)))
    specs = [SimpleNamespace(prompt=f"p{i}") for i in range(12)]
    warm_up(Target("adaptive-7", "u", None), specs, 0)
    assert calls[0] == ("adaptive-7", [f"p{i}" for i in range(12)], float("inf"))
    assert calls[1:] == [("adaptive-7", [f"p{i}"], float("inf")) for i in range(WARMUP_ALONE)]
    assert WARMUP_ALONE >= 2


def test_a_rate_takes_rounds_until_every_arm_spent_serve_min_rate_s_there(monkeypatch):
    """bench.serve_min_rate_s: past bench.serve_rate_rounds, a rate takes more rounds until its
    slowest-to-fill arm has spent that long there (a round at rate 1.0 lasts 0.5 s, at 0.5
    2 s; adaptive's rounds are a little shorter than nospec's), and at most MAX_RATE_ROUNDS."""
    import random
    from types import SimpleNamespace

    import cluster.bench.serving as serving
    from cluster.bench.servers import Target
    from cluster.bench.serving import rate_sweep

    calls = []

    def fake(target, specs, rate, seed, fraction=None, api_key=None):
        calls.append((target.arm, fraction))
        wall = (1.0 / fraction) ** 2 * 0.5 * (0.9 if target.arm.startswith("adaptive") else 1.0)
        return _fake_point(target, rate, fraction, wall_s=wall)

    monkeypatch.setattr(serving, "measure", fake)
    targets = [Target(arm, f"u/{arm}", None) for arm in ("nospec", "adaptive-7")]
    bench = SimpleNamespace(serve_rates=[0.5, 1.0], serve_rate_rounds=2, serve_min_rate_s=3.0, seed=0)
    points, every = rate_sweep(bench, targets, [], 10.0, random.Random(0))
    rounds = {(p["arm"], p["rate_fraction"]): len(p["rounds"]) for p in points}
    # rate 0.5: 2 rounds give nospec 4 s, adaptive 3.6 s; rate 1.0: adaptive needs 7 rounds of 0.45 s
    assert rounds == {("nospec", 0.5): 2, ("adaptive-7", 0.5): 2, ("nospec", 1.0): 7, ("adaptive-7", 1.0): 7}
    assert len(calls) == len(every) == 2 * (2 + 7)
    monkeypatch.setattr(serving, "MAX_RATE_ROUNDS", 5)
    calls.clear()
    bench.serve_min_rate_s = 1e9
    points, _ = rate_sweep(bench, targets, [], 10.0, random.Random(0))
    assert [len(p["rounds"]) for p in points] == [5] * 4


def test_a_sweep_without_nospec_is_refused_before_any_server_starts(tmp_path):
    """The rates are fractions of nospec's saturation: without that arm the sweep has no rates."""
    cfg = load_config("yamls/tiny.yaml", ["bench.serve_arms=[static-3,adaptive-7]"])
    with pytest.raises(ConfigError, match=r"bench.serve_arms=\['static-3', 'adaptive-7'\] has no nospec"):
        run_sweep(cfg, "yamls/tiny.yaml", [], tmp_path)


def test_serve_arm_names():
    assert arm_overrides("adaptive-7")[-2:] == ["speculative.num_speculative_tokens=7",
                                                "speculative.adaptive.enabled=true"]
    try:
        arm_overrides("static")
    except ConfigError as e:
        assert "bench.serve_arms" in str(e)
    else:
        raise AssertionError("a bad arm name was accepted")
