"""Incremental detokenization: each step decodes only a sequence's new tokens plus a short
look-back, not its whole output (as vLLM's detokenizer does).

Two offsets walk along the output ids: text decoded from `ids[prefix:read]` was already
emitted, and the delta is what `ids[prefix:]` decodes to beyond it. Decoding with the
look-back keeps what a tokenizer does at a word start (a sentencepiece space, a byte-level
prefix) the same as in a full decode, and a delta that ends in U+FFFD (a multi-byte
character cut between tokens) waits for the next token. On finishing, what is left is
flushed as a full decode would show it, so the final text equals
`tokenizer.decode(output_ids, skip_special_tokens=True)`.

Stop strings are searched only where they can newly occur: in the delta and the
`len(stop) - 1` characters before it.
"""
from __future__ import annotations

from dataclasses import dataclass


class Decoder:
    """Wraps a Hugging Face tokenizer; uses its Rust backend directly where it has one
    (the Python wrapper's decode costs several times more per call)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        # the backend skips the wrapper's space clean-up: only take it when that is off
        self._fast = backend.decode if backend is not None and not cleanup else None

    def __call__(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class IncrementalText:
    """The decoded output of one sequence, extended a few tokens at a time."""

    text: str = ""
    prefix: int = 0  # ids[prefix:read] is the last stretch that decoded to whole characters
    read: int = 0

    def extend(self, decode: Decoder, ids: list[int], final: bool = False) -> str:
        """Brings `text` up to `ids` (the whole output so far); returns the new text.
        `final` flushes an incomplete trailing character as a full decode shows it."""
        if self.read >= len(ids):
            return ""
        prefix_text = decode(ids[self.prefix:self.read]) if self.read > self.prefix else ""
        new_text = decode(ids[self.prefix:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""  # nothing whole yet (a multi-byte character waits for its next byte)
        delta = new_text[len(prefix_text):]
        self.text += delta
        self.prefix, self.read = self.read, len(ids)
        return delta


def find_stop(text: str, delta_len: int, stops: tuple[str, ...]) -> int:
    """The earliest index in `text` where a stop string starts, searching only positions
    that overlap the last `delta_len` characters; -1 if none."""
    best = -1
    for s in stops:
        start = max(len(text) - delta_len - len(s) + 1, 0)
        cut = text.find(s, start)
        if cut >= 0 and (best < 0 or cut < best):
            best = cut
    return best
