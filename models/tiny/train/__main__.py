"""Train the bundled tiny model pair from scratch on ShareGPT V3, on CPU, seeded.

    python -m models.tiny.train                 # all stages, about 50 minutes on 2 cores
    python -m models.tiny.train --stage mtp     # one stage (tokenizer|target|distill|draft|mtp|export|eval)

Stages:
  tokenizer  byte-level BPE (vocab 4096) on training conversations
  target     LlamaForCausalLM, about 5.8M parameters, next-token loss on ShareGPT text
  distill    the target's greedy continuations of training prompts (the text speculation sees)
  draft      a 1-layer LM distilled from the target (KL to its distribution)
  mtp        a DeepSeek-V3-style MTP module distilled from the target's next-next distribution
  export     16-bit safetensors into models/tiny/{target,draft,mtp}
  eval       the shipped target's loss on 16,384 held-out tokens

Everything is computed in float32; held-out conversations (cluster.bench.sharegpt.is_heldout)
are never trained on. Intermediate float32 checkpoints go to models/tiny/.work. Run it from a
checkout: this package is not installed with adaspec.
"""
from __future__ import annotations

import argparse
import time

import torch

from models.tiny.train.stages import STAGES


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
