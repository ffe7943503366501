"""The training stages, in order: tokenizer, target, distill, draft, mtp, export, eval."""
from __future__ import annotations

import json

import torch
from tqdm import tqdm

from cluster.bench.sharegpt import is_heldout, iter_conversations
from models.tiny.train.common import (DISTILL_NEW_TOKENS, DISTILL_PROMPTS, DRAFT_SHAPE, DRAFT_STEPS, MTP_STEPS,
                                      SEQ_LEN, SPECIAL, TARGET_SHAPE, TARGET_STEPS, TINY_DIR, VOCAB_SIZE, WORK_DIR,
                                      distill_batches, kl_to_target, llama_config, load_target, load_tokenizer,
                                      packed_batches, run_loop, seed, tokenizer_config, train_prompts, train_texts)


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
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    print(f"tokenizer: {tok.get_vocab_size()} tokens")


def stage_target() -> None:
    from transformers import LlamaForCausalLM

    seed(2)
    tok = load_tokenizer()
    model = LlamaForCausalLM(llama_config(TARGET_SHAPE))
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    def loss_fn(x):
        return model(input_ids=x, labels=x).loss

    loss = run_loop(list(model.parameters()), TARGET_STEPS, 3e-3, loss_fn, packed_batches(tok, TARGET_STEPS), "target")
    model.save_pretrained(WORK_DIR / "target", safe_serialization=True)
    (WORK_DIR / "target_train.json").write_text(json.dumps({"final_train_loss": loss}))


def stage_distill() -> None:
    """The target's greedy continuations of training prompts: what drafts must predict."""
    seed(3)
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


def stage_draft() -> None:
    from transformers import LlamaForCausalLM

    seed(4)
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


def stage_mtp() -> None:
    from models.tiny.train.mtp import train_mtp

    seed(5)
    tok = load_tokenizer()
    train_mtp(load_target(), tok, distill_batches(tok, MTP_STEPS, 5), MTP_STEPS, WORK_DIR / "mtp.safetensors")


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


def stage_export() -> None:
    from models.tiny.train.mtp import export_tiny

    export_tiny(WORK_DIR, TINY_DIR, tokenizer_config())


STAGES = {"tokenizer": stage_tokenizer, "target": stage_target, "distill": stage_distill,
          "draft": stage_draft, "mtp": stage_mtp, "export": stage_export, "eval": stage_eval}
