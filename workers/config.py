"""Parallelism and KV-cache settings (the `parallel:` and `cache:` sections)."""
from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("cpu", "cuda", "npu")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
EXECUTORS = ("auto", "ray", "local")


@dataclass
class ParallelConfig:
    tp_size: int = 2
    device: str = "cpu"  # one of DEVICES; picks the collective backend
    placement_strategy: str = "STRICT_PACK"  # Ray placement group strategy for the TP ranks
    num_cpus_per_worker: float = 1.0  # Ray CPUs reserved per rank (0 lets many ranks share few cores)
    threads_per_worker: int = 0  # torch threads per rank; 0 = see threads()
    compiled_dag: bool = True  # dispatch steps through a Ray Compiled Graph (else one .remote per rank)
    executor: str = "auto"  # one of EXECUTORS: where the ranks run (auto: in the driver at tp_size 1, else Ray)

    def threads(self) -> int:
        """Ray ranks leave a core to the driver, which polls their results while they
        compute; an in-process rank is the driver and takes every core."""
        import os

        cores = os.cpu_count() or 1
        return self.threads_per_worker or (cores if self.in_process else max(1, (cores - 1) // self.tp_size))

    @property
    def in_process(self) -> bool:
        """One rank in the driver process: no actor, no dispatch; a rank's death is the driver's."""
        return self.executor == "local" or (self.executor == "auto" and self.tp_size == 1)

    @property
    def backend(self) -> str:
        return BACKENDS[self.device]


@dataclass
class CacheConfig:
    block_size: int = 16  # positions per KV block
    kv_tokens: int = 65536  # KV budget in token positions per sequence-set (all sequences together)

    @property
    def num_blocks(self) -> int:
        return self.kv_tokens // self.block_size
