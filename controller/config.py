"""Speculation settings (the `speculative:` section of a config file)."""
from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("mtp", "draft_model")
ESTIMATORS = ("top_prob_logistic", "top_prob_calibrated", "top_prob", "token_prob")
TIME_MODELS = ("table", "linear")  # controller/time_model.py
DRAFT_WEIGHTS = ("bfloat16", "int8", "float32")  # models/kernels.py, pack_weights_as


@dataclass
class AdaptiveConfig:
    enabled: bool = False
    min_gain: float = 0.0  # a kept draft must raise estimated throughput by more than this (tokens/s)
    # two or more sequences draft only where the best budget beats a plain step's estimated throughput by
    # more than this fraction (the budget's choice of m > 0 over m = 0; batch 1, the keep rule and the
    # early stop untouched)
    batch_draft_margin: float = 0.1
    estimator: str = "top_prob_logistic"  # one of ESTIMATORS (controller/estimators.py)
    early_stop: bool = True  # after each draft step, draft the next only if it pays its draft step
    # ... pays at the throughput the step's budget expects (the long run's rate), not at the step's own: a model
    # of batch 1 on recorded drafts put it 1.4% ahead, the engine's batch-1 pairs 0.6% (inside their noise;
    # controller/early_stop.py, DESIGN.md section 8)
    early_stop_at_rate: bool = True
    # batch 1: the sequence's own acceptance record shifts the rates its budget and early stop expect
    # (controller/history.py). Off: offline at batch 1 adaptive-3 / 7 read 0.998-1.003 of static-3 with it
    # and 1.004-1.019 without, its controller 0.050-0.054 ms a step against 0.047-0.048 (alternating runs)
    seq_history: bool = False
    # "linear" (xLLM's) or "table": monotone in validated tokens and batch size; the table predicts held-out
    # steps a little better (MAPE 16.1-16.3% vs 16.8-17.3%) but adaptive did not decide better with it
    time_model: str = "linear"
    refit_every: int = 256  # validate-time model refit after this many new samples (sooner on drift)
    profile_on_start: bool = True  # run (or reuse) the profiling sweep before serving
    profile_cache: str = "~/.cache/adaspec/profiles"  # fitted time models, keyed by model/TP/device


@dataclass
class SpeculativeConfig:
    enabled: bool = True
    method: str = "mtp"  # one of METHODS
    num_speculative_tokens: int = 5  # k: draft tokens per sequence per step
    # the draft's linear weights as the CPU kernels stream them (one of DRAFT_WEIGHTS; float32 models only):
    # int8 (a scale per output feature) reads a quarter of the bytes a draft step, bfloat16 half; either changes
    # which tokens are proposed, never what is emitted (DESIGN.md section 8: int8 ran static-3 1.13x bfloat16's)
    draft_weights: str = "int8"
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens if self.enabled else 0
