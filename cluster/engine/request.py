"""Requests, their sequences, and what the Engine reports back."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from cluster.engine.detokenizer import IncrementalText
from workers.plan import SamplingParams


class RequestError(ValueError):
    """A request is malformed; the message says why, `param` names the field (None when
    it is about the request as a whole)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFullError(RequestError):
    """The waiting queue is at engine.max_waiting: retry later (HTTP 429)."""

    retry_after_s = 1


MAX_STOP, MAX_STOP_CHARS = 16, 256  # stop strings per request, characters per stop string


@dataclass(frozen=True)
class RequestParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k!r}", "top_k")
        if not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n must be a positive integer, got {self.n!r}", "n")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each",
                               "stop")


class Status(enum.Enum):
    WAITING = "waiting"  # queued, nothing computed (or preempted: recomputed from scratch)
    RUNNING = "running"  # prefilling or decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    sample_index: int
    prompt_ids: list[int]
    params: RequestParams
    sampling: SamplingParams
    seed: int | None = None  # the request's seed (drawn for it when it gave none)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_prefilled: int = 0  # tokens of prefill_ids already sent for prefill
    prefill_len: int = 0  # len(prefill_ids) when last admitted
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    detok: IncrementalText = field(default_factory=IncrementalText)  # the decoded output so far
    steps: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    oracle_ids: list[int] | None = None  # benchmark oracle: the target-only reference output
    forks: list["Sequence"] = field(default_factory=list)  # samples 1..n-1, forked when this one's prefill ends
    arrival: float = field(default_factory=time.monotonic)
    queued_step: int = 0  # the scheduler step it was queued at (its prefill order: cluster/engine/scheduler.py)
    first_token_time: float | None = None

    @property
    def prefill_ids(self) -> list[int]:
        """What a (re)prefill must compute: the prompt, plus all outputs but the last when
        recomputing after a preemption (the last output is the pending decode input)."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(kw_only=True)
class RequestOutput:
    """A sample's state after a step: its tokens so far, and those new since the last update."""

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int]
    seed: int | None = None  # the request's seed, so a sampled output can be reproduced
    steps: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    ttft_s: float = 0.0  # arrival to first token
    tpot_ms: float = 0.0  # mean time per output token after the first


def coalesce(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two updates of one sample as one: the later state, with the new tokens of both."""
    return replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids)
