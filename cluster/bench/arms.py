"""Benchmark arms and their rounds: what each arm measured, and its summary in bench.json."""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.bench.stats import bootstrap_ci, median

ENGINE_COUNTERS = ("steps", "seq_steps", "drafted", "verified", "accepted", "draft_ms", "validate_ms",
                   "control_ms", "dispatch_ms")
OUR_POLICIES = ("nospec", "static", "adaptive", "oracle")


@dataclass
class WaveResult:
    """One wave of prompts run to completion by one arm."""

    token_ids: list[list[int]]
    wall_s: float
    decode_seq_ms: float | None = None  # summed over sequences: time spent in decode steps (None: unknown)
    decode_tokens: int = 0  # tokens those decode steps emitted
    counters: dict | None = None  # engine counters (ENGINE_COUNTERS), our arms only


@dataclass
class Round:
    wall_s: float = 0.0
    output_tokens: int = 0
    decode_seq_ms: float | None = 0.0
    decode_tokens: int = 0

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / max(self.wall_s, 1e-9)

    @property
    def decode_tpot_ms(self) -> float | None:
        if self.decode_seq_ms is None or not self.decode_tokens:
            return None
        return self.decode_seq_ms / self.decode_tokens


@dataclass
class Arm:
    name: str
    policy: str  # nospec | static | adaptive | oracle | hf-target | hf-assisted | vllm-nospec | vllm-draft
    k: int
    batch: int
    control: bool = False  # nospec measured a second time: its ratio to nospec must show no difference
    rounds: list[Round] = field(default_factory=list)
    counters: dict = field(default_factory=lambda: dict.fromkeys(ENGINE_COUNTERS, 0))
    outputs: int = 0
    identical: bool = True
    differing: int = 0  # outputs that differ from the reference
    first_difference: int | None = None  # earliest position at which any output differs
    note: str = ""

    @property
    def ours(self) -> bool:
        return self.policy in OUR_POLICIES

    def check(self, got: list[list[int]], refs: list[list[int]]) -> None:
        """Compare a wave's outputs with the target-only greedy reference."""
        for g, r in zip(got, refs):
            if g == r:
                continue
            self.identical = False
            self.differing += 1
            pos = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
            self.first_difference = pos if self.first_difference is None else min(self.first_difference, pos)

    def record(self, wave: WaveResult) -> None:
        """Add a measured wave to the current round."""
        r = self.rounds[-1]
        r.wall_s += wave.wall_s
        r.output_tokens += sum(len(t) for t in wave.token_ids)
        if wave.decode_seq_ms is None or r.decode_seq_ms is None:
            r.decode_seq_ms = None
        else:
            r.decode_seq_ms += wave.decode_seq_ms
        r.decode_tokens += wave.decode_tokens
        self.outputs += len(wave.token_ids)
        for key, value in (wave.counters or {}).items():
            self.counters[key] += value

    def tok_per_s_rounds(self) -> list[float]:
        return [r.tok_per_s for r in self.rounds]

    def median_tok_per_s(self) -> float:
        return median(self.tok_per_s_rounds())

    def summary(self, seed: int = 0) -> dict:
        c, per_step = self.counters, max(self.counters["steps"], 1)
        seq_steps = c["seq_steps"]
        tokens = sum(r.output_tokens for r in self.rounds)
        tpots = [r.decode_tpot_ms for r in self.rounds]
        out = {"name": self.name, "policy": self.policy, "k": self.k, "batch": self.batch,
               "tok_per_s": round(self.median_tok_per_s(), 2),
               "tok_per_s_ci": [round(v, 2) for v in bootstrap_ci(self.tok_per_s_rounds(), seed)],
               "rounds": [round(v, 2) for v in self.tok_per_s_rounds()],
               "decode_tpot_ms": None if None in tpots else round(median(tpots), 4),
               "output_tokens": tokens, "wall_s": round(sum(r.wall_s for r in self.rounds), 3),
               "outputs_identical": self.identical, "note": self.note}
        if self.ours:
            out |= {"steps": c["steps"],
                    "acceptance_length": round((tokens - self.outputs) / seq_steps, 4) if seq_steps else 0.0,
                    "acceptance_rate": round(c["accepted"] / max(c["verified"], 1), 4),
                    "verified_per_seq_step": round(c["verified"] / max(seq_steps, 1), 4),
                    "draft_ms_per_step": round(c["draft_ms"] / per_step, 4),
                    "validate_ms_per_step": round(c["validate_ms"] / per_step, 4),
                    "control_ms_per_step": round(c["control_ms"] / per_step, 4),
                    "dispatch_ms_per_step": round(c["dispatch_ms"] / per_step, 4)}
        if not self.identical:
            out |= {"differing_outputs": self.differing, "first_difference": self.first_difference}
        return out
