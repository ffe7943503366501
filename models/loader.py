"""Load local Hugging Face-format checkpoints (`model.safetensors` or a sharded index)
into our modules, each parameter narrowed to this rank's shard by its layer's loader."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from models.config import ModelArch
from models.decoder import CausalLM
from models.deepseek import DeepseekV3CausalLM
from models.kernels import PACK_OWNER
from models.parallel import TPGroup

# checkpoint name fragment -> (our fused name fragment, shard id)
FUSED = {
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"model path {str(path)!r} has neither model.safetensors nor "
                            f"model.safetensors.index.json")


def iter_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(module: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], prefix: str = "") -> set[str]:
    """Copy checkpoint tensors into `module`'s parameters; names are stripped of `prefix`.
    Returns the set of parameter names that were loaded."""
    params = dict(module.named_parameters())
    owners = {name: mod for mod_name, mod in module.named_modules() for name in _own_params(mod_name, mod)}
    loaded = set()
    for name, full in tensors:
        if not name.startswith(prefix) or name.endswith(IGNORED_SUFFIXES):
            continue
        name, shard = name[len(prefix):], None
        for frag, (fused, shard_id) in FUSED.items():
            if frag in name and name not in params:  # an unfused parameter of that name keeps it (MLA's q_proj)
                name, shard = name.replace(frag, fused), shard_id
                break
        if name not in params:
            raise KeyError(f"checkpoint tensor {prefix + name!r} has no matching parameter")
        param = params[name]
        owners[name].weight_loader(param, full.to(param.dtype), shard)
        owners[name].__dict__.pop("_packed", None)  # a packed copy of the old weight (models.kernels.linear)
        owners[name].__dict__.pop(PACK_OWNER, None)  # ... or another module's, whose weight it no longer reads
        loaded.add(name)
    return loaded


def _own_params(mod_name: str, mod: nn.Module) -> list[str]:
    if not hasattr(mod, "weight_loader"):
        return []
    return [f"{mod_name}.{p}" if mod_name else p for p, _ in mod.named_parameters(recurse=False)]


def load_causal_lm(path: str | Path, tp: TPGroup, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> CausalLM:
    arch = ModelArch.from_dir(path)
    arch.check_tp(tp.size)
    model = (DeepseekV3CausalLM if arch.deepseek is not None else CausalLM)(arch, tp)
    tensors = iter_tensors(path)
    if arch.deepseek is not None:  # the MTP layers after the last decoder layer load with the proposer
        mtp = tuple(f"model.layers.{arch.num_layers + i}." for i in range(arch.deepseek.num_nextn_predict_layers))
        tensors = ((n, t) for n, t in tensors if not n.startswith(mtp))
    if arch.tie_word_embeddings:  # some tied checkpoints still store the head: it is the embedding
        tensors = ((n, t) for n, t in tensors if n != "lm_head.weight")
    loaded = load_weights(model, tensors)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise KeyError(f"checkpoint {str(path)!r} lacks parameters: {sorted(missing)[:5]}")
    return model.to(device=device, dtype=dtype).eval()
