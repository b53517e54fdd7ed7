"""The paper's gradient-spike monitor (section 4.1, figure 2).

A step is a spike when its gradient norm exceeds the running mean of the previous `window`
norms by more than `threshold` (the paper: 20 steps, +0.1). Consecutive spike steps form one
spike whose length goes into a histogram; the paper found over 86% last a single step. The
monitor is Stateful so a resumed run keeps its window and histogram.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class GradSpikeMonitor:
    def __init__(self, window: int = 20, threshold: float = 0.1) -> None:
        self.window = window
        self.threshold = threshold
        self.recent: deque[float] = deque(maxlen=window)
        self.current_length = 0
        self.lengths: dict[int, int] = {}  # spike length -> occurrences
        self.total_spike_steps = 0

    def observe(self, grad_norm: float) -> bool:
        """Record one step's norm; True when this step is a spike."""
        full = len(self.recent) == self.window
        spike = full and grad_norm > sum(self.recent) / len(self.recent) + self.threshold
        self.recent.append(grad_norm)
        if spike:
            self.current_length += 1
            self.total_spike_steps += 1
        elif self.current_length:
            self._close()
        return spike

    def _close(self) -> None:
        self.lengths[self.current_length] = self.lengths.get(self.current_length, 0) + 1
        self.current_length = 0

    def histogram(self) -> dict[int, int]:
        """Spike length -> count, including a spike still going on."""
        out = dict(self.lengths)
        if self.current_length:
            out[self.current_length] = out.get(self.current_length, 0) + 1
        return dict(sorted(out.items()))

    def state_dict(self) -> dict[str, Any]:
        return {
            "recent": list(self.recent),
            "current_length": self.current_length,
            "lengths": dict(self.lengths),
            "total_spike_steps": self.total_spike_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque(state["recent"], maxlen=self.window)
        self.current_length = state["current_length"]
        self.lengths = dict(state["lengths"])
        self.total_spike_steps = state["total_spike_steps"]
