"""The in-place launcher's bookkeeping of warm standbys (`hlat_trainer.agent.Agent`), with the
standby processes replaced by records of what the agent asked of them (the real ones, and
restarts through them, run in tests/operator/test_e2e_inplace.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from hlat_api import Env
from hlat_trainer import agent


class Recorded:
    """Stands in for `agent.Standby`: remembers the attempt it was handed."""

    made: ClassVar[list[Recorded]] = []

    def __init__(self, env: Mapping[str, str], argv: Sequence[str] = ()) -> None:
        self.argv, self.handed = list(argv), None
        Recorded.made.append(self)

    def go(self, env: Mapping[str, str], argv: Sequence[str]) -> Any:
        self.handed = dict(env)
        return type("Proc", (), {"pid": 4242, "poll": lambda _: None})()

    def discard(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> tuple[agent.Agent, Clock]:
    Recorded.made = []
    monkeypatch.setattr(agent, "Standby", Recorded)
    clock = Clock()
    layout = agent.NodeLayout(nnodes=2, nproc=2, node_rank=1, master_addr="job-0.job",
                              master_port=29500)
    run = agent.Agent(layout, ["--config", "/etc/hlat/config.json"], {}, control=None,  # type: ignore[arg-type]
                      wait_bound=60, clock=clock)
    run.standbys = [Recorded({}, run.argv) for _ in range(2)]  # what run() starts first
    return run, clock


def test_next_standbys_start_once_the_attempt_has_taken_its_first_step(
        launcher: tuple[agent.Agent, Clock]) -> None:
    run, clock = launcher
    warm = list(run.standbys)
    run._start(attempt=3, steps_done=40, started=clock())
    assert [s.handed is not None for s in warm] == [True, True]  # the attempt ran on them
    assert all(s.argv == run.argv for s in warm)  # they could prepare what the job names
    started = Path(warm[0].handed[Env.STARTED_FILE])  # type: ignore[index]
    assert warm[1].handed[Env.STARTED_FILE] == str(started)  # type: ignore[index]
    assert warm[0].handed[Env.ATTEMPT] == "3" and warm[1].handed["RANK"] == "3"  # type: ignore[index]

    clock.now += 5
    run._keep_standbys()
    assert run.standbys == []  # the attempt is still starting: its CPU is its own
    started.touch()  # what the trainer does after its first step
    run._keep_standbys()
    assert len(run.standbys) == 2 and all(s.handed is None for s in run.standbys)
    run._keep_standbys()
    assert len(Recorded.made) == 4  # started once, not at every look


def test_a_trainer_that_never_says_it_started_gets_standbys_after_the_bound(
        launcher: tuple[agent.Agent, Clock]) -> None:
    run, clock = launcher
    run._start(attempt=1, steps_done=0, started=clock())
    clock.now += agent.STANDBY_DELAY_SECONDS - 0.1
    run._keep_standbys()
    assert run.standbys == []
    clock.now += 0.2
    run._keep_standbys()
    assert len(run.standbys) == 2


def test_without_warm_standbys_none_are_started(launcher: tuple[agent.Agent, Clock]) -> None:
    run, clock = launcher
    run.warm, run.standbys, Recorded.made = False, [], []
    run._start(attempt=1, steps_done=0, started=clock())
    clock.now += agent.STANDBY_DELAY_SECONDS + 1
    run._keep_standbys()
    assert run.standbys == [] and len(Recorded.made) == 2  # only the attempt's own


def test_attempts_of_one_pod_share_what_they_hand_on_and_nothing_else(
        launcher: tuple[agent.Agent, Clock]) -> None:
    """The peak-FLOP file lives as long as the pod; the started and exit files are the
    attempt's own (an old attempt's marker must not start the next standbys early)."""
    run, clock = launcher
    run._start(attempt=1, steps_done=0, started=clock())
    first = Recorded.made[0].handed
    run._start(attempt=2, steps_done=10, started=clock())
    second = Recorded.made[-1].handed
    assert first is not None and second is not None
    assert first[Env.PEAK_FLOPS_FILE] == second[Env.PEAK_FLOPS_FILE]
    assert first[Env.STARTED_FILE] != second[Env.STARTED_FILE]
    assert first[Env.EXIT_FILE] != second[Env.EXIT_FILE]


class StalledControl:
    """An API server that stalls: every read of the record hangs (a GET held to its bound)."""

    pushed = False

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exits: list[tuple[int, int, float]] = []

    def record(self, fresh: bool = False) -> None:
        self.release.wait(10)

    def report_exit(self, attempt: int, rank: int, code: int, reason: str | None = None
                    ) -> None:
        self.exits.append((attempt, code, time.monotonic()))


class Killed:
    """A worker process that is SIGKILLed at `dies` (poll() is then -9, as Popen says)."""

    pid = 0

    def __init__(self, dies: float) -> None:
        self.dies = dies

    def poll(self) -> int | None:
        return -9 if time.monotonic() >= self.dies else None


def test_a_worker_killed_while_a_read_of_the_record_hangs_is_reported_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher reads the record on the side: a worker's SIGKILL is reported (137) within
    a second although the read in flight hangs for 10 s."""
    control = StalledControl()
    layout = agent.NodeLayout(nnodes=1, nproc=1, node_rank=0, master_addr="localhost",
                              master_port=29500)
    run = agent.Agent(layout, [], {}, control=control, wait_bound=0.5, warm=False)
    worker = Killed(time.monotonic() + 0.3)
    monkeypatch.setattr(run, "_start", lambda *args: [worker])
    monkeypatch.setattr(agent, "stop_all", lambda procs, grace: None)  # nothing real to stop
    try:
        assert run._loop(attempt=2, steps_done=0, started=time.monotonic()) == 137
    finally:
        control.release.set()
    assert [(a, c) for a, c, _ in control.exits] == [(2, 137)]
    assert control.exits[0][2] - worker.dies < 1.0


class PromotingControl:
    """A watched record that names the spare pod `job-s0` for node rank 2 of attempt 1."""

    pushed = True

    def __init__(self) -> None:
        self.exits: list[tuple[int, int, int]] = []

    def record(self, fresh: bool = False) -> Any:
        from hlat_api.gang import GangRecord

        return GangRecord(attempt=1, ranks={"job-s0": 2})

    def report_exit(self, attempt: int, rank: int, code: int, reason: str | None = None
                    ) -> None:
        self.exits.append((attempt, rank, code))


def test_a_promoted_spare_reports_its_trainer_s_exit_under_the_rank_it_took(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare pod is created as node rank 0's twin (HLAT_NODE_RANK=0): once the record gives
    it rank 2, its trainer's exit goes on rank 2's Lease, not on rank 0's (which blamed rank
    0's pod for it)."""
    control = PromotingControl()
    layout = agent.NodeLayout(nnodes=3, nproc=1, node_rank=0, master_addr="job-0.job",
                              master_port=29500)
    run = agent.Agent(layout, [], {}, control=control, wait_bound=0.3, warm=False,
                      pod="job-s0", spare=True)
    monkeypatch.setattr(run, "_start", lambda *args: [Killed(time.monotonic() + 0.2)])
    monkeypatch.setattr(agent, "stop_all", lambda procs, grace: None)
    assert run._loop(attempt=-1, steps_done=0, started=time.monotonic()) == 137
    assert control.exits == [(1, 2, 137)]


class ResizingControl(PromotingControl):
    """A watched record that resizes the job to 2 nodes in place at attempt 1 and gives the
    kept pod `job-a0-2` node rank 1 (the node of rank 1 was lost)."""

    def record(self, fresh: bool = False) -> Any:
        from hlat_api.gang import GangRecord

        return GangRecord(attempt=1, ranks={"job-a0-0": 0, "job-a0-2": 1}, nodes=2)


class Done:
    def __init__(self, code: int | None) -> None:
        self.code, self.pid = code, 0

    def poll(self) -> int | None:
        return self.code


def test_a_kept_pod_restarts_its_workers_at_the_size_and_rank_the_record_gives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An elastic job resized in place: the pod was created as node rank 2 of 3 (its
    HLAT_NNODES and HLAT_NODE_RANK say so, for good); the record of attempt 1 says 2 nodes and
    rank 1. Its workers get that world (WORLD_SIZE, RANK, GROUP_WORLD_SIZE: what the trainer
    sizes its spec by), and its neighbour watch and snapshot ring follow the new size."""
    layout = agent.NodeLayout(nnodes=3, nproc=2, node_rank=2, master_addr="job-0.job",
                              master_port=29500)
    run = agent.Agent(layout, [], {}, control=ResizingControl(), wait_bound=0.3, warm=False,
                      pod="job-a0-2")
    rings = SimpleNamespace(nnodes=3, seen=lambda record: None)
    run.peers = rings  # type: ignore[assignment]
    run.replicas = (SimpleNamespace(), rings)  # type: ignore[assignment]
    started: list[dict[str, str]] = []

    def start(attempt: int, steps_done: int, began: float) -> list[Done]:
        started.append(run.layout.worker_env(1, 29501, "run"))
        return [Done(None if attempt == 0 else 0)]

    monkeypatch.setattr(run, "_start", start)
    monkeypatch.setattr(agent, "stop_all", lambda procs, grace: None)
    assert run._loop(attempt=0, steps_done=0, started=time.monotonic()) == 0
    first, resized = started
    assert (first["WORLD_SIZE"], first["RANK"], first["GROUP_WORLD_SIZE"]) == ("6", "5", "3")
    assert (resized["WORLD_SIZE"], resized["RANK"], resized["GROUP_WORLD_SIZE"]) == (
        "4", "3", "2")
    assert rings.nnodes == 2
