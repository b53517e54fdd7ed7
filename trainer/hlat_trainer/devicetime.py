"""A step's device time on a lazy device (XLA), measured without a host sync.

On XLA the host traces a step and dispatches its graphs (one per micro-batch, then the update:
`NeuronXlaBackend.micro_batch_end`, `step_end`); the device runs them later, one after another,
while the host traces the next. The host's clock around a step measures tracing, not the device,
and a wait for the device (`xm.wait_device_ops`) would stall the pipeline every step. torch-xla
instead calls back when a graph's output buffer is ready (`on_ready_callback`, torch-xla 2.9
`torch_xla/experimental/callback.py`, over the runtime's `ComputationClient::OnReadyCallback`,
`torch_xla/csrc/runtime/pjrt_computation_client.cpp`): the time that graph's work ended.

A graph's device time runs from the later of its cut (the host's sync call, less the
compilation in it, which is the host's work) and the end of the graph before it (the device
runs one at a time) to its end. The cut's start, not its return: a sync may block until the
device has run what its graph depends on (on PJRT CPU it did, for some steps and not others),
and a graph timed from the sync's return then looked as if it took no time. A step's
compute is its micro-batch graphs' (forward and backward: no data-parallel collective in them;
tensor-parallel ones stay within the node); its update graph (the gradients' all-reduce, the
optimizer, the loss's all-reduce) is reported apart: on a healthy node mostly the wait for a
slow one, as the host-timed sync is. A step's figures are known once its last graph has run,
a step or two later; `settled` returns the newest step known. A graph outside the steps (an
evaluation's, a checkpoint's) that runs just before a step's first may lengthen that step's
compute once: what the worker's median of recent steps absorbs.

The callback runs on a runtime thread and only stores the time (a float written once: atomic
under the GIL), so the training thread never waits for it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

OnReady = Callable[["Tensor", Callable[[], None]], None]
"""Call the callable once the tensor's device buffer is ready (at once if it is)."""

MAX_PENDING_STEPS = 64
"""Steps whose graphs have not all run yet, kept at most (a runtime that never calls back must
not grow the list without bound: the oldest are dropped, and no figure is reported)."""


@dataclass(frozen=True)
class StepDeviceTime:
    compute: float
    """Device seconds of the step's micro-batch graphs (forward and backward)."""
    update: float
    """Device seconds of its update graph (the collectives over data parallel and the
    optimizer)."""


@dataclass
class _Graph:
    dispatched: float
    ready: float | None = None


class DeviceClock:
    """Records each graph's dispatch and, through the runtime's callback, its end."""

    def __init__(self, on_ready: OnReady, compiled: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._on_ready, self._compiled, self._clock = on_ready, compiled, clock
        self._step: list[_Graph] = []
        self._pending: deque[list[_Graph]] = deque(maxlen=MAX_PENDING_STEPS)
        self._last_end: float | None = None

    def cut(self, sync: Callable[[], None], output: Tensor) -> None:
        """Cut a graph (`sync`: the backend's graph cut) of which `output` is an output."""
        began, compiled = self._clock(), self._compiled()
        sync()
        graph = _Graph(began + (self._compiled() - compiled))

        def ready() -> None:
            graph.ready = self._clock()

        self._on_ready(output, ready)
        self._step.append(graph)

    def step_done(self) -> None:
        """The step's graphs are all cut, its update last."""
        if len(self._step) >= 2:
            self._pending.append(self._step)
        self._step = []

    def settled(self) -> StepDeviceTime | None:
        """The newest step whose graphs have all run since the last call, or None."""
        out = None
        while self._pending and all(g.ready is not None for g in self._pending[0]):
            busy = []
            previous = self._last_end
            for graph in self._pending.popleft():
                assert graph.ready is not None
                start = graph.dispatched if previous is None else max(graph.dispatched,
                                                                      previous)
                busy.append(max(0.0, graph.ready - start))
                previous = graph.ready
            self._last_end = previous
            out = StepDeviceTime(sum(busy[:-1]), busy[-1])
        return out
