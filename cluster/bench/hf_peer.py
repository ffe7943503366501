"""Peer arms at batch 1: Hugging Face transformers' own generate with the same target
(`hf-target`) and with the bundled draft as `assistant_model` (`hf-assisted`), its
assistant schedule and confidence threshold tuned to their best on the first prompts."""
from __future__ import annotations

import itertools
import time

import torch

from cluster.bench.arms import Arm, WaveResult

TUNE_PROMPTS = 4
SCHEDULES = ("constant", "heuristic")
NUM_ASSISTANT_TOKENS = (3, 5, 7)
THRESHOLDS = (0.0, 0.2, 0.4)
DEFAULTS = ("constant", 20, 0.4)  # transformers' defaults for an assistant model


class HFPeer:
    """Loads the target and the draft with transformers on the engine's device and threads."""

    settle_s = 0.0  # in-process: nothing runs between waves

    def __init__(self, cfg, tune_prompts: list[list[int]]):
        from transformers import AutoModelForCausalLM

        self.threads = cfg.parallel.threads()  # the same cores as the engine's rank, during its own waves
        self.device = "cuda" if cfg.parallel.device == "cuda" else "cpu"
        self.target = AutoModelForCausalLM.from_pretrained(cfg.model.target, dtype=torch.float32).to(self.device).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(cfg.model.draft, dtype=torch.float32).to(self.device).eval()
        self.tuned = cfg.bench.hf_tune
        self.best = self._tune(tune_prompts, cfg.bench.output_len) if self.tuned else DEFAULTS

    def arms(self, batch: int, several: bool) -> list[Arm]:
        """The two peer arms (batch 1 only: generate runs one prompt at a time)."""
        from cluster.bench.offline import arm_name

        target = Arm(arm_name("hf-target", 0, 1, several), "hf-target", 0, 1, note="transformers generate, target only")
        schedule, tokens, thr = self.best
        assisted = Arm(arm_name("hf-assisted", tokens, 1, several), "hf-assisted", tokens, 1,
                       note=f"transformers assisted generation, {'tuned' if self.tuned else 'defaults'}: "
                            f"schedule={schedule}, num_assistant_tokens={tokens}, "
                            f"assistant_confidence_threshold={thr}")
        return [target, assisted]

    def run_wave(self, arm: Arm, prompts: list[list[int]], refs: list[list[int]], max_tokens: int,
                 label: str = "") -> WaveResult:
        kwargs = self._assisted(*self.best) if arm.policy == "hf-assisted" else {}
        ids, wall = [], 0.0
        with torch.inference_mode():
            for p in prompts:
                got, secs = self._generate(p, max_tokens, **kwargs)
                ids.append(got)
                wall += secs
        return WaveResult(ids, wall)

    def _tune(self, prompts: list[list[int]], output_len: int) -> tuple:
        best, best_t = DEFAULTS, float("inf")
        with torch.inference_mode():
            for schedule, tokens, thr in itertools.product(SCHEDULES, NUM_ASSISTANT_TOKENS, THRESHOLDS):
                kw = self._assisted(schedule, tokens, thr)
                self._generate(prompts[0], 8, **kw)  # warm-up
                t = sum(self._generate(p, output_len, **kw)[1] for p in prompts[:TUNE_PROMPTS])
                if t < best_t:
                    best, best_t = (schedule, tokens, thr), t
        return best

    def _generate(self, prompt: list[int], output_len: int, **kwargs) -> tuple[list[int], float]:
        ids = torch.tensor([prompt], device=self.device)
        engine_threads = torch.get_num_threads()  # the engine's setting (models/kernels.set_threads), restored after
        torch.set_num_threads(self.threads)
        try:
            t0 = time.perf_counter()
            # eos_token_id=None: keep going past EOS without suppressing it, like ignore_eos
            out = self.target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                       do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
            return out[0, len(prompt):].tolist(), time.perf_counter() - t0
        finally:
            torch.set_num_threads(engine_threads)

    def _assisted(self, schedule: str, tokens: int, threshold: float) -> dict:
        cfg = self.draft.generation_config
        cfg.num_assistant_tokens_schedule, cfg.num_assistant_tokens = schedule, tokens
        cfg.assistant_confidence_threshold = threshold
        return {"assistant_model": self.draft}
