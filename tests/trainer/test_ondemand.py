"""Checkpoints on request (hlat_trainer.ondemand): a checkpoint the operator asks for is saved
at one step that every rank agrees on, once per request, and changes nothing of the training;
the run resumes from it exactly. The heartbeat's side (reading the request from the Lease) is
in test_heartbeat_cluster.py, the operator's in test_op_kueue.py, the whole path against a real
Kueue in test_e2e_kueue.py."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from hlat_api import Job, step_dir
from hlat_trainer.ondemand import CheckpointRequests
from hlat_trainer.train import Trainer


def _losses(job: Job, request_after: int | None = None) -> tuple[list[float], Trainer]:
    """Train `job`; with `request_after`, this rank sees a request (value 7) from the report
    of that step on, as the heartbeat would from its next renewal."""
    seen: list[dict[str, Any]] = []
    request = [0]

    def sink(stats: dict[str, Any]) -> None:
        seen.append(stats)
        if request_after is not None and stats["step"] >= request_after:
            request[0] = 7

    trainer = Trainer(job, sinks=[sink])
    trainer.requests = CheckpointRequests(lambda: request[0], None)
    trainer.run()
    return [s["loss"] for s in seen], trainer


def test_a_checkpoint_asked_for_is_saved_once_changes_nothing_and_resumes_exactly(
        make_job: Callable[..., Job]) -> None:
    plain = make_job("plain", train__steps=8, checkpoint__interval=100, checkpoint__keep=3)
    asked = make_job("asked", train__steps=8, checkpoint__interval=100, checkpoint__keep=3)
    straight, _ = _losses(plain)
    losses, _ = _losses(asked, request_after=3)
    assert losses == straight  # bit for bit: the save read the state, never moved it
    root = Path(asked.spec.checkpoint.dir)
    # seen after step 3's report: saved at step 4, once (the same request stays on the Lease)
    assert sorted(p.name for p in (root / "asked").iterdir()) == ["step_4", "step_8"]
    assert (step_dir(root, "asked", 4) / "done").is_file()

    (step_dir(root, "asked", 8) / "done").unlink()  # the pods stopped after step 4's save
    resumed, trainer = _losses(asked)
    assert trainer.first_step == 5
    assert resumed == straight[4:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SEES = {0: {3: 5, 9: 11}, 1: {6: 5}}
"""What each rank's heartbeat has seen after a step: rank 0 request 5 after step 3 and request
11 after step 9; rank 1 (another node) request 5 only after step 6."""


def _rank(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    seen = [0]
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)
    requests = CheckpointRequests(lambda: seen[0], group)
    due = []
    for step in range(1, 13):
        found = requests.due()  # after the step, as the loop asks
        if found is not None:
            due.append((step, found))
        seen[0] = SEES[rank].get(step, seen[0])
    requests.close()
    out.put((rank, due))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_saves_the_same_step_whichever_saw_the_request_first() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    # seen by rank 0 after step 3: both save step 5 (the reduction started after step 4,
    # read after step 5); rank 1 seeing request 5 later is old news; 11 after step 9: step 11
    assert got[0] == got[1] == [(5, 5), (11, 11)], got


def test_requests_are_off_without_an_operator() -> None:
    """No Lease in the environment: no collective is ever started, nothing is due."""
    requests = CheckpointRequests(None, None)
    assert [requests.due() for _ in range(3)] == [None, None, None]


class _Lease:
    """The heartbeat's place in the loop (update, stop), counting `renew_soon`."""

    def __init__(self) -> None:
        self.soon: list[int | None] = []
        self.last: dict[str, Any] = {}

    def update(self, **fields: Any) -> None:
        self.last = fields

    def renew_soon(self) -> None:
        self.soon.append(self.last.get("checkpoint_step"))

    def stop(self, phase: str | None = None) -> None:
        pass


def test_the_checkpoint_asked_for_is_published_at_once_when_complete(
        make_job: Callable[..., Job]) -> None:
    """The operator stops the pods (and the preempting job gets its quota) once it sees the
    checkpoint complete: the heartbeat publishes it then, once, not a period later."""
    job = make_job(train__steps=8, checkpoint__interval=100)
    seen = [0]
    trainer = Trainer(job, sinks=[lambda s: seen.__setitem__(0, 7 if s["step"] >= 3 else 0)])
    lease = _Lease()
    trainer.heartbeat = lease  # type: ignore[assignment]
    trainer.requests = CheckpointRequests(lambda: seen[0], None)
    trainer.run()
    assert lease.soon == [4]  # step_4 saved on request, told once as it completed
