"""`TPWorker`: one tensor-parallel rank. The driver wraps it as a Ray actor (one per rank);
tests may also run it in-process at TP=1. It owns the process group, its shard of the
target and draft, the KV cache, and `step(StepPlan) -> StepResult`."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from controller.catchup import SWEEP_CATCHUP
from controller.config import SpeculativeConfig
from controller.policy import SpecPolicy
from controller.time_model import TimeModel
from models import kernels
from models.config import ModelArch, ModelConfig
from models.deepseek import DeepseekMTPLayer
from models.loader import load_causal_lm
from models.mtp import load_deepseek_mtp, load_mtp
from models.parallel import TPGroup, draft_head
from workers.config import CacheConfig, ParallelConfig
from workers.plan import StepPlan, StepResult
from workers.proposer import DraftModelProposer, MTPProposer, Proposer
from workers.runner import ModelRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PACKED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}  # speculative.draft_weights
INIT_TIMEOUT = timedelta(minutes=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def device_for(parallel: ParallelConfig, rank: int) -> torch.device:
    if parallel.device == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device and hccl)
        except ImportError as e:
            raise RuntimeError("parallel.device=npu needs torch_npu (pip install 'adaspec[npu]')") from e
    if parallel.device == "cpu":
        return torch.device("cpu")
    # Ray sets the visible devices per actor; each rank sees its own accelerator as index 0.
    return torch.device(parallel.device, 0)


class TPWorker:
    def __init__(self, rank: int, model: ModelConfig, spec: SpeculativeConfig, parallel: ParallelConfig,
                 cache: CacheConfig):
        self.rank, self.model_cfg, self.spec, self.parallel, self.cache_cfg = rank, model, spec, parallel, cache
        kernels.set_threads(parallel.threads())
        self.runner: ModelRunner | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's address and a free port on its node, for the process group."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init(self, master_addr: str, master_port: int) -> None:
        tp = TPGroup()
        if self.parallel.tp_size > 1:
            device_for(self.parallel, self.rank)
            dist.init_process_group(self.parallel.backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.parallel.tp_size, timeout=INIT_TIMEOUT)
            tp = TPGroup(self.rank, self.parallel.tp_size, dist.group.WORLD)
        self.runner = build_runner(self.rank, tp, self.model_cfg, self.spec, self.cache_cfg,
                                   device_for(self.parallel, self.rank))

    def step(self, plan: StepPlan) -> StepResult:
        return self.runner.step(plan)

    def validate_ms(self, n: int, q: int, ctx: int, runs: int) -> float:
        """Time a validate forward for the startup sweep (every rank runs it together)."""
        from workers import timing

        return timing.validate_ms(self.runner, n, q, ctx, runs)

    def draft_ms(self, n: int, ctx: int, steps: int, runs: int, catchup: int = SWEEP_CATCHUP) -> float:
        """Time a decode step's `steps` draft positions, after a catch-up of `catchup` tokens a sequence,
        for the startup sweep (every rank runs it together)."""
        from workers import timing

        return timing.draft_ms(self.runner, n, ctx, steps, runs, catchup)

    def install_time_model(self, model: TimeModel) -> int:
        """A refit from the profile registry; the acknowledgement is the version."""
        return self.runner.policy.install(model)

    def current_time_model(self) -> TimeModel:
        return self.runner.policy.latest()

    def inject_divergence(self) -> None:
        """Testing: from now on this rank reports a digest no other rank has."""
        self.runner.corrupt_digest = True

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        """This rank's process (the serving benchmark stops an arm's processes between its measurements)."""
        return os.getpid()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_runner(rank: int, tp: TPGroup, model: ModelConfig, spec: SpeculativeConfig, cache: CacheConfig,
                 device: torch.device) -> ModelRunner:
    dtype = DTYPES[model.dtype]
    target = load_causal_lm(model.target, tp, dtype, device)
    proposer: Proposer | None = None
    if spec.enabled and spec.method == "mtp":
        mtp = (load_mtp(model.mtp, target.arch, tp, dtype, device) if model.mtp is not None
               else load_deepseek_mtp(model.target, target.arch, tp, dtype, device))
        # the draft streams its weights (its own layer and, as a head of its own, the target's) as configured
        head = None if isinstance(mtp, DeepseekMTPLayer) else draft_head(target.lm_head)
        for module in (mtp, head):
            if module is not None:
                kernels.pack_weights_as(module, PACKED[spec.draft_weights])
        proposer = MTPProposer(mtp, target, cache.num_blocks, cache.block_size, head)
    elif spec.enabled and spec.method == "draft_model":
        draft = load_causal_lm(model.draft, TPGroup(), dtype, device)  # small: replicated on every rank
        if draft.arch.vocab_size != target.arch.vocab_size:
            raise ValueError(f"model.draft vocab_size={draft.arch.vocab_size} differs from the target's "
                             f"{target.arch.vocab_size}; the draft must share the target's tokenizer")
        kernels.pack_weights_as(draft, PACKED[spec.draft_weights])
        proposer = DraftModelProposer(draft, cache.num_blocks, cache.block_size)
    # the controller's compiled decisions (models/csrc/one_row.cpp, many_rows.cpp, rank.cpp) run on the host
    # whatever the device: in plain Python a step's early stops and keep set took 0.25-1 ms at batch 8-256,
    # warm (the simulator, adaspec simulate), and a CPU rank's forwards also leave that Python out of cache
    compiled = kernels.controller_ops() if proposer is not None else None
    policy = SpecPolicy(spec, compiled=compiled)
    return ModelRunner(rank, target, proposer, policy, cache.num_blocks, cache.block_size, device)


def check_model_dirs(model: ModelConfig, spec: SpeculativeConfig, tp_size: int) -> ModelArch:
    """Validate paths and shapes on the driver, before any worker starts."""
    arch = ModelArch.from_dir(model.target)
    arch.check_tp(tp_size)
    if spec.enabled and spec.method == "mtp" and model.mtp is None:
        layers = arch.deepseek.num_nextn_predict_layers if arch.deepseek is not None else 0
        if layers < 1:
            raise ValueError(f"model.mtp is null, so speculative.method=mtp needs the target's own MTP layer, but "
                             f"model.target={model.target!r} has num_nextn_predict_layers={layers}; set model.mtp "
                             f"to a separate MTP module")
    elif spec.enabled:
        path = model.mtp if spec.method == "mtp" else model.draft
        key = "model.mtp" if spec.method == "mtp" else "model.draft"
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{key}={path!r} is not a directory")
    return arch
