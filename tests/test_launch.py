"""Ray the way users run it: TP ranks spread over a (simulated) two-node cluster, a job
submitted to a `ray start` head, `adaspec launch` up and down, and the cluster files.

    python -m pytest -q tests/test_launch.py

Each Ray here runs in its own process tree, apart from the session-wide `ray_session`.
"""
from __future__ import annotations

import importlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from tests.conftest import greedy, local_engine, tiny_config

PROMPTS = ["How do I bake bread?", "Hi"]
MAX_TOKENS = 8
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PATH=path, PYTHONPATH=str(ROOT))


def ray_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], capture_output=True, text=True,
                          timeout=timeout, env=env(), cwd=ROOT)


def tp1_tokens() -> list[list[int]]:
    engine = local_engine(tiny_config("parallel.tp_size=1"))
    try:
        return [samples[0].token_ids for samples in engine.generate(PROMPTS, greedy(MAX_TOKENS))]
    finally:
        engine.shutdown()


def two_node_run() -> None:
    """(subprocess) TP=4, SPREAD, on a two-node simulated cluster: prints nodes used and tokens."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    from cluster.engine.core import Engine

    temp = tempfile.mkdtemp(prefix="adaspec-2n-", dir="/tmp")
    # Cluster writes the head's address under Ray's default temp dir whatever temp_dir says; on a
    # machine where no Ray has run yet that directory does not exist
    from ray._common.utils import get_ray_address_file

    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 2, "temp_dir": temp, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    engine = Engine(tiny_config("parallel.tp_size=4", "parallel.placement_strategy=SPREAD",
                                "parallel.num_cpus_per_worker=1"))
    try:
        nodes = set(placement_group_table(engine.workers.pg)["bundles_to_node_id"].values())
        tokens = [samples[0].token_ids for samples in engine.generate(PROMPTS, greedy(MAX_TOKENS))]
        print(json.dumps({"nodes": len(nodes), "tokens": tokens}))
    finally:
        engine.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_tp4_spread_over_two_nodes_matches_tp1():
    run = subprocess.run([sys.executable, "-c", "from tests.test_launch import two_node_run; two_node_run()"],
                         capture_output=True, text=True, timeout=600, env=env(), cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["nodes"] == 2  # 4 ranks of 1 CPU on two 2-CPU nodes
    assert out["tokens"] == tp1_tokens()


def start_head(dashboard_port: int, temp: str) -> subprocess.Popen:
    """`ray start --head --block` in its own process group: stopping it stops only this cluster
    (`ray stop` would stop every Ray on the machine, the session-wide one included)."""
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             f"--port={free_port()}", "--num-cpus=4", "--include-dashboard=true",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
                             "--node-ip-address=127.0.0.1", f"--ray-client-server-port={free_port()}",
                             f"--dashboard-agent-listen-port={free_port()}", f"--temp-dir={temp}",
                             "--disable-usage-stats"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), cwd=ROOT, start_new_session=True)
    read_until(head, "block forever", timeout=180)
    return head


def stop_head(head: subprocess.Popen) -> None:
    head.send_signal(signal.SIGTERM)  # --block tears down the processes it started
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def test_ray_job_submit_generate():
    dashboard, temp = free_port(), tempfile.mkdtemp(prefix="adaspec-job-", dir="/tmp")
    head = start_head(dashboard, temp)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        for _ in range(30):  # the head's job agent may start a little after the head says it is up
            submit = ray_cli("job", "submit", "--address", address, "--working-dir", ".", "--no-wait", "--",
                             "python", "-m", "cluster.entrypoints.generate", "--config", "yamls/tiny.yaml", "--set",
                             "parallel.tp_size=1", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens",
                             str(MAX_TOKENS), "--ignore-eos", "--json")
            if submit.returncode == 0 or "No available agent" not in submit.stderr:
                break
            time.sleep(2)
        assert submit.returncode == 0, submit.stderr[-3000:]
        job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
        status, logs = wait_for_job(address, job_id)
        assert status == "SUCCEEDED", logs[-3000:]
        out = json.loads([line for line in logs.splitlines() if line.startswith('{"tp_size"')][-1])
        assert out["tp_size"] == 1
        assert [o["token_ids"] for o in out["outputs"]] == tp1_tokens()
    finally:
        stop_head(head)
        shutil.rmtree(temp, ignore_errors=True)


def wait_for_job(address: str, job_id: str, timeout: float = 300) -> tuple[str, str]:
    """The job's final status and its logs."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    deadline = time.monotonic() + timeout
    status = client.get_job_status(job_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(2)
        status = client.get_job_status(job_id)
    return ("TIMEOUT" if status in (JobStatus.PENDING, JobStatus.RUNNING) else str(status)), \
        client.get_job_logs(job_id)


def test_launch_serves_and_stops_on_sigint():
    port, temp = free_port(), tempfile.mkdtemp(prefix="adaspec-launch-", dir="/tmp")
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.entrypoints.cli", "launch", "yamls/tiny.yaml", "--set",
                                 "parallel.tp_size=1", "--set", f"cluster.temp_dir={temp}", "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=errors, text=True, env=env(), cwd=ROOT)
        try:
            lines = read_until(proc, "Ctrl-C", timeout=300)
            # TP=1 with the default executor: the rank runs inside the serving replica
            assert any("TP=1: the rank runs in the serving replica's process" in line for line in lines), lines
            assert any(f"http://127.0.0.1:{port}/v1/completions" in line for line in lines), lines
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
                assert json.load(r)["data"][0]["id"] == "adaspec-tiny"
            body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert json.load(r)["usage"]["completion_tokens"] == 4
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 0
        except BaseException:
            errors.seek(0)
            print(errors.read()[-5000:], file=sys.stderr)
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(temp, ignore_errors=True)


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """Lines of proc's stdout up to the one holding marker (read by a thread, so the wait is bounded)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError(f"exited with {proc.wait()} before printing {marker!r}: {seen}")
        seen.append(line.rstrip("\n"))
        if marker in line:
            return seen
    raise AssertionError(f"no {marker!r} within {timeout}s: {seen}")


def test_cluster_files_parse_and_point_at_real_things():
    from ray.autoscaler._private.util import prepare_config, validate_config
    from ray.serve.schema import ServeDeploySchema

    cluster = yaml.safe_load((ROOT / "yamls/ray-cluster.yaml").read_text())
    validate_config(prepare_config(cluster))
    assert cluster["provider"]["type"] == "local"
    assert any("pip install" in c for c in cluster["setup_commands"])
    assert any("ray start --head" in c for c in cluster["head_start_ray_commands"])
    assert any("ray start --address" in c for c in cluster["worker_start_ray_commands"])

    service = yaml.safe_load((ROOT / "yamls/rayservice.yaml").read_text())
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    serve_configs = [yaml.safe_load(service["spec"]["serveConfigV2"]),
                     yaml.safe_load((ROOT / "yamls/serve.yaml").read_text())]
    assert serve_configs[1]["http_options"]["host"] == "127.0.0.1"
    for config in serve_configs:
        for app in ServeDeploySchema.model_validate(config).applications:
            module, _, attr = app.import_path.partition(":")
            assert callable(getattr(importlib.import_module(module), attr))
            assert (ROOT / app.args["config"]).is_file()
