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
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    except dist.DistNetworkError:  # another process took the port after free_port() found it free
        queue.put((rank, None))
        return
    try:
        queue.put((rank, pickle.dumps(fn(TPGroup(rank, world, dist.group.WORLD), *args))))  # plain bytes, no fd sharing
    finally:
        dist.destroy_process_group()


def run_tp(fn, world: int, *args, attempts: int = 3):
    """fn(tp: TPGroup, *args) -> picklable; returns the list of results by rank. A rendezvous
    whose port was taken meanwhile starts over on a fresh port."""
    ctx = mp.get_context("spawn")
    for _ in range(attempts):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        while len(results) < world:
            rank, payload = queue.get(timeout=300)
            if payload is None:
                break
            results[rank] = payload
        else:
            for p in procs:
                p.join()
            return [pickle.loads(results[r]) for r in range(world)]
        for p in procs:  # the other ranks wait on a rendezvous that will not come
            p.kill()
            p.join()
    raise RuntimeError(f"{world} gloo ranks could not rendezvous in {attempts} tries: their ports were taken")
