"""The launchers' watch on their neighbours (hlat_trainer.peers), on real sockets on loopback:
a neighbour whose kernel answers (a connection accepted, or refused) is reachable whatever its
processes do; one that does not answer (here: a listener whose backlog is full, so the kernel
drops the connection) is reported once it was reached and then not for PEER_LOST_SECONDS, and
the report is cleared when it answers again."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

import pytest

from hlat_api.gang import GangRecord
from hlat_trainer.peers import PeerWatch, neighbours, reachable

Reports = list[tuple[int, int, list[int], datetime | None]]


@contextmanager
def silent_address() -> Iterator[tuple[str, int]]:
    """A loopback address that answers no new connection: a listener with a full backlog."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        address = srv.getsockname()
        held = []
        for _ in range(4):  # fill the backlog (its size is the kernel's business)
            try:
                held.append(socket.create_connection(address, timeout=0.2))
            except OSError:
                break
        try:
            yield address
        finally:
            for conn in held:
                conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_kernel_that_answers_is_reachable_one_that_does_not_is_not() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        assert reachable(srv.getsockname(), 0.3)  # accepted
    assert reachable(("127.0.0.1", free_port()), 0.3)  # refused: the node is there
    with silent_address() as silent:
        started = time.monotonic()
        assert not reachable(silent, 0.3)
        assert time.monotonic() - started < 1.0  # bounded by the probe's timeout


def test_each_node_watches_the_ranks_beside_it_in_a_ring() -> None:
    assert neighbours(0, 4) == [1, 3] and neighbours(3, 4) == [0, 2]
    assert neighbours(0, 2) == [1] and neighbours(0, 1) == []


def test_a_neighbour_reached_then_silent_is_reported_after_the_bound_and_cleared_after(
) -> None:
    reports: Reports = []
    answering = {"tiny-1.tiny": True, "tiny-2.tiny": True}
    watch = PeerWatch("tiny", 3, lambda *r: reports.append(r) is None, lost_after=2.0,
                      address=lambda host: (host, 0),
                      connect=lambda address, _: answering[address[0]])
    assert watch.probe(now=time.monotonic()) == [] and reports == []  # not following yet
    watch.follow(0, 0)
    watch.probe()
    answering["tiny-1.tiny"] = False
    now = time.monotonic()
    assert watch.probe(now=now + 1.0) == [] and reports == []  # silent, within the bound
    assert watch.probe(now=now + 2.5) == [1]
    assert len(reports) == 1 and reports[0][:3] == (0, 0, [1])
    assert watch.probe(now=now + 3.0) == [1] and len(reports) == 1  # reported once
    answering["tiny-1.tiny"] = True
    assert watch.probe() == [] and reports[-1][:3] == (0, 0, [])  # cleared


def test_a_neighbour_never_reached_in_this_attempt_is_never_reported() -> None:
    """A new attempt (or a new rank) starts over: its neighbours must answer once first (one
    still starting, or replaced, has its own startup timeout)."""
    reports: Reports = []
    up = {"tiny-1.tiny": True}
    watch = PeerWatch("tiny", 2, lambda *r: reports.append(r) is None,
                      address=lambda host: (host, 0), connect=lambda a, _: up[a[0]])
    watch.follow(0, 0)
    watch.probe()
    watch.follow(1, 0)
    up["tiny-1.tiny"] = False
    assert watch.probe(now=time.monotonic() + 60) == [] and reports == []


def test_a_report_the_api_server_refused_is_made_again() -> None:
    reports: Reports = []
    written = iter([False, True])
    up = {"tiny-1.tiny": True}
    watch = PeerWatch("tiny", 2, lambda *r: reports.append(r) is None and next(written),
                      address=lambda host: (host, 0), connect=lambda a, _: up[a[0]])
    watch.follow(0, 0)
    watch.probe()
    up["tiny-1.tiny"] = False
    later = time.monotonic() + 5
    watch.probe(now=later)
    watch.probe(now=later)
    watch.probe(now=later)
    assert [r[2] for r in reports] == [[1], [1]]


def test_a_rank_a_spare_took_is_watched_at_the_spare_s_hostname() -> None:
    watch = PeerWatch("tiny", 3, lambda *r: True)
    assert watch.hosts(0) == {1: "tiny-1.tiny", 2: "tiny-2.tiny"}
    watch.seen(GangRecord(attempt=2, ranks={"tiny-s0": 1, "tiny-a0-0": 0}))
    assert watch.hosts(0) == {1: "tiny-s0.tiny", 2: "tiny-2.tiny"}


@pytest.mark.parametrize("silent", [False, True])
def test_two_launchers_on_loopback(silent: bool) -> None:
    """Real listeners and probes: a neighbour whose launcher listens (or whose port is closed:
    refused) is never reported; one whose connections go unanswered is, within the bound plus
    a probe round."""
    reports: Reports = []
    port = free_port()
    other = PeerWatch("tiny", 2, lambda *r: True, port=port).start()
    try:
        with silent_address() as mute:
            target = {"tiny-1.tiny": ("127.0.0.1", port)}
            watch = PeerWatch("tiny", 2, lambda *r: reports.append(r) is None, period=0.2,
                              lost_after=1.0, address=lambda host: target[host])
            watch.follow(0, 0)
            watch.start()
            try:
                time.sleep(0.6)
                if silent:
                    target["tiny-1.tiny"] = mute
                else:
                    other.stop()  # the launcher is gone, the kernel refuses: still there
                deadline = time.monotonic() + 4.0
                while time.monotonic() < deadline and not reports:
                    time.sleep(0.1)
            finally:
                watch.stop()
    finally:
        other.stop()
    assert [r[2] for r in reports] == ([[1]] if silent else []), reports


def test_a_name_that_stops_resolving_is_no_evidence_its_last_address_is_probed() -> None:
    """DNS slow or away: the neighbour is probed at the address it had in this attempt, and is
    reported only if that goes silent; never reported for the lookup alone."""
    reports: Reports = []
    resolving = {"tiny-1.tiny": True}
    answering = {("10.0.0.1", 0): True}
    watch = PeerWatch("tiny", 2, lambda *r: reports.append(r) is None,
                      address=lambda host: ("10.0.0.1", 0) if resolving[host] else None,
                      connect=lambda address, _: answering[address])
    watch.follow(0, 0)
    start = time.monotonic()
    watch.probe(now=start)
    resolving["tiny-1.tiny"] = False
    assert watch.probe(now=start + 10) == [] and reports == []  # the old address answers
    answering[("10.0.0.1", 0)] = False
    assert watch.probe(now=start + 20) == [1]
