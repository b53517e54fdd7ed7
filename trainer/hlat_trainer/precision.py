"""Training precisions: which dtype the weights live in, and what the forward pass computes in.

- fp32: everything fp32 (the reference).
- mixed: fp32 master weights, matmuls under bf16 autocast.
- bf16: weights, gradients and optimizer in bf16; updates rounded to nearest. Small updates
  vanish below bf16's resolution, which is why the paper's pure-BF16 run diverged.
- bf16-sr: like bf16, but the optimizer rounds the new weights stochastically (unbiased), as
  Trainium does in hardware; off Trainium `hlat_trainer.optim.AdamWSR` does it in software.
Buffers (the RoPE tables) stay fp32 in every mode; the loss is computed in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

PRECISIONS = ("fp32", "mixed", "bf16", "bf16-sr")


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    def apply(self, model: nn.Module) -> nn.Module:
        """Cast the parameters (not the buffers) to the weight dtype, in place."""
        for p in model.parameters():
            p.data = p.data.to(self.param_dtype)
        return model

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=device_type, dtype=self.autocast_dtype):
            yield


def precision_policy(mode: str) -> PrecisionPolicy:
    if mode == "fp32":
        return PrecisionPolicy(mode, torch.float32, None)
    if mode == "mixed":
        return PrecisionPolicy(mode, torch.float32, torch.bfloat16)
    if mode in ("bf16", "bf16-sr"):
        return PrecisionPolicy(mode, torch.bfloat16, None)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {mode!r}")
