"""Shared fixtures: one embedded Ray for the whole session, the bundled tiny pair, the CPU kernels and
held-out ShareGPT prompts."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import settings  # noqa: E402

from cluster.config import Config, load_config  # noqa: E402
from cluster.engine.request import RequestParams  # noqa: E402

# CI (.ci/run) draws the same property-test examples every run, so a run's verdict is the
# code's; elsewhere every run draws new ones, and a failure found is kept in .hypothesis/
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from cluster.serving import ingress
    from workers.worker import free_port

    temp = tempfile.mkdtemp(prefix="adaspec-ray-", dir="/tmp")
    direct = ingress.ray_env(free_port(), 64)  # Serve apps answer on their own ports, as `adaspec serve`'s
    os.environ.update(direct)
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", **direct}})
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


TEST_SIZING = ("parallel.num_cpus_per_worker=0.1", "parallel.threads_per_worker=1", "cache.kv_tokens=16384",
               "model.max_model_len=512")


def tiny_config(*overrides: str) -> Config:
    """The embedded default, sized for tests: small cache, ranks sharing the cores."""
    return load_config("yamls/tiny.yaml", list(TEST_SIZING) + list(overrides))


def local_engine(cfg: Config):
    """A TP=1 engine in this process (no Ray)."""
    from cluster.engine.core import Engine
    from cluster.engine.executor import LocalWorkerGroup

    return Engine(cfg, workers=LocalWorkerGroup(cfg.model, cfg.speculative, cfg.parallel, cfg.cache))


def greedy(max_tokens: int) -> RequestParams:
    return RequestParams(max_tokens=max_tokens, ignore_eos=True)


def teach(policy, rate: float, k: int, times: int = 600) -> None:
    """`times` validation outcomes observed by a SpecPolicy: k drafts verified, each position
    accepted at `rate` (conditional)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(times):
        accepted = 0
        while accepted < k and rng.random() < rate:
            accepted += 1
        policy.observe(np.full((1, k), 0.5), np.full((1, k), 0.2), np.array([k]), np.array([accepted]))


def token_ids(results) -> list[list[int]]:
    return [samples[0].token_ids for samples in results]


@pytest.fixture(scope="session")
def ops():
    """The CPU kernels' module (models/kernels.py), or a skip where they cannot be built."""
    from models import kernels

    ops = kernels.cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels could not be built here")
    return ops


@pytest.fixture(scope="session")
def sharegpt_prompts():
    """8 held-out ShareGPT first turns of mixed length (cut to 4..60 tokens)."""
    from cluster.engine.core import load_tokenizer
    from models.config import ModelConfig
    from cluster.bench.sharegpt import heldout_prompts

    tok = load_tokenizer(ModelConfig().target)
    out = []
    for i, text in enumerate(heldout_prompts(seed=0)):
        ids = tok(text)["input_ids"]
        want = (4, 9, 60, 23, 15, 41, 6, 33)[len(out)]
        if len(ids) >= want:
            out.append(ids[:want])
        if len(out) == 8:
            return out
    raise AssertionError("not enough held-out prompts")


REFERENCE_TOKENS = 24


@pytest.fixture(scope="session")
def reference(sharegpt_prompts):
    """Target-only greedy outputs (REFERENCE_TOKENS each) of the ShareGPT prompts at TP=1."""
    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.enabled=false"))
    try:
        return token_ids(engine.generate(sharegpt_prompts, greedy(REFERENCE_TOKENS)))
    finally:
        engine.shutdown()
