"""What the Engine counts over its life: steps, drafts, validation times, acceptance by
draft position (read by the benchmark, the metrics and the tests)."""
from __future__ import annotations

from dataclasses import dataclass, field

from workers.plan import StepStats


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    emitted: int = 0
    prefill_tokens: int = 0  # target tokens computed by prefill steps (prompts, recomputes)
    draft_ms: float = 0.0
    validate_ms: float = 0.0
    step_ms: float = 0.0
    control_ms: float = 0.0  # speculation control on rank 0 (budget, early stop, keep, calibration)
    dispatch_ms: float = 0.0
    draft_steps_run: int = 0  # draft forwards, summed over decode steps
    zero_budget_steps: int = 0  # decode steps that drafted nothing
    recoveries: int = 0  # worker groups rebuilt after a rank died
    aborted: int = 0  # sequences dropped because their request was aborted
    decode_seq_ms: float = 0.0  # sum over decode steps of (sequences in the step) x (step wall time)
    decode_tokens: int = 0  # tokens emitted by decode steps; decode-only TPOT = decode_seq_ms / decode_tokens
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)

    def add(self, s: StepStats, dispatch_ms: float, decode: bool) -> None:
        self.steps += 1
        self.decode_steps += decode
        self.prefill_tokens += 0 if decode else s.num_tokens
        self.draft_steps_run += s.draft_steps
        self.zero_budget_steps += decode and s.draft_steps == 0
        self.draft_ms += s.draft_ms
        self.validate_ms += s.validate_ms
        self.step_ms += s.step_ms
        self.control_ms += s.control_ms
        self.dispatch_ms += dispatch_ms
        for mine, new in ((self.accepted_per_position, s.accepted_per_position),
                          (self.verified_per_position, s.verified_per_position)):
            mine.extend([0] * (len(new) - len(mine)))
            for j, v in enumerate(new):
                mine[j] += v
