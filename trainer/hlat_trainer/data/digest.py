"""A digest of the sequences a step trained on, to compare runs by their data.

`batch_digest(inputs, targets)` hashes each sequence of a micro-batch (its seq_len + 1 tokens:
the inputs and the last target) to 64 bits and adds the hashes up modulo 2^64. A sum, so the
digest of a global batch is the sum of its ranks' and micro-batches' digests in any order: the
same at every data-parallel degree and accumulation count, as long as the sequences are the
same. Each sequence's hash weighs every position with its own constant and then mixes the
result (SplitMix64's finaliser), so moving a token within a sequence or between sequences
changes it. Not cryptographic: it tells equal data from unequal data, nothing more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def _weights(length: int) -> np.ndarray:
    return _mix(np.arange(1, length + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


def batch_digest(inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """The sum of the micro-batch's sequence hashes, modulo 2^64 (an int in [0, 2^64))."""
    rows = np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1).astype(np.uint64)
    hashes = _mix(((rows + np.uint64(1)) * _weights(rows.shape[1])).sum(axis=1, dtype=np.uint64))
    return int(hashes.sum(dtype=np.uint64))


def digest_text(value: int) -> str:
    """As the step log shows it: 16 hex digits."""
    return f"{value & MASK:016x}"
