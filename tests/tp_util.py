"""Run a function on N gloo ranks in subprocesses (no Ray) and collect rank results."""
from __future__ import annotations

import os
import pickle
import socket

import torch.distributed as dist
import torch.multiprocessing as mp

from models.parallel import TPGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        queue.put((rank, pickle.dumps(fn(TPGroup(rank, world, dist.group.WORLD), *args))))  # plain bytes, no fd sharing
    finally:
        dist.destroy_process_group()


def run_tp(fn, world: int, *args):
    """fn(tp: TPGroup, *args) -> picklable; returns the list of results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join()
    return [pickle.loads(results[r]) for r in range(world)]
