"""MTP self-distillation and export of the tiny pair (stages of `python -m models.tiny.train`).

The MTP module is trained with our own module at TP=1, so its parameter names are the
ones the loader expects. Chain step 1 reads the target's hidden states; chain step 2 reads
the module's own (as when drafting the second token), teacher-forced on the next token.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.attention import AttnBatch
from models.config import ModelArch
from models.mtp import MTPModule
from models.parallel import TPGroup
from models.tiny.train.common import kl_to_target, run_loop

STEP2_WEIGHT = 0.5


def _init_from_target(mtp: MTPModule, target) -> None:
    last = target.model.layers[-1]
    attn, mlp = last.self_attn, last.mlp
    with torch.no_grad():
        for p in mtp.parameters():
            p.requires_grad_(True)
        torch.nn.init.normal_(mtp.eh_proj.weight, std=0.02)
        layer = mtp.layer
        layer.self_attn.qkv_proj.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        layer.self_attn.o_proj.weight.copy_(attn.o_proj.weight)
        layer.mlp.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        layer.mlp.down_proj.weight.copy_(mlp.down_proj.weight)
        layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        mtp.norm.weight.copy_(target.model.norm.weight)


def _chain_step(mtp, embed, ids, prev, start, cache):
    """One chain step over whole rows: pairs (prev[:, t], ids[:, t]) at positions start + t."""
    b, t = ids.shape
    batch = AttnBatch.build([start] * b, [t] * b, [[i * 2 + j for j in range(2)] for i in range(b)], 256)
    out = mtp(embed(ids).reshape(b * t, -1), prev.reshape(b * t, -1), batch, cache)
    return out.view(b, t, -1)


def train_mtp(target, tokenizer, batches, steps: int, out_path: Path) -> None:
    arch = ModelArch.from_dict(target.config.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    mtp = MTPModule(arch, TPGroup())
    _init_from_target(mtp, target)
    embed, head = target.model.embed_tokens, target.lm_head
    pad = tokenizer.pad_token_id

    def loss_fn(x):
        with torch.no_grad():
            out = target.model(input_ids=x)
            hidden = out.last_hidden_state  # (B, T, H), after the final norm
            t_logits = head(hidden)
        cache = mtp.new_kv_cache(2 * x.shape[0], 256)  # two blocks of 256 positions per row
        g = _chain_step(mtp, embed, x[:, 1:], hidden[:, :-1], 1, cache)  # predicts x[:, 2:]
        valid = (x[:, 1:] != pad).float()
        loss = kl_to_target(head(g[:, :-1]), t_logits[:, 1:-1], valid[:, :-1])
        g2 = _chain_step(mtp, embed, x[:, 2:], g[:, :-1], 2, mtp.new_kv_cache(2 * x.shape[0], 256))
        loss2 = kl_to_target(head(g2[:, :-1]), t_logits[:, 2:-1], valid[:, 1:-1])
        return loss + STEP2_WEIGHT * loss2

    for p in target.parameters():
        p.requires_grad_(False)
    run_loop(list(mtp.parameters()), steps, 2e-3, loss_fn, batches, "mtp")
    save_file({k: v.contiguous() for k, v in _hf_names(mtp.state_dict(), arch).items()}, str(out_path))


def _hf_names(state: dict, arch: ModelArch) -> dict:
    """Unfuse qkv and gate/up so the file uses Hugging Face decoder-layer names."""
    out = {}
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    for name, t in state.items():
        if ".qkv_proj." in name:
            for part, piece in zip("qkv", t.split([q, kv, kv])):
                out[name.replace(".qkv_proj.", f".{part}_proj.")] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate", "up"), t.chunk(2)):
                out[name.replace(".gate_up_proj.", f".{part}_proj.")] = piece
        else:
            out[name] = t
    return out


def export_tiny(work: Path, dest: Path, tokenizer_config: dict, dtype: torch.dtype = torch.float16) -> None:
    """Write the shipped 16-bit pair: tiny/target and tiny/draft (Hugging Face-loadable
    LlamaForCausalLM directories with the tokenizer) and tiny/mtp."""
    from safetensors.torch import load_file

    for name in ("target", "draft"):
        out = dest / name
        out.mkdir(parents=True, exist_ok=True)
        tensors = load_file(str(work / name / "model.safetensors"))
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = json.loads((work / name / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        shutil.copy(work / "tokenizer" / "tokenizer.json", out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    mtp_dir = dest / "mtp"
    mtp_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(work / "mtp.safetensors"))
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(mtp_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (mtp_dir / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV3MTP"], "num_nextn_predict_layers": 1, "layer_shape": "target",
         "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2))
