"""What the driver sends every rank each step, and what ranks send back. Typed, never
loose dicts, so a field added on one side is seen on the other."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = whole vocabulary
    seed: int = 0  # with the sample index and position, seeds every random draw

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class ForkPlan:
    """Another sample of the same prompt, forked when its parent's prefill ends: it shares
    the parent's full prompt blocks, gets a copy of the partial last one, and samples its
    own first token from the parent's last prefill logits."""

    seq_id: int
    block_table: list[int]
    sampling: SamplingParams


@dataclass
class SeqPlan:
    seq_id: int
    block_table: list[int]  # cache blocks of this sequence, covering every position it may write
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefill: list[int] | None = None  # prefill step: the next chunk of prompt tokens
    prefill_start: int = 0  # position of prefill[0]; 0 starts (or restarts) the sequence
    prefill_last: bool = False  # the chunk ends the prompt: sample the first output token
    next_token: int | None = None  # with prefill_last, a recompute: this token follows (no sampling)
    forks: list[ForkPlan] = field(default_factory=list)  # with prefill_last: samples 1..n-1 of the prompt
    num_spec: int = 0  # decode step: draft tokens this sequence may propose
    left: int | None = None  # decode step: tokens it may still emit (None: not known)
    oracle: list[int] | None = None  # oracle mode: the reference tokens that follow (benchmark only)


@dataclass
class StepPlan:
    step: int
    seqs: list[SeqPlan]
    decode: bool  # False: every SeqPlan carries a prefill chunk
    free: list[int] = field(default_factory=list)  # sequence ids to forget before the step
    time_model_version: int = 0
    mode: str = "static"  # speculation mode: static | adaptive | oracle (controller.policy.MODES)
    trace: bool = False  # decode step: rank 0 returns a StepTrace (the step-trace file's detail)


@dataclass
class SeqOutput:
    seq_id: int
    new_tokens: list[int]
    drafted: int = 0  # draft tokens proposed
    verified: int = 0  # draft tokens sent to validation
    accepted: int = 0  # draft tokens accepted


@dataclass
class StepTrace:
    """What a decode step saw and decided, per sequence (n) and draft position (m): the
    detail of one line of a step trace (cluster/engine/trace.py)."""

    kv: list[int]  # (n,) context length of each sequence before the step
    num_spec: list[int]  # (n,) drafts each sequence could verify (its plan's num_spec)
    top_prob: list[list[float]]  # (n, m) the draft's top probability at each position
    margin: list[list[float]]  # (n, m) top-1 minus top-2 probability
    entropy: list[list[float]]  # (n, m) entropy of the draft distribution, nats
    keep: list[int]  # (n,) drafts sent to validation
    accepted: list[int]  # (n,) drafts accepted
    probe: bool  # an adaptive probe step (verifies past the decision for some sequences)


@dataclass
class StepStats:
    draft_ms: float = 0.0
    validate_ms: float = 0.0
    step_ms: float = 0.0
    control_ms: float = 0.0  # speculation control on rank 0: budget, early stop, keep, calibration
    draft_control_ms: float = 0.0  # of control_ms, what only a step that drafts pays: the early stops and keep
    # no one-off in the step's rest (a calibration batch, or what it or a new time model made stale), and in its draft
    # (run on the caches a calibration batch at the end of the step before had just gone through)
    steady: bool = True
    draft_steady: bool = True
    draft_steps: int = 0  # autoregressive draft forwards run
    catchup_tokens: int = 0  # tokens the first draft forward caught up on (steady state: those emitted last step)
    draft_seqs: int = 0  # sequences that drafted (a probe standing down drafts for the explored ones alone)
    num_seqs: int = 0
    num_tokens: int = 0  # target tokens computed (sum of q_len)
    kv_tokens: int = 0  # sum over sequences of q_len * context length (the time model's third feature)
    predicted_validate_ms: float = 0.0  # what the time model in force predicted for this validation
    predicted_draft_ms: float = 0.0  # ... and for the step's draft forwards (step traces only)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: sequences that accepted draft j+1
    verified_per_position: list[int] = field(default_factory=list)  # [j]: sequences that verified draft j+1
    trace: StepTrace | None = None  # when the plan asked for it


@dataclass
class StepResult:
    rank: int
    step: int
    digest: int  # 64-bit digest of what this rank decided and emitted
    outputs: list[SeqOutput] | None = None  # rank 0 only
    stats: StepStats | None = None  # rank 0 only
