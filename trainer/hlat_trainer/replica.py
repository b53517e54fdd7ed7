"""Snapshot replicas: every node's in-memory snapshots copied into its ring successor's memory,
so that a node that is lost (its rank taken by a promoted spare, or by a pod made again) resumes
from a peer's memory instead of the durable checkpoint.

The launcher (hlat-launch, in-place restarts with checkpoint.memoryReplicas) runs both sides,
off the training loop: its trainers write their snapshots (`hlat_trainer.snapshot`) and go on.

- `Replicator`: every `SCAN_SECONDS` it looks for the newest whole snapshot file of each of its
  node's ranks and, when it is new, pushes it to the node one rank above (in a ring). It pushes
  the newest only: a push slower than a step skips the steps in between.
- `ReplicaServer` on `REPLICA_PORT`: it takes pushes into `<snapshot dir>/<job>/replica/
  rank_<r>/step_<N>.pt` (the newest `SNAPSHOTS_KEPT` of each rank) and serves them back.
- `restore`: a launcher whose ranks hold no snapshot (it has just taken them) fetches every
  replica of those ranks from the node above before its trainers start; the trainers then
  resume as from their own memory (`Engine.resume`: the newest step every rank holds, of this
  run's layout, not older than the durable checkpoint), with no byte read from the volume.

Integrity: a copy is written under a temporary name and takes its final name only once its
length and SHA-256 (sent after the bytes) match; a connection cut mid-copy (the sender or the
holder killed) leaves the holder's previous copies whole, and a torn file is never used. The
snapshot's own step and layout are checked again when it is read (`Snapshots.read`).

Fencing: a holder refuses the pushes of an attempt older than the newest it has seen (its own
node's, or a pusher's): the launcher of an ended attempt cannot overwrite what the next one
restores from.

Protocol: one request per TCP connection, a JSON line and then bytes.
`{"op": "put", "job", "rank", "step", "attempt", "size"}`, `size` bytes, `{"sha256"}` ->
`{"ok": true}` or `{"ok": false, "error"}`. `{"op": "get", "job", "rank"}` -> for each copy
held, oldest first, `{"step", "size", "sha256"}` and `size` bytes; then `{"end": true}`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable
from io import BufferedIOBase
from pathlib import Path
from typing import Any

from hlat_api.gang import GangRecord
from hlat_api.heartbeat import REPLICA_PORT
from hlat_api.spec import SNAPSHOTS_KEPT
from hlat_trainer.peers import Listener, peer_host

log = logging.getLogger(__name__)

SCAN_SECONDS = 0.02
"""How often a launcher looks for a new snapshot to push (a directory listing per local rank:
a copy that starts a step late may miss the step every other rank still holds)."""
IO_TIMEOUT_SECONDS = 10.0
"""Longest silence on a replica connection (connect, or any read or write) before it is given
up: a peer that stops answering mid-copy leaves no waiter behind."""
MAX_REQUESTS = 8
"""Requests a holder serves at once, a thread each. Its predecessor pushes one rank at a time
and a restoring node fetches one at a time, so a few are all there should be; beyond the bound
a connection is refused at once (a pusher tries again at its next round), so that a flood of
connections cannot take the launcher's threads and memory."""
CHUNK = 1 << 20
_NAME = re.compile(r"step_(\d+)\.pt")
_HEADER_LIMIT = 1 << 16


class ReplicaError(Exception):
    """A copy that did not complete (refused, cut, or not matching its checksum)."""


def successor(rank: int, nnodes: int) -> int:
    """The node rank that holds node `rank`'s replicas."""
    return (rank + 1) % nnodes


def _steps(directory: Path) -> list[int]:
    """The steps of the whole snapshot files in `directory`, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := _NAME.fullmatch(n))), reverse=True)


def own_dir(root: Path, job: str, rank: int) -> Path:
    """Rank `rank`'s own snapshots (`snapshot.Snapshots`' directory)."""
    return root / job / f"rank_{rank:05d}"


def replica_dir(root: Path, job: str, rank: int) -> Path:
    """The copies of rank `rank`'s snapshots a holder keeps."""
    return root / job / "replica" / f"rank_{rank:05d}"


RESIZE_DIR = "resize"
"""Under `<root>/<job>/`: the old world's snapshots a launcher staged for a resized attempt."""
RESIZE_MARKER = "world.json"


def staged_path(root: Path, job: str, rank: int, step: int) -> Path:
    """Old rank `rank`'s snapshot of step `step`, staged for a resize."""
    return root / job / RESIZE_DIR / f"rank_{rank:05d}" / f"step_{step}.pt"


def staged(root: Path, job: str) -> tuple[int, int] | None:
    """(step, old world size) of the snapshots staged for this attempt's resize: step 0 when
    the launcher staged none it could use; None when this attempt is not a resize."""
    try:
        said = json.loads((root / job / RESIZE_DIR / RESIZE_MARKER).read_text())
        return int(said["step"]), int(said["world"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("the staged snapshots' marker is unreadable (%s): none used", err)
        return 0, 0


def _send(stream: BufferedIOBase, obj: dict[str, Any]) -> None:
    stream.write(json.dumps(obj).encode() + b"\n")


def _receive(stream: BufferedIOBase) -> dict[str, Any]:
    line = stream.readline(_HEADER_LIMIT)
    if not line.endswith(b"\n"):
        raise ReplicaError("connection closed mid-message")
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ReplicaError(f"not a message: {line[:80]!r}")
    return obj


def _copy_in(stream: BufferedIOBase, size: int, path: Path) -> str:
    """`size` bytes from `stream` into `path` (a temporary name); their SHA-256."""
    digest = hashlib.sha256()
    left = size
    with open(path, "wb") as out:
        while left:
            chunk = stream.read(min(CHUNK, left))
            if not chunk:
                raise ReplicaError(f"connection closed with {left} of {size} bytes to come")
            digest.update(chunk)
            out.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _skip(stream: BufferedIOBase, size: int) -> None:
    """Read and drop `size` bytes, less at the stream's end."""
    while size > 0 and (chunk := stream.read(min(CHUNK, size))):
        size -= len(chunk)


def _copy_out(f: BufferedIOBase, write: Callable[[bytes], object]) -> tuple[int, str]:
    """Send the open file's bytes with `write`; (bytes sent, their SHA-256)."""
    digest = hashlib.sha256()
    sent = 0
    while chunk := f.read(CHUNK):
        digest.update(chunk)
        write(chunk)
        sent += len(chunk)
    return sent, digest.hexdigest()


def _land(partial: Path, final: Path, keep: int) -> None:
    """Give a verified copy its final name and drop the oldest beyond `keep`."""
    os.replace(partial, final)
    for old in _steps(final.parent)[keep:]:
        (final.parent / f"step_{old}.pt").unlink(missing_ok=True)


class ReplicaServer:
    """The holder's side: takes its predecessor's pushes and serves them back."""

    def __init__(self, root: Path, job: str, port: int = REPLICA_PORT,
                 keep: int = SNAPSHOTS_KEPT, max_requests: int = MAX_REQUESTS) -> None:
        self.root, self.job, self.port, self.keep = root, job, port, keep
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._newest: dict[str, int] = {}  # job -> newest attempt seen
        self._slots = threading.BoundedSemaphore(max_requests)
        self._busy_said = False
        self._listener = Listener(port, self._accept, "hlat-replica-listen")

    def _accept(self, conn: socket.socket) -> None:
        """In the listener's thread: a thread for the request, or a refusal when
        `max_requests` are in progress."""
        if not self._slots.acquire(blocking=False):
            if not self._busy_said:  # once a burst
                self._busy_said = True
                log.warning("snapshot replicas: %d requests in progress: refusing more",
                            self.max_requests)
            with conn, contextlib.suppress(OSError):
                conn.settimeout(1.0)
                conn.sendall(json.dumps({"ok": False, "error": f"busy: {self.max_requests} "
                                                               "requests in progress"}
                                        ).encode() + b"\n")
            return
        self._busy_said = False
        threading.Thread(target=self._serve_one, args=(conn,), name="hlat-replica-conn",
                         daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        finally:
            self._slots.release()

    def follow(self, job: str, attempt: int) -> None:
        """This node runs `attempt` of `job` now: older attempts' pushes are refused."""
        self._admit(job, attempt)

    def _admit(self, job: str, attempt: int) -> bool:
        with self._lock:
            newest = self._newest.get(job, attempt)
            if attempt < newest:
                return False
            self._newest[job] = attempt
            return True

    def start(self) -> ReplicaServer:
        err = self._listener.start()
        if err is not None:  # this node's predecessor will find no holder: its rank resumes
            # from the durable checkpoint if its node is lost
            log.warning("snapshot replicas: cannot listen on port %d (%s): this node holds "
                        "no copy of its peer's snapshots", self.port, err)
        self.port = self._listener.port
        return self

    def stop(self) -> None:
        self._listener.stop()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_SECONDS)
        with conn, conn.makefile("rwb") as stream:
            try:
                request = _receive(stream)
                if request.get("job") != self.job:  # the name becomes a path: this job's only
                    if request.get("op") == "put":  # read to its end: a reply, not a reset
                        _skip(stream, int(request.get("size", 0)))
                        stream.readline(_HEADER_LIMIT)
                    _send(stream, {"ok": False, "error": f"this node holds copies of job "
                                                        f"{self.job!r} only"})
                elif request.get("op") == "put":
                    self._put(request, stream)
                elif request.get("op") == "get":
                    self._get(request, stream)
                elif request.get("op") == "list":
                    self._list(stream)
                else:
                    _send(stream, {"ok": False, "error": f"unknown op {request.get('op')!r}"})
                stream.flush()
            except (OSError, ValueError, ReplicaError) as err:
                log.warning("snapshot replicas: a request failed (%s)", err)

    def _put(self, request: dict[str, Any], stream: BufferedIOBase) -> None:
        job, rank, step = str(request["job"]), int(request["rank"]), int(request["step"])
        attempt, size = int(request["attempt"]), int(request["size"])
        directory = replica_dir(self.root, job, rank)
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"step_{step}.{threading.get_ident()}.tmp"
        try:
            got = _copy_in(stream, size, partial)
            said = str(_receive(stream).get("sha256"))
            if got != said:
                raise ReplicaError(f"rank {rank} step {step}: SHA-256 {got[:12]}... does not "
                                   f"match the sender's {said[:12]}...")
            if not self._admit(job, attempt):
                _send(stream, {"ok": False, "error": f"attempt {attempt} of {job} is over"})
                return
            _land(partial, directory / f"step_{step}.pt", self.keep)
        finally:
            partial.unlink(missing_ok=True)
        _send(stream, {"ok": True})

    def _list(self, stream: BufferedIOBase) -> None:
        _send(stream, {"ok": True, **inventory(self.root, self.job)})

    def _get(self, request: dict[str, Any], stream: BufferedIOBase) -> None:
        job, rank = str(request["job"]), int(request["rank"])
        directory = (own_dir if request.get("kind") == "own" else replica_dir)(self.root, job,
                                                                              rank)
        only = request.get("step")
        for step in reversed(_steps(directory)):
            if only is not None and step != int(only):
                continue
            path = directory / f"step_{step}.pt"
            # opened before its header is sent: a copy dropped meanwhile by a newer one is
            # skipped (the rest are newer), and one open stays readable to its end
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                _send(stream, {"step": step, "size": size})
                sent, digest = _copy_out(f, stream.write)
                if sent != size:  # cannot happen: copies are renamed into place whole
                    raise ReplicaError(f"{path} changed while sent")
                _send(stream, {"sha256": digest})
        _send(stream, {"end": True})


def _connect(address: tuple[str, int]) -> socket.socket:
    try:
        conn = socket.create_connection(address, timeout=IO_TIMEOUT_SECONDS)
    except OSError as err:
        raise ReplicaError(f"cannot reach {address[0]}:{address[1]} ({err})") from err
    conn.settimeout(IO_TIMEOUT_SECONDS)
    return conn


def push(address: tuple[str, int], job: str, rank: int, step: int, attempt: int,
         path: Path) -> int:
    """Copy one snapshot file to the holder at `address`; the bytes sent. Raises ReplicaError
    unless the holder has it whole under its final name, FileNotFoundError when the file is
    gone (the trainer dropped it for newer ones: the pusher takes the newest again)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            answer = _put(address, f, {"op": "put", "job": job, "rank": rank, "step": step,
                                       "attempt": attempt, "size": size})
        except (OSError, ValueError) as err:
            raise ReplicaError(f"rank {rank} step {step}: {err}") from err
    if not answer.get("ok"):
        raise ReplicaError(f"rank {rank} step {step}: refused ({answer.get('error')})")
    return size


def _put(address: tuple[str, int], f: BufferedIOBase, head: dict[str, Any]
         ) -> dict[str, Any]:
    """Send `head`, the file's bytes and their SHA-256; the holder's answer."""
    with _connect(address) as conn, conn.makefile("rb") as replies:
        try:  # unbuffered sends: a refusal's reply stays readable after a broken pipe
            conn.sendall(json.dumps(head).encode() + b"\n")
            _, digest = _copy_out(f, conn.sendall)
            conn.sendall(json.dumps({"sha256": digest}).encode() + b"\n")
        except OSError:  # a holder that refused at once closed its end: its reason
            return _receive(replies)
        return _receive(replies)


def fetch(address: tuple[str, int], job: str, rank: int, into: Path, kind: str = "replica",
          step: int | None = None) -> list[int]:
    """Every copy of rank `rank`'s snapshots the holder at `address` has (its copies of a
    peer's, or with `kind` "own" those its own trainers wrote; only step `step`'s when given),
    written whole into `into`; the steps fetched, newest first. A copy cut short or not
    matching its checksum is not written; those before it are kept."""
    into.mkdir(parents=True, exist_ok=True)
    got: list[int] = []
    try:
        with _connect(address) as conn, conn.makefile("rwb") as stream:
            _send(stream, {"op": "get", "job": job, "rank": rank, "kind": kind, "step": step})
            stream.flush()
            while "end" not in (header := _receive(stream)):
                if header.get("ok") is False:
                    raise ReplicaError(f"rank {rank}: refused ({header.get('error')})")
                held, size = int(header["step"]), int(header["size"])
                partial = into / f"step_{held}.fetch.tmp"
                try:
                    digest = _copy_in(stream, size, partial)
                    said = str(_receive(stream).get("sha256"))
                    if digest != said:
                        raise ReplicaError(f"step {held}: SHA-256 does not match the holder's")
                    _land(partial, into / f"step_{held}.pt", SNAPSHOTS_KEPT)
                finally:
                    partial.unlink(missing_ok=True)
                got.append(held)
    except (OSError, ValueError) as err:
        raise ReplicaError(f"rank {rank}: {err}") from err
    return sorted(got, reverse=True)


def resolve(host: str, port: int = REPLICA_PORT) -> tuple[str, int] | None:
    try:
        sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4]
    except OSError:
        return None
    return str(sockaddr[0]), int(sockaddr[1])


Held = dict[str, dict[int, dict[int, int]]]
"""What a pod holds: by kind ("own": its trainers' snapshots, "replica": its copies of a
peer's), global rank and step, the file's size in bytes."""


def inventory(root: Path, job: str) -> Held:
    """The whole snapshot files this pod holds."""
    out: Held = {"own": {}, "replica": {}}
    for kind, parent in (("own", root / job), ("replica", root / job / "replica")):
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(parent):
                if m := re.fullmatch(r"rank_(\d+)", name):
                    sizes = {}
                    for step in _steps(parent / name):
                        with contextlib.suppress(FileNotFoundError):
                            sizes[step] = (parent / name / f"step_{step}.pt").stat().st_size
                    if sizes:
                        out[kind][int(m.group(1))] = sizes
    return out


def _inventory_of(address: tuple[str, int], job: str) -> Held:
    try:
        with _connect(address) as conn, conn.makefile("rwb") as stream:
            _send(stream, {"op": "list", "job": job})
            stream.flush()
            answer = _receive(stream)
        if not answer.get("ok"):
            raise ReplicaError(f"refused ({answer.get('error')})")
        return {kind: {int(r): {int(s): int(n) for s, n in dict(sizes).items()}
                       for r, sizes in dict(answer[kind]).items()} for kind in ("own", "replica")}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ReplicaError(str(err)) from err


def memory_headroom() -> int:
    """Bytes this pod may still take into memory: its cgroup's limit less its use (a memory
    file system's pages count there), else the node's MemAvailable."""
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            return max(0, int(limit) - used)
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(n for n in Path("/proc/meminfo").read_text().splitlines()
                    if n.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return 0


def gather(root: Path, job: str, sources: dict[int, list[tuple[str, str]]], nproc: int,
           here: str, address: Callable[[str], tuple[str, int] | None] = resolve,
           headroom: Callable[[], int] = memory_headroom,
           say: Callable[[str], None] = log.info) -> int:
    """Stage a shrunk attempt's snapshots of the old world (`staged`): of the newest step
    every old rank is held at, each old rank's file, linked from this pod (`here`: its host)
    or fetched from a peer, into `<job>/resize/`, and the marker naming the step and the old
    world. `sources`: by old node rank, the (host, kind) that may hold its ranks' files: the
    pod that ran it ("own") and the one that held its copies ("replica"), only pods of the new
    attempt (a lost pod is asked nothing); this pod's files are taken first, then in order. Every node stages the whole old world
    (the weights are cut over all old dp ranks, and which old rank held the optimizer entries
    a rank now owns is the trainer's to work out): nothing is fetched unless it fits in half
    the pod's memory headroom (`memory_headroom`), the other half left to the trainers. Returns
    the step staged, 0 when none could be (said; the marker says 0 and the trainers resume
    from the durable checkpoint). Each request is bounded by IO_TIMEOUT_SECONDS of silence."""
    began = time.monotonic()
    staging = root / job / RESIZE_DIR
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    world = len(sources) * nproc
    held: dict[str, Held] = {}
    for host in sorted({h for options in sources.values() for h, _ in options}):
        where = None if host == here else address(host)
        try:
            held[host] = (inventory(root, job) if host == here else
                          _inventory_of(where, job) if where is not None else {})
        except ReplicaError as err:
            say(f"snapshot replicas: {host} did not say what it holds ({err})")

    def found(rank: int) -> list[tuple[str, str, dict[int, int]]]:
        """Where old rank `rank`'s files are, this pod's first (linked, not fetched)."""
        return sorted(((h, kind, held.get(h, {}).get(kind, {}).get(rank, {}))
                       for h, kind in sources[rank // nproc]), key=lambda o: o[0] != here)

    common = set.intersection(*({s for _, _, sizes in found(r) for s in sizes}
                                for r in range(world))) if world else set()
    step = max(common, default=0)
    why = f"no step is held of every one of the {world} old ranks"
    if step:
        remote = sum(next(sizes[step] for _, _, sizes in found(r) if step in sizes)
                     for r in range(world)
                     if all(h != here for h, _, sizes in found(r) if step in sizes))
        if remote > (room := headroom()) // 2:
            why = (f"step_{step}'s {remote / 2**20:.0f} MiB to fetch exceed half the pod's "
                   f"memory headroom ({room / 2**20:.0f} MiB)")
            step = 0
    fetched = 0
    for rank in range(world if step else 0):
        into = staged_path(root, job, rank, step)
        into.parent.mkdir(parents=True, exist_ok=True)
        for host, kind, sizes in found(rank):
            if step not in sizes:
                continue
            try:
                if host == here:
                    os.link((own_dir if kind == "own" else replica_dir)(root, job, rank)
                            / f"step_{step}.pt", into)
                else:
                    if (where := address(host)) is None:
                        raise ReplicaError(f"{host} does not resolve")
                    fetch(where, job, rank, into.parent, kind, step)
                    fetched += into.stat().st_size
            except (OSError, ReplicaError) as err:
                say(f"snapshot replicas: old rank {rank}'s step_{step} from {host} failed "
                    f"({err})")
                continue
            break
        else:
            why, step = f"old rank {rank}'s step_{step} could not be had", 0
    marker = staging / RESIZE_MARKER
    marker.with_suffix(".tmp").write_text(json.dumps({"step": step, "world": world}))
    os.replace(marker.with_suffix(".tmp"), marker)
    if step:
        say(f"snapshot replicas: staged step_{step} of the {world} old ranks for the resize "
            f"({fetched / 2**20:.1f} MiB fetched in {time.monotonic() - began:.2f}s)")
    else:
        say(f"snapshot replicas: nothing staged for the resize ({why}): the trainers resume "
            "from the durable checkpoint")
    return step


def unstage(root: Path, job: str) -> None:
    """Drop what an earlier resize staged: this attempt is not one."""
    shutil.rmtree(root / job / RESIZE_DIR, ignore_errors=True)


class Replicator:
    """The pusher's side: this node's newest snapshots to the node above, in a thread."""

    def __init__(self, root: Path, job: str, nnodes: int, nproc: int,
                 address: Callable[[str], tuple[str, int] | None] = resolve,
                 period: float = SCAN_SECONDS) -> None:
        self.root, self.job, self.nnodes, self.nproc = root, job, nnodes, nproc
        self.address, self.period = address, period
        self._lock = threading.Lock()
        self._target: tuple[int, int] | None = None  # (attempt, node rank)
        self._record: GangRecord | None = None
        self._pushed: dict[int, int] = {}  # global rank -> step its holder has
        self._pushing: tuple[int, int] | None = None
        self._failing: str | None = None
        self._stop = threading.Event()
        self.pushes = 0

    def follow(self, attempt: int, node_rank: int) -> None:
        with self._lock:
            if self._target != (attempt, node_rank):  # a new holder, maybe: push again
                self._pushed = {}
            self._target = (attempt, node_rank)

    def seen(self, record: GangRecord) -> None:
        with self._lock:
            if self._record is None or record.ranks != self._record.ranks:
                self._pushed = {}  # a spare took a rank: the holder may be another pod
            self._record = record

    def start(self) -> Replicator:
        threading.Thread(target=self._run, name="hlat-replica-push", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.round()
            except Exception as err:  # never stop replicating for one bad round
                log.warning("snapshot replicas: %s", err)

    def ranks(self, node_rank: int) -> range:
        return range(node_rank * self.nproc, (node_rank + 1) * self.nproc)

    def round(self) -> int:
        """Push each of this node's ranks' newest snapshot its holder lacks; how many."""
        with self._lock:
            target, record = self._target, self._record
        if target is None or self.nnodes < 2:
            return 0
        attempt, node_rank = target
        host = peer_host(self.job, record, successor(node_rank, self.nnodes))
        done = 0
        for rank in self.ranks(node_rank):
            steps = _steps(own_dir(self.root, self.job, rank))
            if not steps or self._pushed.get(rank) == steps[0]:
                continue
            address = self.address(host)
            if address is None:
                return done  # not resolvable now: next round
            try:
                push(address, self.job, rank, steps[0], attempt,
                     own_dir(self.root, self.job, rank) / f"step_{steps[0]}.pt")
            except FileNotFoundError:
                continue  # dropped by a newer snapshot meanwhile: next round pushes that
            except ReplicaError as err:
                if str(err) != self._failing:  # once per kind of failure, not every round
                    log.warning("snapshot replicas: push to %s failed (%s)", host, err)
                    self._failing = str(err)
                return done
            with self._lock:
                if self._target == target:
                    self._pushed[rank] = steps[0]
            self._failing = None
            self.pushes += 1
            done += 1
            self._check_lag(rank, steps[0])
        return done

    def _check_lag(self, rank: int, pushed: int) -> None:
        """Say once when a copy lands after the rank's next snapshot but one was written: the
        copies then lag more than the one snapshot the ranks can agree across, and a lost
        node's ranks would resume from the durable checkpoint."""
        newer = [s for s in _steps(own_dir(self.root, self.job, rank)) if s > pushed]
        if len(newer) >= 2 and not self.lagging:
            self.lagging = True
            log.warning("snapshot replicas: rank %d's copy of step %d landed after its "
                        "snapshots of steps %s: copies lag more than one snapshot, and a lost "
                        "node would resume from the durable checkpoint; raise "
                        "checkpoint.memoryInterval so that a snapshot's copy (its size over "
                        "the network's rate) takes less than the steps between two", rank,
                        pushed, ", ".join(map(str, sorted(newer))))

    lagging = False


def restore(root: Path, job: str, ranks: Iterable[int], holder: str,
            address: Callable[[str], tuple[str, int] | None] = resolve,
            say: Callable[[str], None] = log.info) -> dict[int, list[int]]:
    """For each of `ranks` that holds no snapshot of its own, fetch its replicas from the node
    at `holder`; the steps fetched by rank. Any failure is said and left: the trainers then
    resume from the durable checkpoint."""
    missing = [r for r in ranks if not _steps(own_dir(root, job, r))]
    if not missing:
        return {}
    where = address(holder)
    if where is None:
        say(f"snapshot replicas: {holder} does not resolve: no replica fetched")
        return {}
    out: dict[int, list[int]] = {}
    began = time.monotonic()
    for rank in missing:
        with contextlib.suppress(FileNotFoundError):
            for stale in own_dir(root, job, rank).glob("*.tmp"):
                stale.unlink()
        try:
            out[rank] = fetch(where, job, rank, own_dir(root, job, rank))
        except ReplicaError as err:
            say(f"snapshot replicas: fetching rank {rank}'s from {holder} failed ({err})")
    fetched = {r: s for r, s in out.items() if s}
    if fetched:
        size = sum(f.stat().st_size for r in fetched
                   for f in own_dir(root, job, r).glob("step_*.pt"))
        say(f"snapshot replicas: fetched {', '.join(f'rank {r} step {s[0]}' for r, s in fetched.items())} "
            f"from {holder} ({size / 2**20:.1f} MiB in {time.monotonic() - began:.2f}s)")
    return out
