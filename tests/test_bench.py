"""A small bench run: every arm, our own and the Hugging Face peers, reproduces the
target-only greedy reference, and the outputs are written."""
from __future__ import annotations

import json

from cluster.bench import run_bench
from tests.conftest import tiny_config


def test_bench_smoke(ray_session, tmp_path):
    cfg = tiny_config("parallel.tp_size=1", "speculative.num_speculative_tokens=3",
                      "speculative.adaptive.enabled=true", "speculative.adaptive.profile_on_start=false",
                      "bench.num_prompts=4", "bench.output_len=12", "bench.batch_sizes=[2]", "bench.ks=[3]",
                      "bench.hf_prompts=2", "bench.hf_tune=false")
    result = run_bench(cfg, tmp_path)
    assert result["outputs_identical"]
    names = [a["name"] for a in result["arms"]]
    assert names == ["nospec", "static-3", "adaptive-3", "oracle-3", "hf-target", "hf-assisted"]
    for arm in result["arms"]:
        assert arm["tok_per_s"] > 0 and arm["outputs_identical"]
    oracle = next(a for a in result["arms"] if a["policy"] == "oracle")
    assert oracle["acceptance_rate"] == 1.0  # the oracle verifies exactly what will be accepted
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["outputs_identical"] and (tmp_path / "bench.md").read_text().startswith("| arm")
    assert (tmp_path / "bench.png").stat().st_size > 10_000
