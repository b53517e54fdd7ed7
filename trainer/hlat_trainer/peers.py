"""Peers: a node that is gone, found by its neighbours within seconds.

Each worker's launcher (hlat-launch, restarts in place) listens on `PEER_PORT` and, every
`PEER_PROBE_SECONDS`, connects to its two neighbours' (node ranks one below and one above, in a
ring, so every node is watched by two others). A connection accepted, or refused, is a
neighbour reached: its kernel answered, whatever its processes do, so a node whose trainers are
slow, starved or stopped is not reported (a launcher frozen whole still has its listen backlog,
`BACKLOG` connections: minutes of probes). A connection that times out or finds no route is
not: the node lost its power, its network, or its pod. A neighbour reached in this attempt and
then not for `PEER_LOST_SECONDS` is reported on this node's Lease (`Heartbeat.unreachable_ranks`
with the label `labels.REPORTED`), and the report is cleared once it is reached again.

The operator decides (`faults.unreachable_fault`): a node its peers report and that does not
report them back is lost, seconds after the loss instead of after the node lifecycle
controller's grace (40 s on EKS, 16 s on the local rig). Peers that report each other are cut
off from one another but both still reach the API server: not a lost node. A neighbour never
reached in this attempt (still starting, or replaced) is never reported: its startup has its
own timeout.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from hlat_api import labels
from hlat_api.gang import GangRecord
from hlat_api.heartbeat import PEER_LOST_SECONDS, PEER_PORT, PEER_PROBE_SECONDS

log = logging.getLogger(__name__)

BACKLOG = 4096
"""Connections the kernel holds for a launcher that accepts none (frozen): at two neighbours'
probes every half second, 17 minutes before a frozen launcher's node looks unreachable."""
_ANSWERED = (errno.ECONNREFUSED, errno.ECONNRESET)
"""A connection refused or reset: the neighbour's kernel answered."""

Report = Callable[[int, int, list[int], datetime | None], bool]
"""(attempt, this node's rank, unreachable ranks, when the first was last reached) -> whether
the report was written (else it is made again next round)."""


def neighbours(rank: int, nnodes: int) -> list[int]:
    """The node ranks a node watches: one below and one above, in a ring."""
    return sorted({(rank - 1) % nnodes, (rank + 1) % nnodes} - {rank})


def peer_host(job: str, record: GangRecord | None, rank: int) -> str:
    """Node rank `rank`'s host name (`<hostname>.<service>`) in `record`'s attempt: a rank a
    spare took is at the spare's."""
    holders = {r: pod for pod, r in (record.ranks if record else {}).items()}
    host = (labels.pod_hostname(job, holders[rank]) if rank in holders
            else None) or labels.worker_hostname(job, rank)
    return f"{host}.{labels.service_name(job)}"


class Listener:
    """A TCP listener on every address of the pod, each connection handed to `handle` in the
    listener's thread."""

    def __init__(self, port: int, handle: Callable[[socket.socket], None], name: str,
                 backlog: int = 64) -> None:
        self.port, self.handle, self.name, self.backlog = port, handle, name, backlog
        self._server: socket.socket | None = None
        self._stop = threading.Event()

    def start(self) -> OSError | None:
        """Listen, and accept in a thread; the error when the port cannot be had."""
        try:
            self._server = socket.create_server(("", self.port), backlog=self.backlog)
        except OSError as err:
            return err
        self.port = self._server.getsockname()[1]  # port 0: the one the kernel gave
        threading.Thread(target=self._serve, args=(self._server,), name=self.name,
                         daemon=True).start()
        return None

    def stop(self) -> None:
        """Close, waking the thread blocked in its accept (close alone may not)."""
        self._stop.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()

    def _serve(self, server: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed by stop()
            self.handle(conn)


def reachable(address: tuple[str, int], timeout: float) -> bool:
    """Whether a TCP connection to `address` is answered (accepted or refused) in `timeout`."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError as err:
        return err.errno in _ANSWERED


class PeerWatch:
    """One launcher's side: its listener, and the watch on its neighbours."""

    def __init__(self, job: str, nnodes: int, report: Report, port: int = PEER_PORT,
                 period: float = PEER_PROBE_SECONDS, lost_after: float = PEER_LOST_SECONDS,
                 address: Callable[[str], tuple[str, int] | None] | None = None,
                 connect: Callable[[tuple[str, int], float], bool] = reachable) -> None:
        self.job, self.nnodes, self.report, self.port = job, nnodes, report, port
        self.period, self.lost_after = period, lost_after
        self.address = address or self._resolve
        """A neighbour's host name -> the address to connect to (None: not resolvable now)."""
        self.connect = connect
        self._lock = threading.Lock()
        self._target: tuple[int, int] | None = None  # (attempt, this node's rank)
        self._record: GangRecord | None = None
        self._reached: dict[int, float] = {}  # rank -> when last reached (monotonic)
        self._reported: list[int] = []
        self._addresses: dict[str, tuple[str, int]] = {}  # host -> its address this attempt
        self._watching: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._listener = Listener(port, lambda conn: conn.close(), "hlat-peer-listen", BACKLOG)

    # --- what the agent tells it --------------------------------------------------------------

    def follow(self, attempt: int, rank: int) -> None:
        """This node runs `attempt` as node rank `rank` now."""
        with self._lock:
            self._target = (attempt, rank)

    def seen(self, record: GangRecord) -> None:
        """The latest restart record: which pods hold which ranks (a promoted spare's)."""
        with self._lock:
            self._record = record

    # --- threads ------------------------------------------------------------------------------

    def start(self) -> PeerWatch:
        err = self._listener.start()
        if err is not None:  # peers will never reach this node, so never report it
            log.warning("peer watch: cannot listen on port %d (%s): this node's neighbours "
                        "cannot vouch for it", self.port, err)
        threading.Thread(target=self._run, name="hlat-peer-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._listener.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.probe()
            except Exception as err:  # never stop watching for one bad round
                log.warning("peer watch: %s", err)

    # --- one round ----------------------------------------------------------------------------

    def hosts(self, rank: int) -> dict[int, str]:
        """This node's neighbours' host names (`<hostname>.<service>`): a rank a spare took is
        at the spare's."""
        with self._lock:
            record = self._record
        return {other: peer_host(self.job, record, other)
                for other in neighbours(rank, self.nnodes)}

    def probe(self, now: float | None = None) -> list[int]:
        """Connect to each neighbour once; report when the set of those unreachable changed.
        Returns that set."""
        with self._lock:
            target = self._target
        if target is None:
            return []
        if target != self._watching:  # a new attempt, or a new rank: nothing reached yet
            self._watching, self._reached, self._reported = target, {}, []
            self._addresses = {}
        attempt, rank = target
        silent = set()
        for other, host in self.hosts(rank).items():
            # a name that does not resolve now (DNS slow or away) is no evidence: the address
            # it had in this attempt is probed, and without one the neighbour is not judged
            address = self.address(host) or self._addresses.get(host)
            if address is None:
                continue
            self._addresses[host] = address
            if self.connect(address, self.period):
                self._reached[other] = time.monotonic() if now is None else now
            else:
                silent.add(other)
        clock = time.monotonic() if now is None else now
        lost = sorted(r for r, at in self._reached.items()
                      if clock - at >= self.lost_after and r in silent)
        if lost != self._reported:
            since = (datetime.now(UTC) - timedelta(seconds=clock - self._reached[lost[0]])
                     if lost else None)
            if self.report(attempt, rank, lost, since):
                self._reported = lost
        return lost

    def _resolve(self, host: str) -> tuple[str, int] | None:
        try:
            sockaddr = socket.getaddrinfo(host, self.port, type=socket.SOCK_STREAM)[0][4]
        except OSError:
            return None  # not resolvable now (DNS away, pod gone): neither reached nor not
        return str(sockaddr[0]), int(sockaddr[1])
