"""Peer arms at batch 1: Hugging Face transformers' own generate with the same target
(`hf-target`) and with the bundled draft as `assistant_model` (`hf-assisted`), its
assistant schedule and confidence threshold tuned to their best on the first prompts."""
from __future__ import annotations

import itertools
import time

import torch
from tqdm import tqdm

TUNE_PROMPTS = 4
SCHEDULES = ("constant", "heuristic")
NUM_ASSISTANT_TOKENS = (3, 5, 7)
THRESHOLDS = (0.0, 0.2, 0.4)
DEFAULTS = ("constant", 20, 0.4)  # transformers' defaults for an assistant model


def _generate(model, prompt: list[int], output_len: int, **kwargs) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=model.device)
    t0 = time.perf_counter()
    # eos_token_id=None: keep going past EOS without suppressing it, like ignore_eos
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                         do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


def _assisted_kwargs(draft, schedule: str, tokens: int, threshold: float) -> dict:
    draft.generation_config.num_assistant_tokens_schedule = schedule
    draft.generation_config.num_assistant_tokens = tokens
    draft.generation_config.assistant_confidence_threshold = threshold
    return {"assistant_model": draft}


def hf_arms(cfg, prompts: list[list[int]], refs: list[list[int]], several: bool) -> list:
    from transformers import AutoModelForCausalLM

    from cluster.bench import Arm, arm_name

    torch.set_num_threads(cfg.parallel.threads())  # the same cores as the engine's rank
    output_len = cfg.bench.output_len
    device = "cuda" if cfg.parallel.device == "cuda" else "cpu"  # the engine's device, as the engine's rank
    target = AutoModelForCausalLM.from_pretrained(cfg.model.target, dtype=torch.float32).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(cfg.model.draft, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        best, best_t = DEFAULTS, float("inf")
        grid = itertools.product(SCHEDULES, NUM_ASSISTANT_TOKENS, THRESHOLDS) if cfg.bench.hf_tune else []
        for schedule, tokens, thr in grid:
            kw = _assisted_kwargs(draft, schedule, tokens, thr)
            _generate(target, prompts[0], 8, **kw)  # warm-up
            t = sum(_generate(target, p, output_len, **kw)[1] for p in prompts[:TUNE_PROMPTS])
            if t < best_t:
                best, best_t = (schedule, tokens, thr), t
        arms = []
        for policy in ("hf-target", "hf-assisted"):
            k = best[1] if policy == "hf-assisted" else 0
            arm = Arm(arm_name(policy, k, 1, several), policy, k, 1)
            kw = _assisted_kwargs(draft, *best) if policy == "hf-assisted" else {}
            if policy == "hf-assisted":
                arm.note = (f"transformers assisted generation, {'tuned' if cfg.bench.hf_tune else 'defaults'}: "
                            f"schedule={best[0]}, num_assistant_tokens={best[1]}, "
                            f"assistant_confidence_threshold={best[2]}")
            else:
                arm.note = "transformers generate, target only"
            for p, ref in tqdm(list(zip(prompts, refs)), desc=policy, mininterval=2):
                got, secs = _generate(target, p, output_len, **kw)
                arm.wall_s += secs
                arm.output_tokens += len(got)
                arm.outputs += 1
                arm.identical &= got == ref
            arms.append(arm)
    return arms
