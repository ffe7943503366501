"""One copy of a model's weights for several modules of the same shape in one process.

Engines compared step by step in one process (adaspec bench-paired) would otherwise each hold
their own copy, and every step would read its weights back into the caches the other engines'
steps had just filled with theirs: a single server holds one. `share_weights(dst, src)` points
every parameter and buffer of dst at src's storage, and dst's modules at src's for the packed
copies the CPU kernels stream (models/kernels.py, PACK_OWNER): packed on first use by either,
kept on src's; dst's own copies are freed once nothing holds them. (Pointing dst at the packed
copies src held when shared left each engine packing a copy of its own: shared before their
first forward, as bench-paired shares them, two engines streamed two packed copies of the
bundled target, about 19 MB each, through this machine's 32 MB of L3.)
"""
from __future__ import annotations

from torch import nn

from models.kernels import PACK_DTYPE, PACK_OWNER

_PACKED = "_packed"  # models.kernels.linear keeps a module's packed weight here


def share_weights(dst: nn.Module, src: nn.Module) -> None:
    """dst reads src's weights from now on. Both must have the same structure: the same
    submodules, parameters and buffers by name, shape and dtype, packed in the same dtype."""
    dst_mods, src_mods = dict(dst.named_modules()), dict(src.named_modules())
    if dst_mods.keys() != src_mods.keys():
        raise ValueError(f"cannot share weights between a {type(src).__name__} and a {type(dst).__name__} "
                         f"of other submodules ({sorted(dst_mods.keys() ^ src_mods.keys())[:3]} differ)")
    pairs = []
    for name, d in dst_mods.items():
        s = src_mods[name]
        mine = dict(d.named_parameters(recurse=False)) | dict(d.named_buffers(recurse=False))
        theirs = dict(s.named_parameters(recurse=False)) | dict(s.named_buffers(recurse=False))
        for key in list(mine) + [k for k in theirs if k not in mine]:  # (in order: the same error every run)
            a, b = mine.get(key), theirs.get(key)
            if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                raise ValueError(f"cannot share weights: {name or '<root>'}.{key} differs "
                                 f"({_describe(a)} here, {_describe(b)} in the source)")
            pairs.append((a, b))
        if d.__dict__.get(PACK_DTYPE) != s.__dict__.get(PACK_DTYPE):
            raise ValueError(f"cannot share weights: {name or '<root>'} packs its weights in another dtype")
    for a, b in pairs:  # checked first: nothing is shared unless everything can be
        a.data = b.data
    for name, d in dst_mods.items():
        s = src_mods[name]
        d.__dict__.pop(_PACKED, None)
        d.__dict__[PACK_OWNER] = s.__dict__.get(PACK_OWNER, s)  # (src may read another's already)


def _describe(t) -> str:
    return "missing" if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device}"
