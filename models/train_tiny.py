"""Train the bundled tiny model pair from scratch on ShareGPT V3, on CPU, seeded.

    python -m models.train_tiny                 # all stages, about 50 minutes on 2 cores
    python -m models.train_tiny --stage mtp     # one stage (tokenizer|target|distill|draft|mtp|export|eval)

Stages:
  tokenizer  byte-level BPE (vocab 4096) on training conversations
  target     LlamaForCausalLM, about 5.9M parameters, next-token loss on ShareGPT text
  distill    the target's greedy continuations of training prompts (the text speculation sees)
  draft      a 1-layer LM distilled from the target (KL to its distribution)
  mtp        a DeepSeek-V3-style MTP module distilled from the target's next-next distribution
  export     16-bit safetensors into models/tiny/{target,draft}
  eval       the shipped target's loss on 16,384 held-out tokens

Everything is computed in float32; held-out conversations (models.data.is_heldout) are
never trained on. Intermediate float32 checkpoints go to models/tiny/.work (not shipped).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.data import iter_conversations, is_heldout

TINY_DIR = Path(__file__).parent / "tiny"
WORK_DIR = TINY_DIR / ".work"
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


def _seed(offset: int = 0) -> None:
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


# ---------------------------------------------------------------------------- tokenizer
def stage_tokenizer() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = train_texts()[:6000]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out = WORK_DIR / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2))
    print(f"tokenizer: {tok.get_vocab_size()} tokens")


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True, "model_max_length": 2048,
        "chat_template": ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
                          "{% if add_generation_prompt %}Assistant:{% endif %}"),
    }


def load_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(WORK_DIR / "tokenizer"))


# ---------------------------------------------------------------------------- helpers
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


# ---------------------------------------------------------------------------- target
def stage_target() -> None:
    from transformers import LlamaForCausalLM

    _seed(2)
    tok = load_tokenizer()
    model = LlamaForCausalLM(llama_config(TARGET_SHAPE))
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    def loss_fn(x):
        return model(input_ids=x, labels=x).loss

    loss = run_loop(list(model.parameters()), TARGET_STEPS, 3e-3, loss_fn, packed_batches(tok, TARGET_STEPS), "target")
    model.save_pretrained(WORK_DIR / "target", safe_serialization=True)
    (WORK_DIR / "target_train.json").write_text(json.dumps({"final_train_loss": loss}))


def load_target():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(WORK_DIR / "target", torch_dtype=torch.float32).eval()


# ---------------------------------------------------------------------------- distill data
def stage_distill() -> None:
    """The target's greedy continuations of training prompts: what drafts must predict."""
    _seed(3)
    tok = load_tokenizer()
    target = load_target()
    prompts = train_prompts()[:DISTILL_PROMPTS]
    seqs = []
    with torch.no_grad():
        for s in tqdm(range(0, len(prompts), 64), desc="distill", mininterval=5):
            ids = [tok(p)["input_ids"][: SEQ_LEN - DISTILL_NEW_TOKENS][-128:] for p in prompts[s:s + 64]]
            width = max(map(len, ids))
            batch = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
            mask = (batch != tok.pad_token_id).long()
            out = target.generate(input_ids=batch, attention_mask=mask, max_new_tokens=DISTILL_NEW_TOKENS,
                                  min_new_tokens=DISTILL_NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
            for x, row in zip(ids, out):
                seqs.append(x + row[width:].tolist())
    torch.save(seqs, WORK_DIR / "distill.pt")
    print(f"distill: {len(seqs)} sequences")


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


# ---------------------------------------------------------------------------- draft
def stage_draft() -> None:
    from transformers import LlamaForCausalLM

    _seed(4)
    tok = load_tokenizer()
    target = load_target()
    draft = LlamaForCausalLM(llama_config(DRAFT_SHAPE))
    # Start from the target's embeddings and head: the draft then only learns the mapping.
    draft.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    draft.lm_head.weight.data.copy_(target.lm_head.weight.data)
    draft.model.norm.weight.data.copy_(target.model.norm.weight.data)
    print(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters")

    def loss_fn(x):
        valid = (x != tok.pad_token_id).float()
        with torch.no_grad():
            t_logits = target(input_ids=x).logits
        return kl_to_target(draft(input_ids=x).logits, t_logits, valid)

    run_loop(list(draft.parameters()), DRAFT_STEPS, 2e-3, loss_fn, distill_batches(tok, DRAFT_STEPS, 4), "draft")
    draft.save_pretrained(WORK_DIR / "draft", safe_serialization=True)


# ---------------------------------------------------------------------------- mtp
def stage_mtp() -> None:
    from models.train_mtp import train_mtp

    _seed(5)
    tok = load_tokenizer()
    train_mtp(load_target(), tok, distill_batches(tok, MTP_STEPS, 5), MTP_STEPS, run_loop, kl_to_target,
              WORK_DIR / "mtp.safetensors")


# ---------------------------------------------------------------------------- eval
EVAL_ROWS = 64  # x SEQ_LEN = 16,384 tokens


def stage_eval() -> None:
    """Held-out loss of the shipped target: packed held-out conversations, never trained on."""
    from transformers import LlamaForCausalLM

    tok = load_tokenizer()
    target = LlamaForCausalLM.from_pretrained(TINY_DIR / "target", torch_dtype=torch.float32).eval()
    buf: list[int] = []
    for conv in iter_conversations():
        if is_heldout(conv):
            buf.extend(tok("\n\n".join(t for _, t in conv.turns if t.strip()))["input_ids"] + [tok.eos_token_id])
        if len(buf) >= EVAL_ROWS * SEQ_LEN:
            break
    x = torch.tensor(buf[: EVAL_ROWS * SEQ_LEN]).view(EVAL_ROWS, SEQ_LEN)
    with torch.no_grad():
        loss = sum(target(input_ids=x[i:i + 8], labels=x[i:i + 8]).loss.item() for i in range(0, EVAL_ROWS, 8)) / 8
    print(f"held-out loss: {loss:.3f} nats per token ({EVAL_ROWS * SEQ_LEN} tokens)")


# ---------------------------------------------------------------------------- export
def stage_export() -> None:
    from models.train_mtp import export_tiny

    export_tiny(WORK_DIR, TINY_DIR, _tokenizer_config())


STAGES = {"tokenizer": stage_tokenizer, "target": stage_target, "distill": stage_distill,
          "draft": stage_draft, "mtp": stage_mtp, "export": stage_export, "eval": stage_eval}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=list(STAGES), action="append", help="run only these stages (repeatable)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in args.stage or list(STAGES):
        t0 = time.time()
        STAGES[name]()
        print(f"stage {name}: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
