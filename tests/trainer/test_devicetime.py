"""A step's device time from the runtime's buffer-ready callbacks (`devicetime`): the
arithmetic, on a clock and a runtime the test drives. tests/xla/test_xla_engine.py runs it on
real torch-xla."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hlat_trainer.devicetime import MAX_PENDING_STEPS, DeviceClock, EventClock, StepDeviceTime


class Runtime:
    """A device that runs graphs one at a time: `finish` calls back the oldest pending one."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waiting: list[Callable[[], None]] = []

    def on_ready(self, _output: object, ready: Callable[[], None]) -> None:
        self.waiting.append(ready)

    def finish(self, at: float) -> None:
        self.now = at
        self.waiting.pop(0)()


def test_a_graph_counts_from_its_dispatch_or_the_previous_graph_s_end_to_its_own_end() -> None:
    """Two micro-batches and an update, dispatched while the device is still busy: each graph's
    time starts when the one before it ended, not when the host dispatched it (its wait in the
    queue is not its work); nothing is known until the update has run."""
    rt = Runtime()
    clock = DeviceClock(rt.on_ready, clock=lambda: rt.now)
    for t in (0.0, 0.1, 0.2):  # the host traces fast and dispatches ahead of the device
        rt.now = t
        clock.cut(lambda: None, object())
    clock.step_done()
    rt.finish(1.0)  # micro-batch 1: 1.0 s from its dispatch at 0
    rt.finish(1.5)  # micro-batch 2: queued from 0.1, ran from 1.0
    assert clock.settled() is None  # the update has not run yet
    rt.finish(3.5)  # the update, with a wait for a slow peer in its all-reduce
    assert clock.settled() == StepDeviceTime(compute=pytest.approx(1.5), update=pytest.approx(2.0))
    assert clock.settled() is None  # reported once


def test_a_device_idle_between_graphs_counts_none_of_it_and_the_newest_step_is_reported() -> None:
    rt = Runtime()
    clock = DeviceClock(rt.on_ready, clock=lambda: rt.now)
    for first in (0.0, 10.0):  # two steps, each graph dispatched 3 s after the last one
        for k, length in enumerate((1.0, 1.0, 0.5)):
            rt.now = first + 3.0 * k
            clock.cut(lambda: None, object())
            rt.finish(rt.now + length)
        clock.step_done()
    # the device idles between the graphs (a slow host): none of that is its compute
    assert clock.settled() == StepDeviceTime(compute=pytest.approx(2.0),
                                             update=pytest.approx(0.5))


def test_a_runtime_that_never_calls_back_keeps_a_bounded_list_and_reports_nothing() -> None:
    clock = DeviceClock(lambda _output, _ready: None, clock=lambda: 0.0)
    for _ in range(3 * MAX_PENDING_STEPS):
        clock.cut(lambda: None, object())
        clock.cut(lambda: None, object())
        clock.step_done()
    assert clock.settled() is None
    assert len(clock._pending) == MAX_PENDING_STEPS


def test_a_graph_counts_from_its_cut_less_the_compile_in_it_even_where_the_sync_blocks() -> None:
    """A cut that compiles for 5 s and then blocks until the device has run the graph (as a
    PJRT CPU sync did on some steps): timed from the sync's return, the graph took no time;
    it took the 2 s between the compile's end and its own."""
    rt = Runtime()
    compiled = [0.0]
    clock = DeviceClock(rt.on_ready, compiled=lambda: compiled[0], clock=lambda: rt.now)

    def sync(compile_for: float, runs_for: float) -> Callable[[], None]:
        def cut() -> None:
            compiled[0] += compile_for
            rt.now += compile_for + runs_for  # compiled, then ran while the host waited
        return cut

    clock.cut(sync(5.0, 2.0), object())  # a micro-batch: cut at 0, compiled to 5, ran to 7
    rt.finish(rt.now)
    clock.cut(sync(0.0, 1.5), object())  # the update, cut at 7, blocking until 8.5
    rt.finish(rt.now)
    clock.step_done()
    assert clock.settled() == StepDeviceTime(compute=pytest.approx(2.0),
                                             update=pytest.approx(1.5))


class Stream:
    """A CUDA stream as `EventClock` sees it, the test playing the device: `record` puts an
    event after the work enqueued so far; the device completes events in order (`run_to`),
    each at the device time the test gives. Follows `torch.cuda.Event` (torch/cuda/streams.py,
    torch 2.9 and 2.15): `record()` on the current stream, `query()` True once the work before
    it has run, `elapsed_time(end)` in milliseconds, an error (cudaErrorNotReady) unless both
    events have completed."""

    def __init__(self) -> None:
        self.recorded: list[StreamEvent] = []

    def event(self) -> StreamEvent:
        return StreamEvent(self)

    def run_to(self, *times: float) -> None:
        """The oldest events not yet completed complete, at these device times."""
        waiting = [e for e in self.recorded if e.at is None]
        for event, at in zip(waiting, times, strict=False):
            event.at = at


class StreamEvent:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.at: float | None = None

    def record(self) -> None:
        self.stream.recorded.append(self)

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end_event: StreamEvent) -> float:
        if self.at is None or end_event.at is None:
            raise RuntimeError("CUDA error: device not ready")
        return (end_event.at - self.at) * 1000.0


def _cuda_step(clock: EventClock, micro_batches: int) -> None:
    """The engine's calls for one step (`Engine.train_step`)."""
    for _ in range(micro_batches):
        clock.begin()
        clock.cut(lambda: None, object())
    clock.begin()  # the update
    clock.cut(lambda: None, object())
    clock.step_done()


def test_cuda_spans_between_events_count_the_device_s_work_not_its_idle_time() -> None:
    """Two micro-batches and an update on a stream the host runs ahead of: each span is the
    device time between its events, the device idling between spans (a host slow to feed
    it, a data wait) counts in neither; nothing is read before the update's end event has
    completed, and nothing is read twice."""
    stream = Stream()
    clock = EventClock(stream.event)
    _cuda_step(clock, 2)
    assert clock.settled() is None  # nothing has run: no event queried is waited on
    stream.run_to(0.0, 1.0)  # micro-batch 1: 1 s
    stream.run_to(4.0, 4.5)  # idle 3 s, micro-batch 2: 0.5 s
    stream.run_to(4.5)  # the update begins
    assert clock.settled() is None  # its end has not completed
    stream.run_to(6.5)  # the update, with a wait for a slow peer in its all-reduce: 2 s
    assert clock.settled() == StepDeviceTime(compute=pytest.approx(1.5),
                                             update=pytest.approx(2.0))
    assert clock.settled() is None


def test_cuda_steps_settle_in_order_the_newest_reported_and_a_stuck_stream_is_bounded() -> None:
    stream = Stream()
    clock = EventClock(stream.event)
    for _ in range(2):
        _cuda_step(clock, 1)
    stream.run_to(0.0, 1.0, 1.0, 1.25, 2.0, 4.0, 4.0, 4.5)
    assert clock.settled() == StepDeviceTime(compute=pytest.approx(2.0),
                                             update=pytest.approx(0.5))
    stuck = EventClock(Stream().event)  # a device that never runs anything
    for _ in range(3 * MAX_PENDING_STEPS):
        _cuda_step(stuck, 2)
    assert stuck.settled() is None and len(stuck._pending) == MAX_PENDING_STEPS
    clock.cut(lambda: None, object())  # a cut with no span begun is not timed
    clock.step_done()
    assert len(clock._pending) == 0
