"""Incremental detokenization equals a full decode: multi-byte characters cut between
tokens, special tokens, any step size; stop strings that span tokens cut the text where a
full decode would."""
from __future__ import annotations

import dataclasses
import random

import pytest

from cluster.engine.core import load_tokenizer
from cluster.engine.detokenizer import Decoder, IncrementalText, find_stop
from models.config import ModelConfig
from tests.conftest import greedy, local_engine, tiny_config

TEXTS = ("naïve café — 日本語のテキスト 🎉🚀 and Ελληνικά, done.",
         "emoji run 👩‍👩‍👧‍👦🏳️‍🌈 then ASCII", "plain words only, with punctuation: a, b; c!")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig().target)


def stream(decoder: Decoder, ids: list[int], sizes) -> tuple[IncrementalText, list[str]]:
    state, seen, end = IncrementalText(), [], 0
    while end < len(ids):
        end = min(end + next(sizes), len(ids))
        state.extend(decoder, ids[:end], final=end == len(ids))
        seen.append(state.text)
    return state, seen


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3, "random"])
def test_incremental_text_equals_full_decode(tok, text, step):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    sizes = iter(lambda: rng.randint(1, 4), None) if step == "random" else iter(lambda: step, None)
    state, seen = stream(Decoder(tok), ids, sizes)
    full = tok.decode(ids, skip_special_tokens=True)
    assert state.text == full
    for partial in seen:  # nothing sent early is ever taken back, and no half characters
        assert full.startswith(partial) and "\ufffd" not in partial


def test_the_texts_do_cut_characters_between_tokens(tok):
    """Guards the test above: some single tokens of these texts are partial characters."""
    ids = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_random_ids_with_special_tokens(tok):
    rng = random.Random(1)
    specials = [tok.bos_token_id, tok.eos_token_id]
    for trial in range(20):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(40)]
        sizes = iter(lambda: rng.randint(1, 5), None)
        state, _ = stream(Decoder(tok), ids, sizes)
        assert state.text == tok.decode(ids, skip_special_tokens=True), trial


def test_find_stop_sees_only_what_can_newly_match():
    text = "abc STOP def"
    assert find_stop(text, delta_len=2, stops=("STOP",)) == -1  # ended before the delta's window
    assert find_stop(text, delta_len=len(" def") + 2, stops=("STOP",)) == 4  # "OP" is in the delta
    assert find_stop("xx--yy--", delta_len=3, stops=("--", "y--")) == 5  # the earliest of several
    assert find_stop("", delta_len=0, stops=("a",)) == -1


def test_engine_stops_on_a_string_that_spans_tokens(tok):
    engine = local_engine(tiny_config("parallel.tp_size=1", "speculative.enabled=false"))
    try:
        prompt = tok("Tell me about the history of Rome.")["input_ids"]
        ref = engine.generate([prompt], greedy(40))[0][0]
        assert ref.text == tok.decode(ref.token_ids, skip_special_tokens=True)
        stop, cut_after = spanning_stop(tok, ref.token_ids, ref.text)
        out = engine.generate([prompt], dataclasses.replace(greedy(40), stop=(stop, "never appears")))[0][0]
        assert out.text == ref.text[:ref.text.find(stop)]
        assert out.finish_reason == "stop" and len(out.token_ids) == cut_after + 1
    finally:
        engine.shutdown()


def spanning_stop(tok, ids: list[int], text: str) -> tuple[str, int]:
    """Four characters across a token boundary (two from each side), first seen there; and
    the index of the token that completes them."""
    for i in range(4, len(ids) - 1):
        edge = len(tok.decode(ids[:i], skip_special_tokens=True))
        stop = text[edge - 2:edge + 2]
        if len(stop) == 4 and text.find(stop) == edge - 2 and len(tok.decode(ids[:i + 1])) >= edge + 2:
            return stop, i
    raise AssertionError("no token boundary to put a stop string across")
