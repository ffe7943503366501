"""Bad configuration and bad requests fail early with a message that names the problem."""
from __future__ import annotations

import pytest

from cluster.config import ConfigError, load_config
from cluster.engine.request import RequestError, RequestParams
from tests.conftest import local_engine, tiny_config


@pytest.mark.parametrize("override, words", [
    ("speculative.metod=mtp", "unknown key 'speculative.metod'"),
    ("speculative.method=eagle", "speculative.method='eagle' is not one of: mtp, draft_model"),
    ("parallel.tp_size=0", "parallel.tp_size=0 must be >= 1"),
    ("parallel.tp_size=two", "parallel.tp_size: expected int"),
    ("parallel.device=tpu", "parallel.device='tpu' is not one of"),
    ("speculative.num_speculative_tokens=0", "speculative.num_speculative_tokens=0 must be in 1..16"),
    ("speculative.adaptive.estimator=magic", "speculative.adaptive.estimator='magic'"),
    ("speculative.adaptive.min_gain=-0.1", "speculative.adaptive.min_gain=-0.1 must be a fraction >= 0"),
    ("speculative.adaptive.batch_draft_margin=.nan", "speculative.adaptive.batch_draft_margin=nan must be a fraction"),
    ("speculative.draft_weights=int4", "speculative.draft_weights='int4' is not one of: bfloat16, int8, float32"),
    ("cache=[1, 2]", "cache: expected a mapping"),
    ("cache.kv_tokens=16", "cache.kv_tokens=16 is smaller than model.max_model_len"),
    ("parallel.executor=local", "parallel.executor=local runs one rank in the driver; parallel.tp_size=2"),
    ("parallel.executor=mpi", "parallel.executor='mpi' is not one of: auto, ray, local"),
    ("bench.serve_replicas=0", "bench.serve_replicas=0 must be >= 1"),
    ("bench.serve_warmup_requests=-1", "bench.serve_warmup_requests=-1 must be a request count >= 0"),
    ("bench.serve_min_rate_s=-5", "bench.serve_min_rate_s=-5.0 must be >= 0 (seconds)"),
    ("bench.serve_min_rate_s=long", "bench.serve_min_rate_s: expected float"),
])
def test_bad_override_names_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config("yamls/tiny.yaml", [override])
    assert words in str(e.value)


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  tp_size: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(None, ["parallel.tp_size"])


def test_set_parses_yaml_values():
    cfg = load_config("yamls/tiny.yaml", ["bench.ks=[3,5]", "speculative.adaptive.enabled=true",
                                          "cluster.address=null"])
    assert cfg.bench.ks == [3, 5] and cfg.speculative.adaptive.enabled and cfg.cluster.address is None


def test_tp_size_that_does_not_divide_heads():
    from workers.worker import check_model_dirs

    cfg = tiny_config("parallel.tp_size=3")
    with pytest.raises(ValueError, match="parallel.tp_size=3 does not divide num_attention_heads=16"):
        check_model_dirs(cfg.model, cfg.speculative, 3)


def test_unknown_model_path():
    from workers.worker import check_model_dirs

    cfg = tiny_config("model.target=/nonexistent/model")
    with pytest.raises(FileNotFoundError, match="/nonexistent/model"):
        check_model_dirs(cfg.model, cfg.speculative, 1)


def test_bad_requests_are_refused_and_nothing_is_lost():
    engine = local_engine(tiny_config("parallel.tp_size=1"))
    try:
        ok = engine.add_request("Hello there", RequestParams(max_tokens=4, ignore_eos=True))
        with pytest.raises(RequestError, match="max_tokens must be a positive integer"):
            engine.add_request("Hi", RequestParams(max_tokens=-1))
        with pytest.raises(RequestError, match="more than the context length 512"):
            engine.add_request("word " * 600, RequestParams(max_tokens=4))
        with pytest.raises(RequestError, match="prompt is empty"):
            engine.add_request([], RequestParams(max_tokens=4))
        finished = []
        while engine.has_work():
            finished += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in finished] == [ok] and len(finished[0].token_ids) == 4
    finally:
        engine.shutdown()
