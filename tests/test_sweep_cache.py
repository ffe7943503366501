"""The startup sweep's cache: reused only when measured under this run's identity (model
files, TP size, device, dtype, k, block size, threads, engine code); otherwise swept again,
with a log line that names what changed."""
from __future__ import annotations

import json
import logging

import pytest

from cluster.engine import sweep
from controller.catchup import SWEEP_CATCHUP
from tests.conftest import tiny_config


class StubRanks:
    """Times that follow a known law, and a count of the probes asked for."""

    actors = None

    def __init__(self):
        self.calls = 0

    def validate_ms(self, n: int, q: int, ctx: int, runs: int) -> float:
        self.calls += 1
        return 2.0 + 0.1 * n * q + 1e-4 * n * q * ctx

    def draft_ms(self, n: int, ctx: int, steps: int, runs: int, catchup: int = SWEEP_CATCHUP) -> float:
        self.calls += 1
        return 0.3 + steps * (0.5 + 0.01 * n) + 0.02 * n * (catchup - SWEEP_CATCHUP)


def _cfg(tmp_path, *overrides):
    return tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=2",
                       f"speculative.adaptive.profile_cache={tmp_path}", *overrides)


def test_identity_covers_what_the_timings_depend_on(tmp_path):
    base = sweep.identity(_cfg(tmp_path))
    for override, field in (("speculative.num_speculative_tokens=3", "k"), ("cache.block_size=32", "block_size"),
                            ("parallel.threads_per_worker=2", "threads"), ("model.dtype=bfloat16", "dtype"),
                            ("speculative.method=draft_model", "proposer"), ("engine.max_num_seqs=16", "max_num_seqs")):
        assert field in sweep.stale_fields({"identity": base}, sweep.identity(_cfg(tmp_path, override))), field
    assert set(base) >= {"target", "proposer", "tp_size", "device", "dtype", "k", "block_size", "threads",
                         "max_num_seqs", "code"}
    assert base["device"] and len(base["code"]) == 16


def test_a_matching_cache_is_reused_and_a_stale_one_swept_again(tmp_path, caplog):
    ranks = StubRanks()
    model, samples = sweep.load_or_sweep(ranks, _cfg(tmp_path), progress=False)
    swept = ranks.calls
    assert swept == len(samples) > 0 and abs(model.b1 - 0.1) < 1e-6 and abs(model.b2 - 1e-4) < 1e-9
    # the draft points time one and k positions: the first position's extra is told apart from the rest
    assert abs(model.first_ms(16) - 0.3) < 0.02 and abs(model.draft_step_ms(16) - 0.66) < 0.02
    # ... and the long catch-up points (one row, as a stand-down probe's) price a catch-up token from the start
    assert sorted(s.catchup_tokens for s in samples if s.catchup_tokens > SWEEP_CATCHUP * s.num_seqs) == \
        list(sweep.SWEEP_LONG_CATCHUP)
    assert model.catchup_ms == pytest.approx(0.02, rel=1e-6)
    again, _ = sweep.load_or_sweep(ranks, _cfg(tmp_path), progress=False)
    assert ranks.calls == swept and again == model  # reused: no probe ran
    with caplog.at_level(logging.WARNING, logger="adaspec.sweep"):
        sweep.load_or_sweep(ranks, _cfg(tmp_path, "speculative.num_speculative_tokens=3"), progress=False)
    assert ranks.calls > swept and "another k" in caplog.text
    path = sweep.cache_path(_cfg(tmp_path))
    data = json.loads(path.read_text())
    data["identity"]["code"] = "0" * 16  # the engine's code changed since it was measured
    path.write_text(json.dumps(data))
    calls = ranks.calls
    with caplog.at_level(logging.WARNING, logger="adaspec.sweep"):
        sweep.load_or_sweep(ranks, _cfg(tmp_path, "speculative.num_speculative_tokens=3"), progress=False)
    assert ranks.calls > calls and "another code" in caplog.text


def test_the_grid_reaches_the_largest_batch():
    assert sweep.grid_seqs(64) == [1, 4, 16, 64]
    assert sweep.grid_seqs(32) == [1, 4, 16, 32]
    assert sweep.grid_seqs(256) == [1, 4, 16, 64, 256] and sweep.grid_seqs(1) == [1]
