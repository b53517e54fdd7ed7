"""A step's device time where the host's clock is not the device's, measured without a host
sync: on a lazy device (XLA, `DeviceClock`) and on an asynchronous one (CUDA, `EventClock`).

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

On CUDA the host enqueues kernels on a stream as it calls the ops and runs ahead of the device;
what the host's clock around a micro-batch measures is the launch. The device's own clock is
read from events recorded on the stream between the kernels (`torch.cuda.Event(enable_timing=
True)`, its `record`, `query` and `elapsed_time`: `torch/cuda/streams.py` of torch 2.9
and 2.15, over
`cudaEventRecord`, `cudaEventQuery` and `cudaEventElapsedTime`), the way NVIDIA's resiliency
extension times its sections: an event before each micro-batch's forward and after its
backward, one before the update and after the loss's all-reduce. A span is the device time
between its two events, so the device idling between spans (a host slow to feed it) is not
counted, as on XLA. Events are only queried, never waited on (`elapsed_time` once both have
completed, which `query` on the later one says on a single stream).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

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


class StepClock(Protocol):
    """The engine's calls, in order, each step: `begin` before each micro-batch's forward and
    before the update, `cut` after each micro-batch's backward and after the update (with the
    loss's all-reduce), then `step_done`; `settled` for the newest step the device has run."""

    def begin(self) -> None: ...

    def cut(self, sync: Callable[[], None], output: Tensor) -> None: ...

    def step_done(self) -> None: ...

    def settled(self) -> StepDeviceTime | None: ...


class DeviceClock:
    """Records each graph's dispatch and, through the runtime's callback, its end."""

    def __init__(self, on_ready: OnReady, compiled: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._on_ready, self._compiled, self._clock = on_ready, compiled, clock
        self._step: list[_Graph] = []
        self._pending: deque[list[_Graph]] = deque(maxlen=MAX_PENDING_STEPS)
        self._last_end: float | None = None

    def begin(self) -> None:
        """Nothing: a graph's work starts at its dispatch (the cut) or the previous one's end."""

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


class Event(Protocol):
    """What `EventClock` calls of `torch.cuda.Event(enable_timing=True)`."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class EventClock:
    """Spans between events recorded on the device's stream (CUDA): `begin` records a span's
    start, `cut` its end; a step's spans are read once its last event has completed."""

    def __init__(self, event: Callable[[], Event]) -> None:
        self._event = event
        self._start: Event | None = None
        self._step: list[tuple[Event, Event]] = []
        self._pending: deque[list[tuple[Event, Event]]] = deque(maxlen=MAX_PENDING_STEPS)

    def _record(self) -> Event:
        event = self._event()
        event.record()
        return event

    def begin(self) -> None:
        self._start = self._record()

    def cut(self, sync: Callable[[], None], output: Tensor) -> None:
        """End the span `begin` started (`output` is not needed: the stream orders the
        kernels); a cut with no span begun is not timed."""
        sync()
        if self._start is not None:
            self._step.append((self._start, self._record()))
            self._start = None

    def step_done(self) -> None:
        if len(self._step) >= 2:
            self._pending.append(self._step)
        self._step, self._start = [], None

    def settled(self) -> StepDeviceTime | None:
        """The newest step whose last event has completed since the last call, or None."""
        out = None
        while self._pending and self._pending[0][-1][1].query():
            spans = [start.elapsed_time(end) / 1000.0 for start, end in self._pending.popleft()]
            out = StepDeviceTime(sum(spans[:-1]), spans[-1])
        return out
