"""The fused AdamW + stochastic-rounding update behind `hlat_trainer.optim.AdamWSR`.

Why: done with torch ops, bf16 weights with SR cost several passes over memory per step
(conversions, the update, the rounding, scratch buffers) and CPU's serial generator. Here one
pass per tensor reads weight, gradient and moments, does the AdamW update in fp32, and writes
the weight back stochastically rounded, with noise from a counter-based hash: nothing to
generate ahead, nothing allocated.

Design choices and trade-offs:
- Three implementations of the same math, bit for bit: a C++ loop for the CPU
  (csrc/sr_adamw.cpp, compiled with the machine's g++ at first use, cached under
  ~/.cache/hlat/sr_kernel/, loaded with ctypes: no ninja, no torch headers, a build of about a
  second), a Triton kernel for CUDA devices (`hlat_trainer.sr_triton`, where Triton is
  installed) and a pure-torch path. The torch path runs where neither can: no compiler (one
  warning), other devices, or HLAT_SR_KERNEL=torch. It is also the reference the other two
  are tested against.
- Bit-exact across the three: every fp32 operation is one correctly rounded IEEE operation in a
  fixed order (g++ runs with -ffp-contract=off, so no FMA; torch's elementwise ops round once
  each). Division by a scalar is avoided (torch turns it into a reciprocal multiply), so the
  bias correction is a multiply by 1/sqrt(1 - beta2^t), computed in double and rounded to fp32.
  torch.sqrt on fp32 CPU tensors is not correctly rounded (a vectorised approximation, an ulp
  off in about 1 of 6 values), so the torch path takes it in fp64 and rounds to fp32: exactly
  the correctly rounded fp32 square root (fp64 has more than 2 x 24 + 2 bits).
  Per element, with constants rounded to fp32 once:
      p = p * (1 - lr * wd);  m = m + (1 - beta1) * (g - m);  v = v * beta2 + (1 - beta2) * (g * g)
      p = p + (-lr / (1 - beta1^t)) * (m / (sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps))
  This is torch.optim.AdamW's update; it differs from torch's foreach kernels only in FMA use
  and reciprocal rounding (an ulp or so per step).
- Noise: element i (flat index in its tensor) of a stream with 64-bit key k gets
  fmix32(fmix32(lo(i) ^ k0) ^ k1 ^ hi(i) * 0x9E3779B9) >> 16, where k0, k1 are k's low and
  high 32 bits and fmix32 is MurmurHash3's finaliser (a bijection with full avalanche). So the
  noise depends only on (key, element), not on threads, chunks or order. The keys come from
  `stream_key` (SplitMix64), see optim.py for how a step's key is drawn.
- Threads: the C++ loop splits tensors into ranges across torch.get_num_threads() Python
  threads (ctypes releases the GIL); results do not depend on the split.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from hlat_trainer import sr_triton

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "sr_adamw.cpp"
CXXFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
ENV_BACKEND = "HLAT_SR_KERNEL"  # "torch" forces the pure-torch path
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_GOLDEN32 = 0x9E3779B9
_MIN_RANGE = 1 << 16  # elements: smaller pieces are not worth a thread
_TORCH_CHUNK = 1 << 20  # elements per pass of the torch path (its int64 temporaries: 8 MiB each)


def splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele et al.), on Python ints modulo 2^64."""
    x = (x + _GOLDEN64) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def stream_key(step_key: int, tensor_index: int, stream: int) -> int:
    """The key of stream `stream` (0 weights, 1 first moment, 2 second moment) of a tensor:
    output 3 * tensor_index + stream of SplitMix64 started at the step's key."""
    return splitmix64((step_key + _GOLDEN64 * (3 * tensor_index + stream)) & _M64)


@dataclass
class Update:
    """One tensor's AdamW update: the tensors (contiguous, same shape; the gradient fp32 or
    bf16, the others fp32 or bf16) and its constants, as Python floats rounded to fp32 by
    the kernels."""

    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    keys: tuple[int, int, int]  # stream keys: weights, first moment, second moment
    decay: float  # 1 - lr * weight_decay
    w1: float  # 1 - beta1
    beta2: float
    c2: float  # 1 - beta2
    inv_bc2: float  # 1 / sqrt(1 - beta2^t)
    eps: float
    step_size: float  # -lr / (1 - beta1^t)


# ---------------------------------------------------------------- the pure-torch path


def _mul32(h: Tensor, c: int) -> Tensor:
    """(h * c) mod 2^32 for h in [0, 2^32), in int64 without overflow (16-bit halves)."""
    return ((h & 0xFFFF) * c + (((h >> 16) * c) & 0xFFFF) * 65536) & _M32


def _fmix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def noise16(index: Tensor, key: int) -> Tensor:
    """The 16 noise bits (int64 in [0, 2^16)) of elements `index` (int64) in stream `key`."""
    k0, k1 = key & _M32, (key >> 32) & _M32
    hmix = ((index >> 32) * _GOLDEN32) & _M32
    return _fmix32(_fmix32((index & _M32) ^ k0) ^ k1 ^ hmix) >> 16


def sr_bits(x: Tensor, noise: Tensor) -> Tensor:
    """bf16 bit patterns (int64 in [0, 2^16)) of SR(x), fp32 `x`, int64 `noise`."""
    u = x.view(torch.int32).to(torch.int64) & _M32
    a = u & 0x7FFFFFFF
    rounded = (u + noise) >> 16
    special = torch.where(a > 0x7F800000, (u >> 16) | 0x40, u >> 16)
    saturated = ((u >> 16) & 0x8000) | 0x7F7F
    return torch.where(a >= 0x7F800000, special, torch.where(a > 0x7F7F0000, saturated, rounded))


def bits_to_bf16(bits: Tensor) -> Tensor:
    return (bits - ((bits >> 15) & 1) * 65536).to(torch.int16).view(torch.bfloat16)


def _torch_update(u: Update, start: int, end: int) -> None:
    """The update of flat elements [start, end) of one tensor, in fp32 torch ops."""
    def piece(t: Tensor) -> Tensor:
        return t.view(-1)[start:end]

    def f32(x: float) -> Tensor:  # the constant rounded to fp32, as the C++ path takes it
        return torch.tensor(x, dtype=torch.float32, device=u.param.device)

    p, g, m, v = (piece(t).float() for t in (u.param, u.grad, u.exp_avg, u.exp_avg_sq))
    p = p * f32(u.decay)
    m = m + f32(u.w1) * (g - m)
    v = v * f32(u.beta2) + f32(u.c2) * (g * g)
    denom = torch.sqrt(v.double()).float() * f32(u.inv_bc2) + f32(u.eps)  # see the docstring
    p = p + f32(u.step_size) * (m / denom)
    index = torch.arange(start, end, dtype=torch.int64, device=p.device)
    for dst, value, key in ((u.param, p, u.keys[0]), (u.exp_avg, m, u.keys[1]),
                            (u.exp_avg_sq, v, u.keys[2])):
        if dst.dtype == torch.bfloat16:
            piece(dst).copy_(bits_to_bf16(sr_bits(value, noise16(index, key))))
        else:
            piece(dst).copy_(value)


def torch_adamw_(updates: Sequence[Update], chunk: int = _TORCH_CHUNK) -> None:
    for u in updates:
        for start in range(0, u.param.numel(), chunk):
            _torch_update(u, start, min(start + chunk, u.param.numel()))


def torch_sr_bf16_(dst: Tensor, src: Tensor, key: int, first: int = 0,
                   chunk: int = _TORCH_CHUNK) -> None:
    """Flat bf16 dst = SR(flat fp32 src); element j's noise is that of element first + j."""
    for start in range(0, src.numel(), chunk):
        end = min(start + chunk, src.numel())
        index = torch.arange(first + start, first + end, dtype=torch.int64, device=src.device)
        dst[start:end] = bits_to_bf16(sr_bits(src[start:end], noise16(index, key)))


# ---------------------------------------------------------------- the C++ path


class _Task(ctypes.Structure):
    _fields_ = [
        ("param", ctypes.c_void_p), ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p), ("exp_avg_sq", ctypes.c_void_p),
        ("begin", ctypes.c_int64), ("end", ctypes.c_int64),
        ("key_p", ctypes.c_uint64), ("key_m", ctypes.c_uint64), ("key_v", ctypes.c_uint64),
        ("decay", ctypes.c_float), ("w1", ctypes.c_float), ("beta2", ctypes.c_float),
        ("c2", ctypes.c_float), ("inv_bc2", ctypes.c_float), ("eps", ctypes.c_float),
        ("step_size", ctypes.c_float),
        ("param_bf16", ctypes.c_int32), ("grad_bf16", ctypes.c_int32),
        ("state_bf16", ctypes.c_int32),
    ]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "hlat" / "sr_kernel"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's flags (a cache shared by machines with
    different CPUs must not hand one a library built for another)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(cxx: str) -> Path:
    """The compiled library for this source, flags, compiler and CPU (cached; built if absent).
    The build goes to a temporary file renamed into place, so concurrent processes are safe."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CXXFLAGS).encode(), version.stdout.encode(),
                 _cpu_signature().encode()):
        digest.update(part)
    target = _cache_dir() / f"sr_adamw-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *CXXFLAGS, str(SOURCE), "-o", tmp], capture_output=True,
                       text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the fused AdamW-SR kernel: %s", target)
    return target


class Kernel:
    """The loaded C++ library."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))  # CDLL: calls release the GIL, so threads run in parallel
        lib.hlat_task_size.restype = ctypes.c_int64
        if lib.hlat_task_size() != ctypes.sizeof(_Task):
            raise RuntimeError(f"{path}: task layout differs from sr_kernel._Task")
        lib.hlat_adamw_sr.argtypes = [ctypes.POINTER(_Task), ctypes.c_int64]
        lib.hlat_adamw_sr.restype = None
        lib.hlat_sr_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_uint64]
        lib.hlat_sr_bf16.restype = None
        self._lib = lib
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

    def adamw_(self, updates: Sequence[Update]) -> None:
        threads = max(1, torch.get_num_threads())
        total = sum(u.param.numel() for u in updates)
        per_thread = max(_MIN_RANGE, -(-total // threads))
        groups: list[list[_Task]] = [[]]
        room = per_thread
        for u in updates:
            start, n = 0, u.param.numel()
            while start < n:
                if room == 0:
                    groups.append([])
                    room = per_thread
                end = min(n, start + room)
                groups[-1].append(_task(u, start, end))
                room -= end - start
                start = end
        arrays = [(_Task * len(g))(*g) for g in groups if g]
        if len(arrays) == 1:
            self._lib.hlat_adamw_sr(arrays[0], len(arrays[0]))
            return
        if self._pool is None or self._workers < len(arrays):
            self._pool, self._workers = ThreadPoolExecutor(max_workers=len(arrays)), len(arrays)
        for future in [self._pool.submit(self._lib.hlat_adamw_sr, a, len(a)) for a in arrays]:
            future.result()

    def sr_bf16_(self, dst: Tensor, src: Tensor, key: int, first: int = 0) -> None:
        """Flat bf16 dst = SR(flat fp32 src); element j's noise is that of element first + j."""
        self._lib.hlat_sr_bf16(src.data_ptr(), dst.data_ptr(), first, src.numel(), key)


def _task(u: Update, begin: int, end: int) -> _Task:
    return _Task(u.param.data_ptr(), u.grad.data_ptr(), u.exp_avg.data_ptr(),
                 u.exp_avg_sq.data_ptr(), begin, end, *u.keys, u.decay, u.w1, u.beta2, u.c2,
                 u.inv_bc2, u.eps, u.step_size, u.param.dtype == torch.bfloat16,
                 u.grad.dtype == torch.bfloat16, u.exp_avg.dtype == torch.bfloat16)


_loaded: Kernel | None = None
_load_failed = False


def load() -> Kernel | None:
    """The C++ kernel, built on first use; None (after one warning) where it cannot be built,
    and None without a warning under HLAT_SR_KERNEL=torch."""
    global _loaded, _load_failed
    if os.environ.get(ENV_BACKEND) == "torch":
        return None
    if _loaded is not None or _load_failed:
        return _loaded
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    try:
        if cxx is None:
            raise FileNotFoundError("no C++ compiler (g++ or c++) on PATH")
        _loaded = Kernel(build(cxx))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        _load_failed = True
        detail = exc.stderr.strip().splitlines()[-1:] if isinstance(
            exc, subprocess.CalledProcessError) and exc.stderr else [str(exc)]
        warnings.warn(f"AdamWSR: fused C++ kernel unavailable ({detail[0] if detail else exc}); "
                      "using the slower pure-torch path (same results)", RuntimeWarning,
                      stacklevel=3)
    return _loaded


def _triton(device: torch.device) -> bool:
    return os.environ.get(ENV_BACKEND) != "torch" and sr_triton.available(device)


def adamw_(updates: Sequence[Update]) -> None:
    """Apply the updates in place: the C++ kernel on CPU where it loads, the Triton kernel on
    a CUDA device where Triton is installed, else pure torch."""
    if updates and _triton(updates[0].param.device):
        sr_triton.adamw_(updates)
        return
    kernel = load() if all(u.param.device.type == "cpu" for u in updates) else None
    if kernel is None:
        torch_adamw_(updates)
    else:
        kernel.adamw_(updates)


def sr_bf16_(dst: Tensor, src: Tensor, key: int) -> None:
    """Flat contiguous bf16 `dst` = SR(flat contiguous fp32 `src`) with the noise of `key`."""
    if _triton(src.device):
        sr_triton.sr_bf16_(dst, src, key)
        return
    kernel = load() if src.device.type == "cpu" else None
    if kernel is None:
        torch_sr_bf16_(dst, src, key)
    else:
        kernel.sr_bf16_(dst, src, key)
