"""CPU kernels (models/csrc/: attention over the paged KV cache, small-batch linear layers, and batch 1's
speculation decisions, one_row.cpp, which the worker hands to the controller), compiled on first use with
torch.utils.cpp_extension and cached per CPU and torch version under
~/.cache/adaspec/kernels (about 30 s once; later processes load the cached build).

Where they cannot be built (no compiler) or are turned off (ADASPEC_KERNELS=0), `cpu_ops()`
returns None; where they do not apply (another device or dtype, autograd), `ops_for()`
does. Every caller then computes the same thing with torch ops. Loading them times the
packed linear against torch's once and warns where it is several times slower (`speed_check`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("adaspec.kernels")
NAME = "adaspec_cpu_ops"
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_ops.cpp", "gemm.cpp", "elementwise.cpp",
                                                                     "thread_pool.cpp", "one_row.cpp", "rank.cpp",
                                                                     "many_rows.cpp")]
HEADERS = [Path(__file__).with_name("csrc") / name for name in ("vec_math.h", "thread_pool.h", "decide.h")]
CACHE_ROOT = Path(os.environ.get("ADASPEC_KERNEL_CACHE", "~/.cache/adaspec/kernels")).expanduser()
_lock = threading.Lock()
_state: dict = {}
_F32 = torch.float32
SLOW_VS_TORCH = 3.0  # the packed linear kernel's time over torch's at which loading it warns


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Built with -march=native: one build per CPU feature set, torch version and source."""
    key = hashlib.sha256((_cpu_flags() + torch.__version__ + "".join(s.read_text() for s in SOURCES + HEADERS)).encode()).hexdigest()[:16]
    return CACHE_ROOT / key


def _module():
    """The compiled module, loaded once per process (None where it cannot be built or is turned off)."""
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                _state["module"] = _load()
    return _state["module"]


def cpu_ops():
    """The compiled kernels for a CPU rank's forwards, or None where they cannot be built or are
    turned off. The first call also gives the kernels' pool torch's threads (set_threads)."""
    if "ops" in _state:
        return _state["ops"]
    ops = _module()
    with _lock:
        if "ops" not in _state:
            _apply_threads(ops, _state.get("threads") or torch.get_num_threads())
            if ops is not None:
                speed_check(ops)
            _state["ops"] = ops
        return _state["ops"]


def controller_ops():
    """The same module for the speculation controller alone (one_row.cpp, rank.cpp,
    many_rows.cpp): host code, single-threaded, whatever device the model runs on, so
    loading it leaves torch's threads as they are. None where it cannot be built."""
    return _module()


def set_threads(n: int) -> None:
    """n threads for the kernels' own pool (models/csrc/thread_pool.cpp), which costs the
    same from any thread where OpenMP's regions cost 6x off the main thread; torch's own
    ops then get one. Two thread teams on the same cores spin against each other: with
    torch at two threads beside the pool, plain decoding at batch 32 ran 4354-4639 tok/s,
    with torch at one 5738-6525. (Without the kernels torch gets the n threads.)"""
    with _lock:
        _state["threads"] = n
        ops = _state.get("ops")
    _apply_threads(ops, n)


def _apply_threads(ops, n: int) -> None:
    if ops is not None:
        ops.set_num_threads(n)
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(n)


def ops_for(*tensors: torch.Tensor):
    """The kernels when they apply to all of `tensors` (float32 on the CPU, no autograd), else None.
    (Asked before every linear layer and norm: one loop, 0.5 us a call where a helper per tensor
    under all() took 1.5, some 40 us of a 1 ms step at batch 1.)"""
    for t in tensors:
        if not (t.is_cpu and t.dtype is _F32) or (t.requires_grad and torch.is_grad_enabled()):
            return None
    return cpu_ops()


# Every row count goes to the packed kernel: torch runs on one thread beside the kernels' pool
# (set_threads), where MKL took 17.5 ms for 4096 x 256 @ 256 x 768 and the packed kernel 9.8 ms
# (MKL on two threads: 8.9 ms, but then its OpenMP team spins against the pool).
def linear(owner: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias). Float32 inference on the CPU goes to the packed kernel
    (models/csrc/gemm.cpp): the weight is packed on first use and kept on `owner`, or on the
    module owner reads its weights from (PACK_OWNER, models/share.py), so one packed copy
    serves every module that shares the weight (models/loader.py drops it when it loads new
    weights)."""
    if x.dim() == 2:
        ops = ops_for(x, weight)
        if ops is not None:
            owner = owner.__dict__.get(PACK_OWNER, owner)
            packed = owner.__dict__.get("_packed")
            if packed is None or packed[0] != weight.data_ptr():
                packed = owner.__dict__["_packed"] = (weight.data_ptr(),
                                                      *pack(ops, weight.detach(), owner.__dict__.get(PACK_DTYPE, _F32)))
            return ops.packed_linear(x.contiguous(), packed[1], weight.shape[0], bias, packed[2])
    return F.linear(x, weight, bias)


def pack(ops, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight (N, K) as the packed kernel streams it in `dtype`: its panels, and for int8 the
    scale of each output feature (quantise_rows), padded to whole panels; None otherwise."""
    if dtype is not torch.int8:
        return ops.pack_linear_weight(weight.to(dtype)), None
    q, scale = quantise_rows(weight)
    padded = torch.ones(-(-len(scale) // 16) * 16, dtype=torch.float32)
    padded[:len(scale)] = scale
    return ops.pack_linear_weight(q), padded


def quantise_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output feature (row): q = round(w / s), s = max |w| / 127 of the row
    (1 for a row of zeros), so that w is about q * s."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


PACK_DTYPE = "_pack_dtype"  # a module's packed weights' dtype (float32 if unset)
PACK_OWNER = "_pack_owner"  # the module whose packed copy a module's weight-sharing linear reads (models/share.py)


def pack_weights_as(module: nn.Module, dtype: torch.dtype) -> None:
    """The packed kernel streams `module`'s linear weights (all its submodules') in `dtype`
    (float32, bfloat16, or int8 with a scale per output feature) from now on, computing in
    float32 as before; the parameters stay as they are. For a draft model: bfloat16 halves the
    bytes each draft step reads and int8 quarters them, and a draft's rounding changes only
    which tokens are proposed, never what verification emits."""
    if dtype not in (torch.float32, torch.bfloat16, torch.int8):
        raise ValueError(f"packed weights are float32, bfloat16 or int8, not {dtype}")
    for m in module.modules():
        m.__dict__[PACK_DTYPE] = dtype
        m.__dict__.pop("_packed", None)
        m.__dict__.pop(PACK_OWNER, None)  # (packed in its own dtype, a copy of its own)


def speed_check(ops, rows: int = 64, reps: int = 5) -> float:
    """The packed linear kernel's time over torch's on one product of the bundled model's
    shape (rows x 256 @ 256 x 768, one thread each, medians of `reps` alternating runs, a
    few ms in all), with a warning past SLOW_VS_TORCH: where a compiler's code for the
    kernels goes wrong, every step slows down several times over with nothing else to show
    it (GCC 12 once made it 10x slower than torch; DESIGN.md section 8)."""
    x, w = torch.randn(rows, 256), torch.randn(768, 256)
    packed = ops.pack_linear_weight(w)
    mine, theirs = [], []
    threads = ops.get_num_threads(), torch.get_num_threads()
    ops.set_num_threads(1)  # one thread each: the code's speed, not how the threads share the cores
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(reps + 1):  # the first round warms up and is dropped
                t0 = time.perf_counter()
                ops.packed_linear(x, packed, 768, None)
                t1 = time.perf_counter()
                F.linear(x, w)
                t2 = time.perf_counter()
                mine.append(t1 - t0)
                theirs.append(t2 - t1)
    finally:
        ops.set_num_threads(threads[0])
        torch.set_num_threads(threads[1])
    ratio = sorted(mine[1:])[reps // 2] / max(sorted(theirs[1:])[reps // 2], 1e-9)
    if ratio > SLOW_VS_TORCH:
        log.warning("the packed linear kernel (models/csrc/gemm.cpp) ran %.1fx slower than torch's linear here; the "
                    "compiler's code for it may have gone wrong (DESIGN.md section 8 says what to check)", ratio)
    return ratio


def _load():
    if os.environ.get("ADASPEC_KERNELS", "1") == "0":
        return None
    where = build_dir()
    built = where / f"{NAME}.so"
    try:
        if (where / "ok").is_file():  # built before: import it without asking the build tools again
            return _import(built)
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        where.mkdir(parents=True, exist_ok=True)
        module = load(name=NAME, sources=[str(s) for s in SOURCES], build_directory=str(where),
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-pthread"],
                      extra_ldflags=["-fopenmp", "-pthread"], verbose=False)
        (where / "ok").touch()
        return module
    except Exception as e:  # noqa: BLE001 - any build failure: fall back to torch ops, and say so
        log.warning("compiled kernels unavailable (%s: %s); using torch ops and the controller's Python twins",
                    type(e).__name__, e)
        return None


def _import(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a Ray worker or an unactivated venv may not have the
    pip-installed one there."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path

