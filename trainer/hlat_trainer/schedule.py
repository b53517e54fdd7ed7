"""The learning-rate schedule: linear warmup, then cosine decay to the minimum (paper 3.2).

A pure function of the step, so nothing about it needs saving: resuming at step N+1 gives
exactly the rate an uninterrupted run would. Steps count from 1 (the first optimizer step).
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Rate for optimizer step `step` (1-based): lr*step/warmup, then cosine to min_lr at the end."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
