"""Snapshot replicas between launchers (hlat_trainer.replica), on real sockets on loopback and
real processes: a node's newest snapshots land whole in its successor's memory and come back
to a rank that lost its own; a copy cut mid-way (the pusher killed, the holder dying mid-reply)
or not matching its checksum is never used and leaves the previous copies whole; the launcher
of an ended attempt cannot overwrite what the next one restores from."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hlat_api.gang import GangRecord
from hlat_trainer import replica
from hlat_trainer.replica import (
    ReplicaError,
    ReplicaServer,
    Replicator,
    fetch,
    own_dir,
    push,
    replica_dir,
    restore,
)
from hlat_trainer.snapshot import Snapshots

JOB = "llm"


@dataclass
class Layout:
    dp: int = 2
    tp: int = 1


def _snapshot(root: Path, rank: int, step: int, fill: float = 0.0) -> Path:
    """Rank `rank`'s snapshot of `step`, written as the trainer writes it."""
    snaps = Snapshots(root, JOB, rank, Layout())
    snaps.save(step, {"w": torch.full((64, 64), fill + step), f"loop.rank{rank}": b"x" * 8})
    return own_dir(root, JOB, rank) / f"step_{step}.pt"


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[ReplicaServer]:
    server = ReplicaServer(tmp_path / "holder", JOB, port=0).start()
    yield server
    server.stop()


def _address(server: ReplicaServer) -> tuple[str, int]:
    return ("127.0.0.1", server.port)


def test_a_pushed_snapshot_comes_back_whole_and_loads(tmp_path: Path,
                                                     holder: ReplicaServer) -> None:
    path = _snapshot(tmp_path / "node1", rank=3, step=7)
    assert push(_address(holder), JOB, 3, 7, 0, path) == path.stat().st_size
    held = replica_dir(holder.root, JOB, 3) / "step_7.pt"
    assert held.read_bytes() == path.read_bytes()
    spare = tmp_path / "spare"
    assert fetch(_address(holder), JOB, 3, own_dir(spare, JOB, 3)) == [7]
    state = Snapshots(spare, JOB, 3, Layout()).read(7)
    assert state is not None and torch.equal(state["w"], torch.full((64, 64), 7.0))


def test_the_holder_keeps_the_two_newest_copies_and_a_fetch_brings_both(
        tmp_path: Path, holder: ReplicaServer) -> None:
    for step in (1, 2, 3):
        push(_address(holder), JOB, 0, step, 0, _snapshot(tmp_path / "n0", 0, step))
    assert sorted(os.listdir(replica_dir(holder.root, JOB, 0))) == ["step_2.pt", "step_3.pt"]
    assert fetch(_address(holder), JOB, 0, tmp_path / "into") == [3, 2]
    assert fetch(_address(holder), JOB, 5, tmp_path / "none") == []  # a rank it holds none of


def test_an_ended_attempt_cannot_overwrite_the_copies_the_next_one_restores_from(
        tmp_path: Path, holder: ReplicaServer) -> None:
    push(_address(holder), JOB, 0, 4, 1, _snapshot(tmp_path / "n0", 0, 4))
    holder.follow(JOB, 2)  # the holder's node runs attempt 2 now
    with pytest.raises(ReplicaError, match="attempt 1 of llm is over"):
        push(_address(holder), JOB, 0, 5, 1, _snapshot(tmp_path / "n0", 0, 5))
    assert sorted(os.listdir(replica_dir(holder.root, JOB, 0))) == ["step_4.pt"]
    push(_address(holder), JOB, 0, 6, 2, _snapshot(tmp_path / "n0", 0, 6))  # attempt 2's: taken
    assert fetch(_address(holder), JOB, 0, tmp_path / "into") == [6, 4]


_PUSH_HALF = textwrap.dedent("""
    import json, socket, sys, time
    host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    conn = socket.create_connection((host, port))
    head = {"op": "put", "job": "llm", "rank": 0, "step": 9, "attempt": 0, "size": size}
    conn.sendall(json.dumps(head).encode() + b"\\n" + b"\\0" * (size // 2))
    print("half", flush=True)
    time.sleep(60)
""")


def test_a_pusher_killed_mid_copy_leaves_the_holder_s_previous_copy_whole(
        tmp_path: Path, holder: ReplicaServer) -> None:
    push(_address(holder), JOB, 0, 8, 0, _snapshot(tmp_path / "n0", 0, 8))
    proc = subprocess.Popen([sys.executable, "-c", _PUSH_HALF, "127.0.0.1", str(holder.port),
                             str(1 << 22)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "half"
    directory = replica_dir(holder.root, JOB, 0)
    # the holder is mid-copy (its temporary file) before the kill: the pusher's bytes may
    # still sit in the socket's buffers when it says "half", and a check for no temporary
    # file made before the holder opened one passed too early (1 run in 6 here)
    deadline = time.monotonic() + 5
    while not any(n.endswith(".tmp") for n in os.listdir(directory)):
        assert time.monotonic() < deadline, os.listdir(directory)
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while any(n.endswith(".tmp") for n in os.listdir(directory)):  # the holder cleans up
        assert time.monotonic() < deadline, os.listdir(directory)
        time.sleep(0.05)
    assert os.listdir(directory) == ["step_8.pt"]
    assert fetch(_address(holder), JOB, 0, tmp_path / "into") == [8]


def test_a_copy_that_does_not_match_its_checksum_is_refused(tmp_path: Path,
                                                           holder: ReplicaServer) -> None:
    with socket.create_connection(_address(holder)) as conn:
        conn.sendall(json.dumps({"op": "put", "job": JOB, "rank": 0, "step": 3, "attempt": 0,
                                 "size": 4}).encode() + b"\nabcd"
                     + json.dumps({"sha256": "0" * 64}).encode() + b"\n")
        answer = conn.makefile("rb").readline()
    assert b"does not match" in answer or answer == b"", answer
    assert not os.listdir(replica_dir(holder.root, JOB, 0))


_SERVE_HALF = textwrap.dedent("""
    import json, socket, sys
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.makefile("rb").readline()
    whole = b"w" * 1000
    import hashlib
    conn.sendall(json.dumps({"step": 4, "size": 1000}).encode() + b"\\n" + whole
                 + json.dumps({"sha256": hashlib.sha256(whole).hexdigest()}).encode() + b"\\n"
                 + json.dumps({"step": 5, "size": 1000}).encode() + b"\\n" + b"t" * 400)
    conn.close()
""")


def test_a_holder_that_dies_mid_reply_leaves_only_whole_copies(tmp_path: Path) -> None:
    """The holder's process ends after one whole copy and part of the next: the whole one is
    kept, the torn one never gets its final name, and the fetch says it failed."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_HALF], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    into = tmp_path / "into"
    with pytest.raises(ReplicaError, match="600 of 1000 bytes"):
        fetch(("127.0.0.1", port), JOB, 0, into)
    proc.wait(timeout=10)
    assert sorted(os.listdir(into)) == ["step_4.pt"]


def test_the_replicator_pushes_each_rank_s_newest_whole_snapshot_to_the_node_above(
        tmp_path: Path, holder: ReplicaServer) -> None:
    """Node 0 of 2 (two ranks a node): its ranks' newest snapshots go to node 1's holder,
    resolved from the restart record (a promoted spare's host) or the worker's name."""
    root = tmp_path / "node0"
    asked = []

    def address(host: str) -> tuple[str, int]:
        asked.append(host)
        return _address(holder)

    pusher = Replicator(root, JOB, nnodes=2, nproc=2, address=address)
    assert pusher.round() == 0  # no attempt followed yet
    pusher.follow(attempt=0, node_rank=0)
    _snapshot(root, 0, 1)
    _snapshot(root, 0, 2)
    _snapshot(root, 1, 2)
    (own_dir(root, JOB, 1) / "step_3.tmp").write_bytes(b"torn")  # being written: not pushed
    assert pusher.round() == 2 and pusher.round() == 0  # nothing new the second time
    assert os.listdir(replica_dir(holder.root, JOB, 0)) == ["step_2.pt"]
    assert os.listdir(replica_dir(holder.root, JOB, 1)) == ["step_2.pt"]
    assert asked[-1] == "llm-1.llm", asked
    pusher.seen(GangRecord(attempt=1, ranks={"llm-s0": 1}))
    assert pusher.round() == 2  # a spare holds node rank 1 now: pushed to it again
    assert asked[-1] == "llm-s0.llm", asked


def test_restore_fetches_only_for_ranks_without_snapshots_of_their_own(
        tmp_path: Path, holder: ReplicaServer) -> None:
    for rank in (2, 3):
        push(_address(holder), JOB, rank, 5, 0, _snapshot(tmp_path / "lost", rank, 5))
    spare = tmp_path / "spare"
    _snapshot(spare, 3, 6)  # rank 3 holds one of its own: left alone
    said: list[str] = []
    got = restore(spare, JOB, [2, 3], "holder", address=lambda _: _address(holder),
                  say=said.append)
    assert got == {2: [5]}
    assert sorted(os.listdir(own_dir(spare, JOB, 2))) == ["step_5.pt"]
    assert sorted(os.listdir(own_dir(spare, JOB, 3))) == ["step_6.pt"]
    assert "fetched rank 2 step 5" in said[-1], said
    # a holder that cannot be reached: said, and nothing fetched (the durable checkpoint then)
    holder.stop()
    said.clear()
    assert restore(tmp_path / "other", JOB, [2], "holder",
                   address=lambda _: _address(holder), say=said.append) == {}
    assert "failed" in said[-1], said


def test_a_holder_serves_and_takes_its_own_job_s_copies_only(tmp_path: Path,
                                                            holder: ReplicaServer) -> None:
    """The job's name becomes a path on the holder: another name (or `..`) is refused."""
    path = _snapshot(tmp_path / "n0", 0, 1)
    for job in ("other", "../../escape"):
        with pytest.raises(ReplicaError, match="copies of job 'llm' only"):
            push(_address(holder), job, 0, 1, 0, path)
        with pytest.raises(ReplicaError, match="rank 0"):
            fetch(_address(holder), job, 0, tmp_path / "into")
    assert sorted(p.name for p in holder.root.rglob("*")) == [] or not holder.root.exists()


def test_the_successor_holds_a_node_s_copies_in_a_ring() -> None:
    assert [replica.successor(r, 3) for r in range(3)] == [1, 2, 0]


def test_copies_that_lag_more_than_one_snapshot_are_said_once(
        tmp_path: Path, holder: ReplicaServer, caplog: pytest.LogCaptureFixture) -> None:
    """A copy that lands after two newer snapshots were written: the ranks could not agree
    across it, and the warning says what to raise."""
    root = tmp_path / "node0"
    pusher = Replicator(root, JOB, nnodes=2, nproc=1, address=lambda _: _address(holder))
    pusher.follow(attempt=0, node_rank=0)
    _snapshot(root, 0, 1)
    assert pusher.round() == 1 and not caplog.records
    slow = replica.push

    def push_then_two_more(*args: object) -> int:
        sent = slow(*args)  # type: ignore[arg-type]
        _snapshot(root, 0, 3)  # the trainer went on while the copy was sent
        _snapshot(root, 0, 4)
        return sent

    _snapshot(root, 0, 2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replica, "push", push_then_two_more)
        assert pusher.round() == 1
        assert pusher.round() == 1
    said = [r.getMessage() for r in caplog.records if "lag more than one" in r.getMessage()]
    assert len(said) == 1 and "checkpoint.memoryInterval" in said[0], said


def test_a_holder_serves_a_bounded_number_of_requests_at_once_and_refuses_more(
        tmp_path: Path) -> None:
    """Connections that hold a request open (here: idle ones) take the holder's slots; one
    more is refused at once, nothing of it written; once they end, pushes land again."""
    server = ReplicaServer(tmp_path / "holder", JOB, port=0, max_requests=2).start()
    address = ("127.0.0.1", server.port)
    path = _snapshot(tmp_path / "node0", 0, 5)
    idle = [socket.create_connection(address) for _ in range(2)]
    try:
        time.sleep(0.3)  # both accepted and waiting for their request
        with pytest.raises(ReplicaError, match="busy: 2 requests in progress"):
            push(address, JOB, 0, 5, 0, path)
        assert not replica_dir(tmp_path / "holder", JOB, 0).exists() or not list(
            replica_dir(tmp_path / "holder", JOB, 0).glob("step_*.pt"))
    finally:
        for conn in idle:
            conn.close()
    deadline = time.monotonic() + 10
    while True:  # the idle connections' threads see their end and free their slots
        try:
            push(address, JOB, 0, 5, 0, path)
            break
        except ReplicaError:
            assert time.monotonic() < deadline, "the slots were never freed"
            time.sleep(0.1)
    assert (replica_dir(tmp_path / "holder", JOB, 0) / "step_5.pt").exists()
    server.stop()


def _copy(pod: Path, rank: int, step: int) -> None:
    """A copy of rank `rank`'s snapshot of `step` held by `pod` (as pushed to it)."""
    directory = replica_dir(pod, JOB, rank)
    directory.mkdir(parents=True, exist_ok=True)
    _snapshot(pod / "writer", rank, step).rename(directory / f"step_{step}.pt")


def test_a_shrink_stages_the_old_world_from_the_pods_left_and_the_lost_node_s_copies(
        tmp_path: Path) -> None:
    """3 nodes (a rank each), node 1 lost: pod a (node 0) holds rank 0's and its copies of
    rank 2's, pod c (node 2) rank 2's and its copies of rank 1's, the two newest of each. Pod
    a stages the newest step of all three: its own files linked, rank 1's fetched from c's
    copies (b, lost, is asked nothing), each whole; with a copy behind, the step before; with a
    fetch that would not fit in the pod's memory headroom, or the copies gone, nothing is
    staged and the marker says 0."""
    a, c = tmp_path / "a", tmp_path / "c"
    for step in (4, 5):
        _snapshot(a, 0, step)
        _snapshot(c, 2, step)
        _copy(a, 2, step)
        _copy(c, 1, step)
    server = ReplicaServer(c, JOB, port=0).start()
    try:
        sources = {0: [("a", "own")], 1: [("c", "replica")], 2: [("c", "own"), ("a", "replica")]}
        said: list[str] = []
        asked: list[str] = []

        def address(host: str) -> tuple[str, int]:
            asked.append(host)
            return _address(server)

        assert replica.gather(a, JOB, sources, 1, "a", address=address, say=said.append) == 5
        assert replica.staged(a, JOB) == (5, 3)
        for rank, origin in ((0, own_dir(a, JOB, 0)), (1, replica_dir(c, JOB, 1)),
                             (2, replica_dir(a, JOB, 2))):
            staged = replica.staged_path(a, JOB, rank, 5)
            assert staged.read_bytes() == (origin / "step_5.pt").read_bytes(), rank
        for rank, origin in ((0, own_dir(a, JOB, 0)), (2, replica_dir(a, JOB, 2))):
            assert replica.staged_path(a, JOB, rank, 5).stat().st_ino == (
                origin / "step_5.pt").stat().st_ino  # this pod's: linked, not copied
        assert set(asked) == {"c"} and "staged step_5 of the 3 old ranks" in said[-1], said

        remote = replica.staged_path(a, JOB, 1, 5).stat().st_size  # the one fetched
        assert replica.gather(a, JOB, sources, 1, "a", address=address,
                              headroom=lambda: remote * 3 // 2, say=said.append) == 0
        assert replica.staged(a, JOB) == (0, 3)
        assert "exceed half the pod's memory headroom" in said[-1], said
        assert not replica.staged_path(a, JOB, 1, 5).exists()

        assert replica.gather(a, JOB, sources, 1, "a", address=address,
                              headroom=lambda: remote * 2, say=said.append) == 5
        (replica_dir(c, JOB, 1) / "step_5.pt").unlink()  # a copy behind: the step before
        assert replica.gather(a, JOB, sources, 1, "a", address=address, say=said.append) == 4
        (replica_dir(c, JOB, 1) / "step_4.pt").unlink()
        assert replica.gather(a, JOB, sources, 1, "a", address=address, say=said.append) == 0
        assert "no step is held of every one of the 3 old ranks" in said[-1], said
    finally:
        server.stop()
    replica.unstage(a, JOB)
    assert replica.staged(a, JOB) is None
