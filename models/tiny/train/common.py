"""What the training stages share: data, tokenizer, shapes, the optimisation loop and the
distillation loss."""
from __future__ import annotations

import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from cluster.bench.sharegpt import is_heldout, iter_conversations

TINY_DIR = Path(__file__).resolve().parents[1]  # models/tiny: the shipped checkpoints
WORK_DIR = TINY_DIR / ".work"  # intermediate float32 checkpoints (not shipped)
SEED = 0
VOCAB_SIZE = 4096
SEQ_LEN = 256
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]

TARGET_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=32)
DRAFT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=32)
TARGET_STEPS, DRAFT_STEPS, MTP_STEPS = 900, 500, 600
BATCH = 16
DISTILL_PROMPTS, DISTILL_NEW_TOKENS = 1536, 96


def seed(offset: int = 0) -> None:
    random.seed(SEED + offset)
    torch.manual_seed(SEED + offset)


def train_texts() -> list[str]:
    texts = []
    for conv in iter_conversations():
        if not is_heldout(conv):
            texts.append("\n\n".join(text for _, text in conv.turns if text.strip()))
    random.Random(SEED).shuffle(texts)
    return texts


def train_prompts() -> list[str]:
    prompts = [c.turns[0][1] for c in iter_conversations() if not is_heldout(c) and c.turns[0][1].strip()]
    random.Random(SEED + 1).shuffle(prompts)
    return prompts


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True, "model_max_length": 2048,
        "chat_template": ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
                          "{% if add_generation_prompt %}Assistant:{% endif %}"),
    }


def load_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(WORK_DIR / "tokenizer"))


def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
                       attention_bias=False, torch_dtype="float32", **shape)


def packed_batches(tokenizer, steps: int, offset: int = 0):
    """Yield (BATCH, SEQ_LEN) tensors of packed training text, deterministically."""
    texts = train_texts()
    buf: list[int] = []
    i = offset
    for _ in range(steps):
        while len(buf) < BATCH * SEQ_LEN:
            buf.extend(tokenizer(texts[i % len(texts)])["input_ids"] + [tokenizer.eos_token_id])
            i += 1
        yield torch.tensor(buf[: BATCH * SEQ_LEN]).view(BATCH, SEQ_LEN)
        buf = buf[BATCH * SEQ_LEN:]


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def run_loop(params, steps: int, peak_lr: float, loss_fn, batches, desc: str) -> float:
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    ema = None
    bar = tqdm(range(steps), desc=desc, mininterval=5)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr)
        loss = loss_fn(next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
    return ema


def load_target():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(WORK_DIR / "target", torch_dtype=torch.float32).eval()


def distill_batches(tokenizer, steps: int, seed: int):
    """Alternate batches of target continuations and of plain text (both padded to SEQ_LEN)."""
    seqs = torch.load(WORK_DIR / "distill.pt")
    rng = random.Random(seed)
    text = packed_batches(tokenizer, steps, offset=50_000)
    for step in range(steps):
        if step % 2:
            yield next(text)
        else:
            rows = rng.sample(seqs, BATCH)
            yield torch.tensor([r + [tokenizer.pad_token_id] * (SEQ_LEN - len(r)) for r in rows])


def kl_to_target(student_logits, target_logits, valid):
    """Mean KL(target || student) over valid positions; logits (B, T, V), valid (B, T)."""
    t = F.log_softmax(target_logits, -1)
    s = F.log_softmax(student_logits, -1)
    kl = (t.exp() * (t - s)).sum(-1)
    return (kl * valid).sum() / valid.sum().clamp(min=1)
