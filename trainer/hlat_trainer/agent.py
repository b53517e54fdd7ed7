"""The in-place restart agent: `hlat-launch` under `faultTolerance.restartStrategy: InPlace`.

The pod outlives its trainers. The launcher starts the node's worker processes itself, each
with every variable torchrun gives a worker (`NodeLayout.worker_env`: the ranks and world
sizes, MASTER_ADDR/PORT, and the TORCHELASTIC_* ones; tests/trainer/test_worker_env_torchrun.py
diffs them against the real torchrun's), static rendezvous at node rank 0's stable hostname,
and supervises them. TORCHELASTIC_RUN_ID matters most: `torch.distributed.
is_torchelastic_launched()` tests only for it, and torch-xla's Neuron set-up gives each process
its own NeuronCore (NEURON_RT_VISIBLE_CORES=LOCAL_RANK) and its PJRT process index only when it
is true; without it the first worker reserves every core of the node and the others fail.
- The job's restart record (`hlat_api.gang`, a Lease the operator writes, read-only for
  workers) is watched (one long request per launcher; a new attempt is seen as soon as it is
  published); while no watch is established (the API server away, or the watch refused: then
  tried again after `leasewatch.REFUSED_RETRY_SECONDS`) it is polled every `POLL_SECONDS`
  (`FAILED_POLL_SECONDS` while this node's trainer has failed and the next attempt is
  awaited), each read on a thread of its own (`RecordRead`), so that a read held up to its
  bound by a slow API server never keeps the launcher from its workers, which are looked at
  every `CHECK_SECONDS`. When its attempt moves past the running one, every worker of the old
  attempt is stopped (SIGTERM to its process group, SIGKILL after
  `STOP_GRACE_SECONDS`: a worker stuck in a collective or frozen does not hold the restart),
  waited for until gone, and the new attempt's workers are started with its attempt, Lease
  name and HLAT_STEPS_DONE, on a fresh rendezvous (`RENDEZVOUS_PORTS`). Never two trainers
  for one rank: the new ones start only after the old ones are reaped.
- A worker that exits non-zero: its local peers are stopped (as torchrun does), the exit code
  is written to this node's Lease of that attempt, under the node rank it runs (a promoted
  spare's is the record's) (`Heartbeat.exit_code`, the `labels.TRAINER_EXITED` label, and
  `labels.REPORTED`, which the operator watches; `Heartbeat.exit_reason` `OOMKilled` when
  it died by SIGKILL and the container's memory cgroup counted an OOM kill since the attempt
  began, `hlat_trainer.oom`), and the launcher waits for the next
  attempt, at most `backoff.maxSeconds` + `WAIT_MARGIN_SECONDS`; then it exits with the code and
  the pod fails, which the operator handles by recreating it. `ExitCode.CONFIG_ERROR` exits at
  once (permanent), and so does `ExitCode.NODE_FAULT` (the pod must leave its node: a trainer
  restarted in place would meet the same device). All workers exiting 0 ends the pod successfully.
- Peers (`hlat_trainer.peers`, jobs of several nodes): the launcher listens on `PEER_PORT` and
  watches its two neighbours'; one it cannot reach any more is reported on its Lease
  (`Heartbeat.unreachable_ranks`), so that a lost node is acted on within seconds.
- Warm standby: for every local rank a process is kept started ahead of time with torch and
  the trainer imported (`hlat_trainer.standby`), waiting on its stdin for the attempt's
  environment; a restart costs the rendezvous and the checkpoint load, not the imports. The
  next standbys are started once the attempt's trainers have taken their first step (they say
  so with HLAT_STARTED_FILE), at most `STANDBY_DELAY_SECONDS` after the attempt began: starting
  one imports torch, which would take CPU from the attempt's own start; a fault before that
  restarts from a cold process. Each costs the
  memory of an idle interpreter with torch loaded (about 300 MiB on CPU).

The launcher's kubernetes client uses the pod's service-account token, as the heartbeat does;
every request is bounded (`hlat_api.apitimeouts`). Errors reaching the API server are logged
once per kind and retried at the next poll: training goes on meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from hlat_api import Env, ExitCode, Heartbeat, labels
from hlat_api.gang import GangRecord
from hlat_api.heartbeat import PREFIX
from hlat_trainer.errors import first_line
from hlat_trainer.leasewatch import watch_lease
from hlat_trainer.oom import OOM_KILLED, OomCounter
from hlat_trainer.peers import PeerWatch, peer_host
from hlat_trainer.replica import (
    ReplicaServer,
    Replicator,
    gather,
    restore,
    successor,
    unstage,
)

log = logging.getLogger("hlat_launch")

POLL_SECONDS = 0.5
"""How often the restart record is read (one GET per launcher)."""
FAILED_POLL_SECONDS = 0.1
"""How often while this node's trainer has failed and the next attempt is awaited (a few
seconds at most per fault: the operator publishes it within its backoff)."""
RECHECK_SECONDS = 10.0
"""While watching, the record is still read this often: a watch whose connection died
silently would otherwise hide a new attempt until its read timeout."""
CONNECT_SECONDS = 5.0
REPORT_TRIES = 3
"""Tries at reporting a trainer's exit on its Lease, POLL_SECONDS apart."""
CHECK_SECONDS = 0.05
"""How often the launcher looks at its own worker processes (no API request): a worker's exit
is reported within this, not within a record poll."""
RENDEZVOUS_PORTS = 16
"""Attempt N rendezvous at HLAT_MASTER_PORT + N % 16: a fresh store per attempt, so a
straggler of the previous attempt (a process still dying, reconnecting to the port it knew)
can never meet the new one's (a port reused at once let attempts stall at rendezvous)."""
STOP_GRACE_SECONDS = 5.0
WAIT_MARGIN_SECONDS = 120.0
STANDBY_DELAY_SECONDS = 60.0
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class Control(Protocol):
    """What the agent needs of the cluster."""

    @property
    def pushed(self) -> bool:
        """True while `record` answers from a watch (free to ask at any time); False: every
        call is a request, made at the poll interval."""

    def record(self, fresh: bool = False) -> GangRecord | None:
        """The job's restart record now (None: unreadable for the moment); `fresh`: read from
        the API server even while watching."""

    def report_exit(self, attempt: int, rank: int, code: int, reason: str | None = None
                    ) -> None:
        """Tell the operator the trainer of `attempt` on this node (node rank `rank` in it)
        exited with `code`, for `reason` where the launcher knows it (`oom.OOM_KILLED`)."""

    def report_unreachable(self, attempt: int, rank: int, ranks: list[int],
                           since: datetime | None) -> bool:
        """Tell the operator which neighbours this node cannot reach (`peers.PeerWatch`);
        True: written."""


class LeaseControl:
    """`Control` through the API server: the gang Lease (read) and this node's Leases."""

    def __init__(self, api: Any, namespace: str, gang_lease: str, job: str, node_rank: int
                 ) -> None:
        self.api, self.namespace, self.gang_lease = api, namespace, gang_lease
        self.job, self.node_rank = job, node_rank
        self._errors: set[str] = set()
        self._watched: GangRecord | None = None
        self._watching = False
        self._stopped = threading.Event()

    @property
    def pushed(self) -> bool:
        return self._watching

    def start_watch(self) -> None:
        """Watch the record on a daemon thread from now on (`record` then makes no request)."""
        threading.Thread(target=self._watch, name="hlat-gang-watch", daemon=True).start()

    def stop_watch(self) -> None:
        """No new watch request from now on (the one in flight ends by its own timeout)."""
        self._stopped.set()
        self._watching = False

    def _watch(self) -> None:
        def seen(lease: Any) -> None:
            self._watched = GangRecord.from_annotations(lease.metadata.annotations)
            self._watching = True

        def failed(err: Exception) -> None:  # polled meanwhile
            self._watching = False
            self._failed(f"watching Lease {self.gang_lease}", err)

        watch_lease(self.api, self.namespace, self.gang_lease, seen, failed, self._stopped,
                    POLL_SECONDS)

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> LeaseControl:
        from kubernetes import client, config

        from hlat_api.apitimeouts import bound_requests

        config.load_incluster_config()  # type: ignore[no-untyped-call]
        api = client.CoordinationV1Api(bound_requests(client.ApiClient()))
        control = cls(api, env.get(Env.NAMESPACE, "default"), env[Env.GANG_LEASE],
                      env[Env.JOB_NAME], int(env.get(Env.NODE_RANK) or 0))
        control.start_watch()
        return control

    def _failed(self, what: str, err: Exception) -> None:
        kind = what + type(err).__name__ + str(getattr(err, "status", ""))
        if kind not in self._errors:
            self._errors.add(kind)
            log.warning("%s failed (%s); retrying", what, first_line(err, 200))

    def record(self, fresh: bool = False) -> GangRecord | None:
        if self._watching and self._watched is not None and not fresh:
            return self._watched
        try:
            lease = self.api.read_namespaced_lease(self.gang_lease, self.namespace)
        except Exception as err:  # the API server's trouble must never stop training
            self._failed(f"reading Lease {self.gang_lease}", err)
            return None
        return GangRecord.from_annotations(lease.metadata.annotations)

    def report_exit(self, attempt: int, rank: int, code: int, reason: str | None = None
                    ) -> None:
        # the rank of the attempt, not the pod's first: a promoted spare was created as rank 0
        name = labels.worker_lease_name(self.job, attempt, rank)
        beat = Heartbeat(attempt=attempt, exit_code=code, exit_reason=reason)
        body = {"metadata": {"labels": {labels.TRAINER_EXITED: str(code),
                                        labels.REPORTED: "exit"},
                             "annotations": {k: v for k, v in beat.to_annotations().items()
                                             if k.endswith(("exit_code", "exit_reason",
                                                            "attempt"))}}}
        for tries in range(REPORT_TRIES):
            try:
                self.api.patch_namespaced_lease(name, self.namespace, body)
                return
            except Exception as err:
                status = getattr(err, "status", None)
                if status == 404:
                    return  # the attempt is over (its Lease deleted): nobody needs the report
                # refused: the Role names only the next attempt's Leases once that attempt
                # began (or, a moment, the API server's authorizer lags): nobody needs the
                # report once the record has moved on, and waiting for it here would keep
                # this launcher from starting the next attempt's trainer
                if status == 403 and self._moved_past(attempt):
                    return
                self._failed(f"reporting the exit on Lease {name}", err)
                if tries + 1 < REPORT_TRIES and self._wait_moved_past(attempt, POLL_SECONDS):
                    return

    def report_unreachable(self, attempt: int, rank: int, ranks: list[int],
                           since: datetime | None) -> bool:
        """Tell the operator which neighbours this node cannot reach (`peers.PeerWatch`), on
        the Lease of node rank `rank` in `attempt`; `[]` clears the report. The label stays
        once set (an exit report may have set it too): the operator then hears the Lease's
        renewals for the rest of the attempt. True: written."""
        name = labels.worker_lease_name(self.job, attempt, rank)
        beat = Heartbeat(unreachable_ranks=ranks, unreachable_since=since).to_annotations()
        keys = (PREFIX + "unreachable_ranks", PREFIX + "unreachable_since")
        meta: dict[str, Any] = {"annotations": {k: beat.get(k) for k in keys}}
        if ranks:
            meta["labels"] = {labels.REPORTED: "peers"}
        body = {"metadata": meta}
        try:
            self.api.patch_namespaced_lease(name, self.namespace, body)
        except Exception as err:  # the API server away: made again next round
            self._failed(f"reporting unreachable peers on Lease {name}", err)
            # a refusal that cannot change (403/404: the attempt is over; 422) is not made
            # again every half second; a conflict or throttling (409, 429) is
            status = getattr(err, "status", None)
            return isinstance(status, int) and 400 <= status < 500 and status not in (409, 429)
        return True

    def _moved_past(self, attempt: int) -> bool:
        record = self.record()
        return record is not None and record.attempt > attempt

    def _wait_moved_past(self, attempt: int, seconds: float) -> bool:
        """Wait up to `seconds`, looking at the record every FAILED_POLL_SECONDS; True as soon
        as it names a later attempt than `attempt`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(FAILED_POLL_SECONDS)
            if self._moved_past(attempt):
                return True
        return False


@dataclass(frozen=True)
class NodeLayout:
    """This node's place in the job (validated by hlat-launch)."""

    nnodes: int
    nproc: int
    node_rank: int
    master_addr: str
    master_port: int

    def worker_env(self, local_rank: int, master_port: int, run_id: str) -> dict[str, str]:
        """What torchrun sets for one worker process (torch 2.9, the Neuron image's:
        torch/distributed/elastic/agent/server/local_elastic_agent.py:305-326), for the
        equivalent line `hlat-launch` prints: `torchrun --max-restarts 0`, static rendezvous.
        `run_id`: the same in every worker of the attempt, on every node.

        The values that differ from torchrun's differ because no torchrun agent is there:
        - TORCHELASTIC_USE_AGENT_STORE is "False": under torchrun the agent hosts the
          rendezvous store and every worker is its client; here nobody else does, so rank 0
          must host it (torch/distributed/rendezvous.py:157-206 and torch-xla v2.9.0
          torch_xla/_internal/rendezvous.py:50-60 read it that way). "True" would leave
          every rank waiting for a store nobody serves.
        - TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS are "0", as the non-InPlace
          path's `torchrun --max-restarts 0` gives every attempt: each attempt is a new run
          the operator starts from the restart record (its number is HLAT_ATTEMPT), not a
          retry by an agent of its own; a count above the maximum would be a state torchrun
          never shows. torch-xla reads the count only for the agent store's key prefix
          (rendezvous.py:51-54), not used here.
        """
        world = self.nnodes * self.nproc
        rank = self.node_rank * self.nproc + local_rank
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_NAME": "default",  # torchrun's `--role` default
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(master_port),
            # what `torch.distributed.is_torchelastic_launched()` tests (torch 2.9,
            # torch/distributed/distributed_c10d.py:1279-1289), on which torch-xla v2.9.0's
            # Neuron set-up gives each worker its NeuronCore and PJRT process index
            # (torch_xla/_internal/neuron.py:49-89, run at `import torch_xla`,
            # torch_xla/__init__.py:119-140) and its "xla" rendezvous initialises the
            # process's PJRT client (torch_xla/_internal/rendezvous.py:26-32)
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }


def run_id_of(job: str, attempt: int) -> str:
    """TORCHELASTIC_RUN_ID of an attempt: the id of its rendezvous, the same on every node (as
    torchrun's `--rdzv-id`, which every node of a job is given alike), and new with each
    attempt, as each attempt's rendezvous is (a fresh port, RENDEZVOUS_PORTS) and as
    `torchrun --standalone` draws a new one per run (torch/distributed/run.py:913).
    Never empty: an empty value would still count as launched, but names nothing."""
    return f"{job or 'hlat'}-attempt-{attempt}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Standby:
    """A worker process started ahead of time: torch and the trainer imported, waiting on its
    stdin for the environment and arguments of the attempt it will run."""

    def __init__(self, env: Mapping[str, str], argv: Sequence[str] = ()) -> None:
        """`argv`: the trainer's arguments, for the standby to prepare what they name."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hlat_trainer.standby", *argv], env=dict(env),
            stdin=subprocess.PIPE, start_new_session=True)

    def go(self, env: Mapping[str, str], argv: Sequence[str]) -> subprocess.Popen[bytes]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"env": dict(env), "argv": list(argv)}) + "\n")
                                  .encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died while waiting: its exit code says so, as a worker's would
        return self.proc

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        stop_all([self.proc], 2.0)


def stop_all(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM (and SIGCONT, so a frozen process gets it) to each process group, SIGKILL to
    those still there after `grace`; returns when every process is reaped."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
                os.killpg(proc.pid, signal.SIGCONT)  # a frozen one acts on it only then
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group too: its data-loader children
        proc.wait()


class RecordRead:
    """One fresh read of the restart record, on a daemon thread of its own: a read can take up
    to its 30 s bound while the API server is slow, and the launcher must go on looking at its
    workers every CHECK_SECONDS meanwhile (nor wait for the read when it exits)."""

    def __init__(self, control: Control) -> None:
        self.record: GangRecord | None = None
        self.done = threading.Event()
        threading.Thread(target=self._read, args=(control,), name="hlat-record",
                         daemon=True).start()

    def _read(self, control: Control) -> None:
        try:
            self.record = control.record(fresh=True)
        finally:
            self.done.set()


@dataclass
class Agent:
    layout: NodeLayout
    argv: list[str]
    """The trainer's arguments (`--config FILE ...`)."""
    env: dict[str, str]
    """The environment every worker gets (the pod's, plus the computed device variables)."""
    control: Control
    wait_bound: float
    """Longest wait for the next attempt after this node's trainer failed."""
    warm: bool = True
    pod: str = ""
    """This pod's name: the restart record may give it another node rank (a promoted spare)."""
    spare: bool = False
    """A spare pod: no trainer until the restart record names this pod with a node rank."""
    clock: Callable[[], float] = time.monotonic
    attempt_env: Callable[[str, int, int, int], Mapping[str, str]] | None = None
    """Variables of one attempt, from node rank 0's address, this node's rank, the node count
    and the attempt number (hlat-launch: the Neuron runtime's NEURON_RT_ROOT_COMM_ID, an IP
    resolved when the attempt starts; on UltraServers the runtime's topology variables)."""
    standbys: list[Standby] = field(default_factory=list)
    standbys_due: float | None = None
    """When to start the next standbys at the latest (None: they run, or none are kept)."""
    started_file: Path | None = None
    scratch: Path | None = None
    exit_file: Path | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    oom: OomCounter = field(default_factory=OomCounter)
    """The container's OOM kills, marked at each attempt's start."""
    watch_peers: bool = False
    """Watch this node's neighbours (`peers.PeerWatch`, started by `run`): a job of several
    nodes."""
    peers: PeerWatch | None = None
    """That watch, told each attempt this node runs and each restart record it reads."""
    replicate: bool = False
    """Copy this node's in-memory snapshots to the node above and hold the node below's
    (`hlat_trainer.replica`, checkpoint.memoryReplicas; started by `run`); a node whose ranks
    hold none fetches theirs back before its trainers start."""
    replicas: tuple[ReplicaServer, Replicator] | None = None
    record_seen: GangRecord | None = None
    """The newest restart record this launcher read."""
    running: tuple[int, GangRecord | None] | None = None
    """The node count and restart record of the attempt that ran before this one (None: the
    record of the pods' creation), set when an attempt is published: a resized attempt stages
    the old world's snapshots (`replica.gather`) from where that record placed them."""
    record_running: GangRecord | None = None
    """The restart record of the attempt running now (None: the pods' creation ranks)."""

    def _attempt_env(self, attempt: int, steps_done: int, started: float) -> dict[str, str]:
        job = self.env.get(Env.JOB_NAME, "")
        exit_dir = Path(tempfile.mkdtemp(prefix="hlat-launch-"))
        if self.scratch is None:  # lives as long as the pod: what attempts hand on
            self.scratch = Path(tempfile.mkdtemp(prefix="hlat-pod-"))
        return {Env.ATTEMPT: str(attempt), Env.STEPS_DONE: str(steps_done),
                # torchrun passes the agent's own value on, else sets 1
                # (local_elastic_agent.py:321-323)
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": self.env.get(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                Env.STARTED_FILE: str(exit_dir / "started"),
                Env.PEAK_FLOPS_FILE: str(self.scratch / "peak-flops.json"),
                Env.HEARTBEAT_LEASE: labels.worker_lease_name(job, attempt,
                                                              self.layout.node_rank),
                Env.LAUNCHED_MONOTONIC: f"{started:.6f}",
                Env.EXIT_FILE: str(exit_dir / "exit-code")}

    def _start(self, attempt: int, steps_done: int, started: float
               ) -> list[subprocess.Popen[bytes]]:
        port = (_free_port() if self.layout.nnodes == 1
                else self.layout.master_port + attempt % RENDEZVOUS_PORTS)
        common = self._attempt_env(attempt, steps_done, started)
        if self.attempt_env is not None:
            common.update(self.attempt_env(self.layout.master_addr, self.layout.node_rank,
                                           self.layout.nnodes, attempt))
        self.oom.mark()
        if self.replicas is not None:
            self._restore_snapshots(attempt)
        self.exit_file = exit_file = Path(common[Env.EXIT_FILE])
        self.started_file = Path(common[Env.STARTED_FILE])
        procs = []
        run_id = run_id_of(self.env.get(Env.JOB_NAME, ""), attempt)
        for local in range(self.layout.nproc):
            env = {**common, **self.layout.worker_env(local, port, run_id),
                   # torchrun's is <log dir>/attempt_<n>/<local rank>/error.json
                   # (elastic/multiprocessing/api.py:386), where an `@record` entry point
                   # writes its exception: one per worker, the attempt's own
                   "TORCHELASTIC_ERROR_FILE": str(exit_file.parent / f"error-{local}.json")}
            ready = self.warm and len(self.standbys) == self.layout.nproc
            standby = self.standbys[local] if ready else Standby(self.env, self.argv)
            procs.append(standby.go(env, self.argv))
        self.standbys = []
        self.standbys_due = self.clock() + STANDBY_DELAY_SECONDS if self.warm else None
        self.procs = procs
        if self.peers is not None:
            self.peers.follow(attempt, self.layout.node_rank)
        _say(f"attempt {attempt}: started {len(procs)} worker(s) "
             f"(pids {', '.join(str(p.pid) for p in procs)})")
        return procs

    def _restore_snapshots(self, attempt: int) -> None:
        """Follow `attempt` as replica holder and pusher; fetch this node's ranks' snapshots
        from the node above where they hold none (a spare that took the rank, a pod made
        again): bounded by replica.IO_TIMEOUT_SECONDS per silence, and on failure the
        trainers resume from the durable checkpoint."""
        assert self.replicas is not None
        server, pusher = self.replicas
        job, rank = self.env.get(Env.JOB_NAME, ""), self.layout.node_rank
        server.follow(job, attempt)
        pusher.follow(attempt, rank)
        if attempt < 1:
            return  # a job's first attempt: nothing was snapshotted yet
        record = self.record_seen
        if record is None or record.attempt < attempt:
            reading = RecordRead(self.control)  # a pod made again: who holds which rank
            if reading.done.wait(CONNECT_SECONDS) and reading.record is not None:
                record = self.record_seen = reading.record
        root = Path(self.env[Env.SNAPSHOT_DIR])
        if self.running is not None and self.running[0] > self.layout.nnodes:
            self._stage_resize(root, job, record, *self.running)
            return
        unstage(root, job)
        holder = peer_host(job, record, successor(rank, self.layout.nnodes))
        restore(root, job, pusher.ranks(rank), holder, say=_say)

    def _stage_resize(self, root: Path, job: str, record: GangRecord | None, old_nodes: int,
                      old: GangRecord | None) -> None:
        """This attempt runs on fewer nodes than the last: stage that attempt's snapshots for
        the trainers to reshard (`replica.gather`), asking only pods of this attempt: for each
        old node rank, the pod that ran it, then the one that held its copies. (Growing back
        needs none: it comes at a durable checkpoint, and the new pod holds nothing.)"""
        alive = {peer_host(job, record, n) for n in range(self.layout.nnodes)}
        here = peer_host(job, record, self.layout.node_rank)
        sources = {o: [(host, kind) for host, kind in (
            (peer_host(job, old, o), "own"),
            (peer_host(job, old, successor(o, old_nodes)), "replica")) if host in alive]
            for o in range(old_nodes)}
        gather(root, job, sources, self.layout.nproc, here, say=_say)

    def run(self, attempt: int, steps_done: int, started: float) -> int:
        if self.watch_peers and self.layout.nnodes > 1:
            self.peers = PeerWatch(self.env.get(Env.JOB_NAME, ""), self.layout.nnodes,
                                   self.control.report_unreachable).start()
        if self.replicate and self.layout.nnodes > 1 and self.env.get(Env.SNAPSHOT_DIR):
            root = Path(self.env[Env.SNAPSHOT_DIR])
            self.replicas = (ReplicaServer(root, self.env.get(Env.JOB_NAME, "")).start(),
                             Replicator(root, self.env.get(Env.JOB_NAME, ""),
                                        self.layout.nnodes, self.layout.nproc).start())
        if self.warm:
            self.standbys = [Standby(self.env, self.argv) for _ in range(self.layout.nproc)]
        try:
            return self._loop(attempt, steps_done, started)
        finally:  # SIGTERM from the kubelet (SystemExit) or done: leave no process behind
            stop_all(self.procs, STOP_GRACE_SECONDS)
            for standby in self.standbys:
                standby.discard()
            if self.peers is not None:
                self.peers.stop()
            for side in self.replicas or ():
                side.stop()

    def _keep_standbys(self) -> None:
        if self.standbys_due is None:
            return
        if self.clock() >= self.standbys_due or (self.started_file is not None
                                                  and self.started_file.exists()):
            self.standbys = [Standby(self.env, self.argv) for _ in range(self.layout.nproc)]
            self.standbys_due = None

    def _resized(self, nnodes: int) -> None:
        """The rings over node ranks (neighbours watched, the node a snapshot is copied to)
        follow the attempt's size: an elastic job resized in place keeps its pods."""
        if self.peers is not None:
            self.peers.nnodes = nnodes
        if self.replicas is not None:
            self.replicas[1].nnodes = nnodes

    def _rank(self, record: GangRecord) -> int | None:
        """This node's rank in the record's attempt; None: still a spare."""
        if self.pod in record.ranks:
            return record.ranks[self.pod]
        return None if self.spare else self.layout.node_rank

    def _loop(self, attempt: int, steps_done: int, started: float) -> int:
        procs = [] if self.spare else self._start(attempt, steps_done, started)
        if self.spare:
            _say(f"spare pod {self.pod}: waiting with "
                 f"{len(self.standbys)} warm standby worker(s)")
        master = self.layout.master_addr
        failed_at: float | None = None
        code = 0
        next_read = self.clock()
        reading: RecordRead | None = None
        while True:
            time.sleep(CHECK_SECONDS)
            self._keep_standbys()
            record = None
            if reading is not None:
                if reading.done.is_set():
                    record, reading = reading.record, None
            elif self.clock() >= next_read:
                next_read = self.clock() + (
                    RECHECK_SECONDS if self.control.pushed
                    else POLL_SECONDS if failed_at is None else FAILED_POLL_SECONDS)
                reading = RecordRead(self.control)
            elif self.control.pushed:
                record = self.control.record()  # the watch's latest: no request
            if record is not None:
                self.record_seen = record
                if self.peers is not None:
                    self.peers.seen(record)
                if self.replicas is not None:
                    self.replicas[1].seen(record)
            rank = self._rank(record) if record is not None else None
            if record is not None and record.attempt > attempt and rank is not None:
                began = self.clock()
                _say(f"attempt {record.attempt} published (node rank {rank}): "
                     f"stopping attempt {attempt}")
                stop_all(procs, STOP_GRACE_SECONDS)
                if procs:
                    _say(f"attempt {attempt} stopped in {self.clock() - began:.2f}s")
                self.spare = False
                self.running = (self.layout.nnodes, self.record_running)
                self.record_running = record
                self.layout = replace(self.layout, node_rank=rank,
                                      master_addr=record.master_addr or master,
                                      nnodes=record.nodes or self.layout.nnodes)
                self._resized(self.layout.nnodes)
                attempt, steps_done, failed_at = record.attempt, record.steps_done, None
                procs = self._start(attempt, steps_done, began)
                continue
            if not procs:  # a spare: nothing of ours runs yet
                continue
            if failed_at is not None:
                if self.clock() - failed_at > self.wait_bound:
                    _say(f"no new attempt within {self.wait_bound:.0f}s of the "
                         f"trainer's exit ({code}): exiting")
                    return code
                continue
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                return 0
            bad = [c for c in codes if c not in (None, 0)]
            if not bad:
                continue
            code = _exit_code(bad, self.exit_file)
            reason = OOM_KILLED if code == 128 + signal.SIGKILL and self.oom.since_mark() else None
            stop_all(procs, STOP_GRACE_SECONDS)
            if code in (ExitCode.CONFIG_ERROR, ExitCode.NODE_FAULT):  # the pod must end
                return code
            _say(f"attempt {attempt}: a worker exited with {code}"
                 f"{' (out of memory: the kernel killed it)' if reason else ''}; waiting for "
                 "the next attempt")
            self.control.report_exit(attempt, self.layout.node_rank, code, reason)
            failed_at = next_read = self.clock()


def _say(message: str) -> None:
    """One line of the launcher's on stderr, timed as the trainer's log lines are."""
    now = datetime.now()
    print(f"{now:%Y-%m-%d %H:%M:%S},{now.microsecond // 1000:03d} hlat-launch: {message}",
          file=sys.stderr, flush=True)


def _exit_code(codes: Sequence[int | None], exit_file: Path | None) -> int:
    """The code the pod would show: CONFIG_ERROR when a worker said so in the attempt's exit
    file, else the first failure's (128+n for a signal)."""
    if exit_file is not None:
        with contextlib.suppress(OSError, ValueError):
            said = int(exit_file.read_text().strip())
            if said in (ExitCode.CONFIG_ERROR, ExitCode.NODE_FAULT):
                return said
    first = next(c for c in codes if c is not None)
    return first if first >= 0 else 128 - first
