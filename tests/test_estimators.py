"""`adaspec estimators`: acceptance estimators scored on a step trace."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.bench import estimators


def _trace(path, steps=400, seed=0):
    """A static-3 trace of an under-confident draft: it accepts with probability 0.5 + p/2."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        f.write(json.dumps({"label": "reference", "draft_steps": 0, "keep": [0], "accepted": [0],
                            "top_prob": [[]]}) + "\n")
        for _ in range(steps):
            top = rng.uniform(0.01, 0.9, (4, 3)).round(4)
            accepted = []
            for row in top:
                a = 0
                while a < 3 and rng.random() < 0.5 + row[a] / 2:
                    a += 1
                accepted.append(a)
            f.write(json.dumps({"label": "static-3/r0", "draft_steps": 3, "keep": [3] * 4, "accepted": accepted,
                                "top_prob": top.tolist(), "margin": (top / 3).round(4).tolist()}) + "\n")


def test_auc_equals_pairwise_count():
    rng = np.random.default_rng(1)
    score, y = rng.integers(0, 5, 60).astype(float), (rng.random(60) < 0.4).astype(float)
    pos, neg = score[y == 1], score[y == 0]
    pairs = [(1.0 if a > b else 0.5 if a == b else 0.0) for a in pos for b in neg]
    assert estimators.auc(score, y) == pytest.approx(np.mean(pairs))


def test_scores_every_estimator_and_writes_files(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _trace(trace)
    assert estimators.main(["--trace", str(trace), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "estimators.json").read_text())["estimators"]
    assert set(result) == set(estimators.ESTIMATORS)
    for r in result.values():
        assert 0.55 < r["auc"] < 1 and r["drafts"] > 1000
    # the raw probability understates acceptance: calibration lowers its log-loss
    assert result["top_prob_logistic"]["log_loss"] < result["top_prob"]["log_loss"]
    assert result["top_prob_calibrated"]["log_loss"] < result["top_prob"]["log_loss"]
    assert "best log-loss" in (tmp_path / "out" / "estimators.md").read_text()


def test_oracle_steps_neither_teach_nor_score(tmp_path):
    """An oracle step's verified drafts were chosen by their outcome (all accepted here, at low
    top probabilities): the replay leaves them out, as the engine's calibrators do."""
    plain, mixed = tmp_path / "plain.jsonl", tmp_path / "mixed.jsonl"
    _trace(plain)
    lines = plain.read_text().splitlines()
    oracle = json.dumps({"label": "oracle-3/r0", "mode": "oracle", "draft_steps": 3, "keep": [3] * 4,
                         "accepted": [3] * 4, "top_prob": [[0.05] * 3] * 4, "margin": [[0.01] * 3] * 4})
    mixed.write_text("\n".join(x for line in lines for x in (line, oracle)) + "\n")
    assert estimators.evaluate(mixed) == estimators.evaluate(plain)


def test_a_trace_without_verified_drafts_is_refused(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _trace(trace, steps=0)
    with pytest.raises(ValueError, match="no decode step verified any draft"):
        estimators.evaluate(trace)
