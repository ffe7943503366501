"""Random YAML configs, `--set` overrides and command lines: every one is either accepted
(and then holds values of the declared types) or refused with one line that names the
key; nothing else escapes (no traceback, no stray exception type)."""
from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.entrypoints import cli
from cluster.config import Config, ConfigError, load_config

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def _keys(cls=Config, prefix="") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        out += _keys(hint, prefix + f.name + ".") if dataclasses.is_dataclass(hint) else [prefix + f.name]
    return out


KEYS = _keys()
SECTIONS = sorted({k.split(".")[0] for k in KEYS})
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=False, width=32),
                    st.text(max_size=12), st.sampled_from(["mtp", "draft_model", "cpu", "float16", "auto", "[]"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) |
                      st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
KEY_PATHS = st.one_of(st.sampled_from(KEYS), st.sampled_from(SECTIONS),
                      st.builds(lambda k, junk: f"{k}{junk}", st.sampled_from(KEYS), st.sampled_from(["x", ".x", "_"])),
                      st.text(max_size=10))


def _nest(path: str, value):
    node = value
    for part in reversed(path.split(".")):
        node = {part: node}
    return node


def _merge(a: dict, b: dict) -> dict:
    for k, v in b.items():
        a[k] = _merge(a[k], v) if isinstance(a.get(k), dict) and isinstance(v, dict) else v
    return a


def _check_accepted(cfg: Config) -> None:
    """An accepted config holds what its fields declare."""
    def walk(node, cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value, hint = getattr(node, f.name), hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(value, hint)
                continue
            allowed = tuple(typing.get_origin(t) or t for t in (typing.get_args(hint) or (hint,)))
            assert isinstance(value, allowed), (f.name, value, hint)
    walk(cfg, Config)


def _refusal_is_one_line(error: ConfigError, keys: list[str]) -> None:
    message = str(error)
    assert message and "\n" not in message, message
    parts = {p for k in keys for p in [k, *k.split(".")]}
    named = [p for p in parts if (p and p in message) or repr(p) in message]
    assert named or "YAML" in message, (message, keys)


@SETTINGS
@given(items=st.lists(st.tuples(KEY_PATHS, VALUES), max_size=4))
def test_random_yaml_files(tmp_path_factory, items):
    doc: dict = {}
    for key, value in items:
        doc = _merge(doc, _nest(key, value))
    path = tmp_path_factory.mktemp("cfg") / "random.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        _check_accepted(load_config(path))
    except ConfigError as e:
        _refusal_is_one_line(e, [k for k, _ in items])


@SETTINGS
@given(text=st.text(max_size=80))
def test_random_yaml_text(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "random.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        _check_accepted(load_config(path))
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message, message


@SETTINGS
@given(overrides=st.lists(st.one_of(st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
                                              .removesuffix("\n..."), KEY_PATHS, VALUES),
                                    st.text(max_size=20)), max_size=3))
def test_random_overrides(overrides):
    try:
        _check_accepted(load_config("yamls/tiny.yaml", overrides))
    except ConfigError as e:
        _refusal_is_one_line(e, [o.partition("=")[0].strip() for o in overrides] + overrides)


class _Started(Exception):
    """The command got past every check and would start an engine now."""


@pytest.fixture
def no_engines(monkeypatch):
    """Commands run up to the point where they would start Ray or an engine (bench-controller,
    which takes no config: up to its first measurement)."""
    from cluster.bench import controller as bench_controller
    from cluster.entrypoints import common, generate

    def stop(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(generate, "open_engine", stop)
    monkeypatch.setattr(bench_controller, "run_batch", stop)
    for name, module in cli.COMMANDS.items():
        if name not in ("generate", "bench-controller"):
            monkeypatch.setattr(module, "run", lambda args: (common.config_from_args(args), stop())[1])


FLAGS = ["--config", "--set", "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--n",
         "--stop", "--json", "--ignore-eos", "--log-level", "--out"]
ARG_VALUES = st.one_of(st.sampled_from(["yamls/tiny.yaml", "missing.yaml", "-1", "0", "2", "0.5", "nan", "Hi", "",
                                        "parallel.tp_size=1", "speculative.k=3", "parallel.tp_size=x", "WARNING"]),
                       st.text(max_size=8))


@SETTINGS
@given(command=st.sampled_from(sorted(cli.COMMANDS)), args=st.lists(st.one_of(st.sampled_from(FLAGS), ARG_VALUES),
                                                                   max_size=6))
def test_random_command_lines(no_engines, capsys, command, args):
    """argparse's own usage errors exit 2; everything else is refused with one
    `adaspec: error:` line, or reaches the point of starting an engine."""
    capsys.readouterr()  # one capture for all examples: drop what earlier ones printed
    try:
        code = cli.main([command] + args)
    except SystemExit as e:
        assert e.code == 2 or isinstance(e.code, str), e.code  # usage error, or a one-line message
        if isinstance(e.code, str):
            assert "\n" not in e.code
        return
    except _Started:
        return
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("adaspec: error:"), (code, err)
