"""bench-serve's closed-loop points: `bench.serve_clients` clients, each sending its next
request when its last one finished, against every server arm; and the same requests run
offline through an in-process Engine with as many in flight (`offline-nospec`), the
bound a server of this engine could reach, so a served arm's cost shows as a ratio. Each
point is measured in bench.serve_client_rounds interleaved rounds (`merge_rounds`), the arms
that ratios are taken against back to back in each (`round_order`), and a round's requests
in blocks that every runner takes in turn (`blocks`)."""
from __future__ import annotations

import asyncio
import time

import numpy as np

from cluster.bench.load import RequestResult, RequestSpec, run_clients

OFFLINE_ARM = "offline-nospec"


# the arms every ratio of the closed-loop table is taken against: measured back to back in a round
ANCHORS = ("nospec", OFFLINE_ARM, "vllm-nospec")


def round_order(runners: list, rng) -> list:
    """One round's order of the runners (anything with an `arm`): shuffled, except that the
    anchors (ANCHORS present) run back to back, in a shuffled order, at a shuffled place.
    This machine's speed drifts by 10-30% within a minute; with eight arms of 12-15 s each at
    one client, nospec and offline-nospec had stood up to 90 s apart in a round, and the
    per-round ratio of the two ranged 0.79-1.00 in one run."""
    anchors = [r for r in runners if r.arm in ANCHORS]
    others = [r for r in runners if r.arm not in ANCHORS]
    rng.shuffle(anchors)
    rng.shuffle(others)
    at = rng.randrange(len(others) + 1)
    return others[:at] + anchors + others[at:]


BLOCK_PER_CLIENT = 8  # a round's requests run in blocks of at least this many per client


def blocks(specs: list[RequestSpec], clients: int) -> list[list[RequestSpec]]:
    """A round's requests cut into blocks of at least BLOCK_PER_CLIENT per client (one block
    from 4 clients up at 48 requests). Every runner runs a block before the next one starts,
    in the round's order, reversed every other block. At one client a round of 48 requests
    took 3-4 s per arm, and the per-round ratio of served to offline ranged 0.77-1.05 over
    ten rounds: this machine's speed moves that much within seconds. In blocks of 8 the two
    stand about half a second apart."""
    n = max(1, len(specs) // (BLOCK_PER_CLIENT * clients))
    size = -(-len(specs) // n)
    return [specs[i:i + size] for i in range(0, len(specs), size)]


def client_results(target, specs: list[RequestSpec], clients: int) -> tuple[list[RequestResult], float]:
    """`clients` closed-loop clients against a server: the results and the wall time."""
    from cluster.bench.servers import running

    with running(target):
        return asyncio.run(run_clients(target.url, target.model, specs, clients))


def joined(arm: str, clients: int, parts: list[tuple[list[RequestResult], float]]) -> dict:
    """One round's point from its blocks: every request's result, over the blocks' summed wall time."""
    from cluster.bench.serving import point

    results = [r for part, _ in parts for r in part]
    return {**point(arm, float("inf"), None, results, sum(wall for _, wall in parts)), "rate": None,
            "clients": clients}


def merge_rounds(rounds: list[dict]) -> dict:
    """One point (closed-loop, or a Poisson rate) from its rounds: the median over rounds of the throughput and
    of each latency percentile, completions and errors summed, and every round's
    throughput (`rounds`), so ratios between runners can be taken round by round."""
    out = {key: value for key, value in rounds[0].items() if key not in ("texts", "replica")}
    if "replica" in rounds[0]:  # which of the arm's servers measured each round
        out["replicas"] = [p["replica"] for p in rounds]
    for key in ("output_tok_per_s", "request_per_s"):
        out[key] = round(float(np.median([p[key] for p in rounds])), 3)
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        out[key] = {q: None if any(p[key][q] is None for p in rounds) else
                    round(float(np.median([p[key][q] for p in rounds])), 3) for q in ("p50", "p90", "p99")}
    out.update(completed=sum(p["completed"] for p in rounds), errors=sum(p["errors"] for p in rounds),
               error_examples=sorted({e for p in rounds for e in p["error_examples"]})[:3],
               wall_s=round(sum(p["wall_s"] for p in rounds), 3), rounds=[p["output_tok_per_s"] for p in rounds])
    return out


def round_ratios(point: dict, ref: dict) -> list[float]:
    """Point's throughput over ref's, round by round (rounds where ref measured nothing left out)."""
    return [a / b for a, b in zip(point.get("rounds") or [point["output_tok_per_s"]],
                                  ref.get("rounds") or [ref["output_tok_per_s"]]) if b]


def round_ratio(point: dict, ref: dict) -> tuple[float, float, float] | None:
    """Median, min and max over rounds of point's throughput over ref's in the same round."""
    r = round_ratios(point, ref)
    if not r:
        return None
    return float(np.median(r)), min(r), max(r)


class OfflineClients:
    """The engine without a server: requests admitted as closed-loop clients would send them."""

    arm, settle_s = OFFLINE_ARM, 0.0

    def __init__(self, cfg):
        from cluster.engine.core import Engine

        self.engine = Engine(cfg)

    def results(self, specs: list[RequestSpec], clients: int) -> tuple[list[RequestResult], float]:
        """As client_results, through the engine in this process."""
        from cluster.engine.request import RequestParams

        engine, results = self.engine, [RequestResult(sent=0.0) for _ in specs]
        upcoming, live = iter(range(len(specs))), 0

        def send() -> bool:
            i = next(upcoming, None)
            if i is None:
                return False
            params = RequestParams(max_tokens=specs[i].max_tokens, temperature=0.0)
            engine.add_request(specs[i].prompt, params, request_id=str(i))
            results[i].sent = time.perf_counter()
            return True

        start = time.perf_counter()
        for _ in range(clients):
            live += send()
        while live:
            for out in engine.step():
                r = results[int(out.request_id)]
                if out.new_token_ids and not r.chunk_times:
                    r.chunk_times.append(time.perf_counter())
                if out.finished:
                    r.end, r.text, r.tokens = time.perf_counter(), out.text, len(out.token_ids)
                    live += send() - 1
        return results, max(r.end for r in results) - start

    def close(self) -> None:
        self.engine.shutdown()
