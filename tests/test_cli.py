"""`adaspec generate` on the embedded default, as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def _adaspec(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, "-m", "cluster.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_json_on_embedded_default():
    temp = tempfile.mkdtemp(prefix="adaspec-cli-", dir="/tmp")  # short: Ray's socket paths have a length limit
    run = _adaspec("generate", "--config", "yamls/tiny.yaml", "--set", "parallel.num_cpus_per_worker=0.5",
                   "--set", f"cluster.temp_dir={temp}", "--prompt", "How do I bake bread?",
                   "--prompt", "Write a poem about the sea", "--max-tokens", "12", "--ignore-eos", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["tp_size"] == 2 and len(out["outputs"]) == 2
    for o in out["outputs"]:
        assert set(o) == {"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason", "seed", "steps",
                          "drafted", "verified", "accepted"}
        assert isinstance(o["seed"], int)  # drawn for the request, reported so it can be reproduced
        assert len(o["token_ids"]) == 12 and o["finish_reason"] == "length" and o["text"]
        assert 0 <= o["accepted"] <= o["verified"] <= o["drafted"]


def test_generate_bad_config_is_one_line():
    run = _adaspec("generate", "--set", "speculative.method=eagle", "--prompt", "x")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "adaspec: error: speculative.method='eagle' is not one of: mtp, draft_model"]


def test_generate_json_at_tp16_is_one_object_whatever_ray_prints():
    """16 ranks on 2 cores make Ray warn on the driver's stdout ("(raylet) WARNING: ... worker
    processes have been started"); --json output must still be exactly one JSON object."""
    temp = tempfile.mkdtemp(prefix="adaspec-cli-", dir="/tmp")
    run = _adaspec("generate", "--config", "yamls/tp16.yaml", "--set", f"cluster.temp_dir={temp}",
                   "--set", "cache.kv_tokens=4096", "--set", "model.max_model_len=256",
                   "--prompt", "Hi", "--max-tokens", "4", "--ignore-eos", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)  # the whole of stdout, nothing before or after the object
    assert out["tp_size"] == 16 and len(out["outputs"][0]["token_ids"]) == 4


def test_stdout_to_stderr_keeps_stdout_for_the_result(capfd):
    from cluster.entrypoints.common import stdout_to_stderr

    with stdout_to_stderr() as out:
        print("from python")
        os.write(1, b"from the file descriptor\n")
        subprocess.run(["echo", "from a child process"], check=True)
        out.write("RESULT\n")
    captured = capfd.readouterr()
    assert captured.out == "RESULT\n"
    assert "from python" in captured.err and "from the file descriptor" in captured.err
    assert "from a child process" in captured.err
