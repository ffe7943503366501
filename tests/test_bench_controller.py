"""`adaspec bench-controller` (cluster/bench/controller.py): the controller timed alone."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.bench import controller as bench_controller


def test_each_step_is_timed_in_its_parts_and_drafts_as_the_policy_decides(ops):
    """Every measured step's total is the sum of its parts, and the steps draft (a time model
    where drafting pays) at most k positions, fewer where the early stop stops them."""
    got = bench_controller.run_batch(40, 5, 60, stream_mb=0.1, compiled=ops)
    times, drafts = got["times"], got["drafts"]
    assert len(drafts) == 40 and all(len(v) == 40 for v in times.values())
    parts = sum(times[p] for p in bench_controller.PARTS[:-1])
    assert np.allclose(times["total"], parts, rtol=0, atol=1e-9)
    assert drafts.max() <= 5 and drafts.mean() > 1 and (drafts < 5).any()
    assert (times["early_stop"][drafts > 0] > 0).all() and (times["keep"][drafts > 0] > 0).all()


def test_the_command_writes_its_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "ctl"
    args = bench_controller.build_parser().parse_args(["--batch-sizes", "1,16", "--k", "3", "--steps", "30",
                                                       "--stream-mb", "0", "--python", "--out", str(out)])
    assert bench_controller.run(args) == 0
    result = json.loads((out / "controller.json").read_text())
    assert [r["batch"] for r in result["batches"]] == [1, 16] and result["compiled"] is False
    assert all(r["steps"] == 20 and r["total"]["mean_ms"] > 0 for r in result["batches"])
    table = (out / "controller.md").read_text()
    assert "| 16 |" in table and table in capsys.readouterr().out
    assert (out / "controller.png").stat().st_size > 1000


@pytest.mark.parametrize("flag, value", [("--batch-sizes", "1,x"), ("--batch-sizes", "0"), ("--steps", "2")])
def test_bad_arguments_are_named(tmp_path, flag, value):
    args = bench_controller.build_parser().parse_args([flag, value, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=flag):
        bench_controller.run(args)
