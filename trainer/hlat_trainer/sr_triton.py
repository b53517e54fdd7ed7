"""The fused AdamW + stochastic-rounding update on a GPU: the Triton twin of csrc/sr_adamw.cpp.

Why: on a GPU the pure-torch path of `hlat_trainer.sr_kernel` makes a dozen passes over memory
per tensor (the update, int64 hash temporaries, the rounding); the optimizer step is bound by
memory bandwidth, so each pass costs its full share. Here one kernel per tensor reads weight,
gradient and moments once, does the AdamW update in fp32 and writes back with SR: the bytes
moved are those of the state itself: 22 per parameter with bf16 weights and gradients and
fp32 moments (read 12, write 10), against 28 for torch's fused AdamW on fp32 master weights
and gradients (read 16, write 12).

Design choices and trade-offs:
- The same math and noise as the C++ and torch paths, bit for bit (tests compare them, on
  the CPU through Triton's interpreter and on a GPU when one is lent): fp32 operations in
  the same order, each correctly rounded (`sqrt_rn`, `div_rn`, and the launch's
  `enable_fp_fusion=False` so no multiply-add is contracted into an FMA); the noise of
  element i is sr_kernel's counter-based hash of (stream key, i) in uint32 arithmetic.
- One launch per tensor, in the order given: a 1B-parameter model has about 150 tensors, and
  launching is asynchronous, so the GPU's time (a few ms for the large matrices) hides the
  launches of the small ones. A multi-tensor launch would save the rest; not needed yet.
- Triton is an optional import: Trainium images do not carry it, and the kernels are jitted
  at first use (`_kernels`), so importing this module costs nothing where it is unused and
  the CPU interpreter (TRITON_INTERPRET=1, read when sr_triton_kernels is imported) can run
  them in tests.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from hlat_trainer.sr_kernel import Update

BLOCK = 1024
WARPS = 4
_M32 = 0xFFFFFFFF


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run for tensors on `device` (a CUDA device and Triton)."""
    return device.type == "cuda" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:  # asked every optimizer step: look once
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels() -> Any:
    """The module of Triton kernels, imported (and so jitted) at first use."""
    return importlib.import_module("hlat_trainer.sr_triton_kernels")


def _halves(key: int) -> tuple[int, int]:
    return key & _M32, (key >> 32) & _M32


def adamw_(updates: Sequence[Update]) -> None:
    """Apply sr_kernel's updates in place, one kernel launch per tensor."""
    kernels = _kernels()
    for u in updates:
        n = u.param.numel()
        if n == 0:
            continue
        kernels.adamw_sr[(-(-n // BLOCK),)](
            u.param, u.grad, u.exp_avg, u.exp_avg_sq, n,
            *_halves(u.keys[0]), *_halves(u.keys[1]), *_halves(u.keys[2]),
            u.decay, u.w1, u.beta2, u.c2, u.inv_bc2, u.eps, u.step_size,
            P_BF16=u.param.dtype == torch.bfloat16, S_BF16=u.exp_avg.dtype == torch.bfloat16,
            BLOCK=BLOCK, num_warps=WARPS, enable_fp_fusion=False)


def sr_bf16_(dst: Tensor, src: Tensor, key: int, first: int = 0) -> None:
    """Flat contiguous bf16 `dst` = SR(flat contiguous fp32 `src`) with the noise of `key`;
    element j's noise is that of element first + j."""
    kernels = _kernels()
    n = src.numel()
    if n:
        kernels.sr_copy[(-(-n // BLOCK),)](src, dst, n, first, *_halves(key), BLOCK=BLOCK, num_warps=WARPS)
