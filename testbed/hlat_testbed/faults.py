"""Fault injection: what goes wrong on a real training cluster, done to the local one.

- ``kill``: a signal to a pod's main process (SIGKILL by default; the pod then shows the exit
  code a container runtime would: 128 + signal);
- ``hang`` / ``resume``: SIGSTOP / SIGCONT to the whole process group and every descendant
  (torchrun's workers run in their own sessions), so a worker and its children freeze as a
  stuck collective would, without exiting;
- ``node down`` / ``node up``: the node's kubelet goes silent, its pods drop off the network
  and then their processes die, so peers get no FIN or RST (a lost instance), or it comes
  back; ``node delete`` also removes the Node object, as the cluster
  autoscaler does when it replaces an instance;
- ``condition``: a Node status condition set as a node health reporter sets it (the EKS node
  monitoring agent's `AcceleratedHardwareReady=False`, the Neuron node problem detector's
  `NeuronHealth=True`), by a strategic merge patch of the Node's status: conditions merge by
  type, so the rig's kubelet, which patches only the conditions it owns, leaves it in place;
- ``without_resource`` / ``with_resource``: an extended resource (e.g. EFA's
  `vpc.amazonaws.com/efa`) gone from a node's capacity and allocatable, as on a node where its
  device plugin never ran; the node's kubelet keeps it off (a marker file it reads) until
  ``with_resource``;
- ``partition`` / ``heal``: one pod cut off the network (the host end of its veth down: what it
  sends is lost, nothing reaches it, no FIN or RST) while its node, kubelet, processes and
  files stay: a trainer that can reach neither the API server nor its peers but still writes
  to the shared checkpoint volume (a filesystem mount here).
- ``slow_port`` / ``unslow``: what one pod sends to one destination port limited to a rate
  (a kernel HTB shaper in the pod's network namespace): a slow link for one kind of traffic
  (e.g. snapshot copies), the rest of the pod's traffic untouched;
- ``Slowdown``: a fail-slow node: a pod's trainer processes paused for a fraction of every 20 ms
  (a SIGSTOP/SIGCONT duty cycle), computing slower without failing anything, on a CPU of
  their own (the gang's other trainers kept off it, as on separate machines).

Processes are found through the pid files the kubelet writes, never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hlat_testbed import netns
from hlat_testbed.config import ClusterConfig
from hlat_testbed.podfiles import container_pid, pod_dir
from hlat_testbed.procs import ProcessTable

if TYPE_CHECKING:
    from kubernetes import client


class FaultError(RuntimeError):
    """The node to fault has no running kubelet (pods that cannot be found: PodNotFound)."""


def kill(config: ClusterConfig, namespace: str, pod: str, sig: int = signal.SIGKILL,
         container: str | None = None) -> int:
    pid = container_pid(config, namespace, pod, container)
    os.kill(pid, sig)
    return pid


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), whatever session or group it is in:
    torchrun starts its workers in new sessions, so signalling the group misses them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_tree(pid: int, sig: int) -> None:
    """The process group of ``pid`` and every descendant, as a container freezer would."""
    os.killpg(pid, sig)
    for child in _descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, sig)


def hang(config: ClusterConfig, namespace: str, pod: str, container: str | None = None) -> int:
    pid = container_pid(config, namespace, pod, container)
    _signal_tree(pid, signal.SIGSTOP)
    return pid


def resume(config: ClusterConfig, namespace: str, pod: str, container: str | None = None) -> int:
    pid = container_pid(config, namespace, pod, container)
    _signal_tree(pid, signal.SIGCONT)
    return pid


def _kubelet_pid(config: ClusterConfig, node: str) -> int:
    pid = ProcessTable(config.pids_dir, config.logs_dir).pid(f"kubelet-{node}")
    if pid is None:
        raise FaultError(f"node {node} has no running kubelet on this cluster")
    return pid


def node_down(config: ClusterConfig, node: str) -> None:
    os.kill(_kubelet_pid(config, node), signal.SIGUSR1)


def node_up(config: ClusterConfig, node: str) -> None:
    os.kill(_kubelet_pid(config, node), signal.SIGUSR2)


def node_delete(config: ClusterConfig, api: client.ApiClient, node: str) -> None:
    """Stop the node's kubelet (its processes die with it) and delete the Node object."""
    from kubernetes import client

    ProcessTable(config.pids_dir, config.logs_dir).stop(f"kubelet-{node}", timeout=20)
    client.CoreV1Api(api).delete_node(node)


def set_node_condition(api: client.ApiClient, node: str, kind: str, status: str,
                       reason: str = "", message: str = "") -> None:
    """Set one status condition of `node` (others, the kubelet's included, are kept)."""
    from datetime import UTC, datetime

    from kubernetes import client

    if status not in ("True", "False", "Unknown"):
        raise FaultError(f"condition status must be True, False or Unknown, not {status!r}")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {"type": kind, "status": status, "reason": reason or kind,
                 "message": message or reason or kind, "lastHeartbeatTime": now,
                 "lastTransitionTime": now}
    client.CoreV1Api(api).patch_node_status(
        node, {"status": {"conditions": [condition]}},
        _content_type="application/strategic-merge-patch+json")


def _without_file(config: ClusterConfig, node: str) -> Path:
    return config.nodes_dir / f"{node}.without-resources"


def without_resources(config: ClusterConfig, node: str) -> list[str]:
    """The extended resources a fault removed from `node` (read by its kubelet)."""
    try:
        return _without_file(config, node).read_text().split()
    except OSError:
        return []


def without_resource(config: ClusterConfig, api: client.ApiClient, node: str,
                     resource: str) -> None:
    """Drop `resource` from the node's status now (null deletes a key in a strategic merge
    patch) and from every status its kubelet writes after."""
    from kubernetes import client

    gone = sorted({*without_resources(config, node), resource})
    config.nodes_dir.mkdir(parents=True, exist_ok=True)
    _without_file(config, node).write_text("\n".join(gone) + "\n")
    client.CoreV1Api(api).patch_node_status(
        node, {"status": {"capacity": {resource: None}, "allocatable": {resource: None}}},
        _content_type="application/strategic-merge-patch+json")


def with_resource(config: ClusterConfig, node: str, resource: str) -> None:
    """Undo `without_resource`: the kubelet advertises it again at its next status."""
    left = [r for r in without_resources(config, node) if r != resource]
    _without_file(config, node).write_text("".join(f"{r}\n" for r in left))


TRAINER_PROCESS_NAME = "hlat-trainer"
"""/proc/PID/comm of a worker process an in-place launcher runs (hlat_trainer.standby)."""
STANDBY_PROCESS_NAME = "hlat-standby"
"""/proc/PID/comm of a warm standby waiting for its attempt (hlat_trainer.standby)."""


def standby_cpu_seconds() -> float:
    """CPU seconds used so far by the waiting warm standbys on this host (every pod's)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if head.split("(", 1)[-1] == STANDBY_PROCESS_NAME:
            fields = rest.split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def wait_standbys_idle(timeout: float = 120.0, period: float = 2.0) -> None:
    """Until the waiting standbys use under a tenth of a core: after an in-place restart every
    pod starts its next standby (importing torch), which on the rig takes the workers' shared
    cores for tens of seconds; step times compared across a restart are taken after it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = standby_cpu_seconds()
        time.sleep(period)
        if standby_cpu_seconds() - before < 0.1 * period:
            return
    raise FaultError(f"the warm standbys were still busy after {timeout:.0f}s")


def trainer_pids(config: ClusterConfig, namespace: str, pod: str) -> list[int]:
    """The trainer processes an in-place launcher (the pod's main process) runs now: its
    children named `hlat-trainer` (a warm standby waiting is named `hlat-standby`). Read from
    the launcher's own `children` lists (one file per thread), not a scan of all of /proc:
    the census of test_e2e_inplace asks ten times a second. A child is listed by the thread
    that started it; when that thread ends, the child moves to another thread's list, and a
    read of both lists meanwhile sees it twice (seen: one promoted standby counted as two
    trainers): a process counts once, by its pid."""
    launcher = container_pid(config, namespace, pod)
    out: set[int] = set()
    for listing in Path(f"/proc/{launcher}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            for child in listing.read_text().split():
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{child}/comm").read_text().strip() == TRAINER_PROCESS_NAME:
                        out.add(int(child))
    return sorted(out)


def kill_trainer(config: ClusterConfig, namespace: str, pod: str,
                 sig: int = signal.SIGKILL) -> list[int]:
    """Signal the pod's trainer processes, not its launcher: the pod stays (a crash of the
    training process under `restartStrategy: InPlace`)."""
    pids = trainer_pids(config, namespace, pod)
    if not pids:
        raise FaultError(f"pod {namespace}/{pod} runs no {TRAINER_PROCESS_NAME} process")
    for pid in pids:
        os.kill(pid, sig)
    return pids


def hang_trainer(config: ClusterConfig, namespace: str, pod: str) -> list[int]:
    """Freeze the pod's trainer processes and their children (SIGSTOP), not the launcher: a
    training process stuck in a collective, its node and launcher fine."""
    pids = trainer_pids(config, namespace, pod)
    if not pids:
        raise FaultError(f"pod {namespace}/{pod} runs no {TRAINER_PROCESS_NAME} process")
    for pid in pids:
        _signal_tree(pid, signal.SIGSTOP)
    return pids


class Slowdown:
    """A fail-slow node for a while: the trainer processes of an in-place pod (`trainer_pids`)
    paused for `fraction` of every `period` seconds (SIGSTOP, then SIGCONT), as a throttled
    chip or a noisy neighbour slows them without failing anything: they compute at about
    (1 - fraction) of their speed, provided a step's compute lasts several periods (a 20 ms
    period against a step computing for 2 ms would miss most steps). A context manager; on exit
    they run freely again.

    `apart`: the gang's other pods, whose trainers are kept off the slowed one's CPU (and it
    on that CPU) while it lasts. Every rig node shares the host's cores, so without it the time
    a healthy trainer waits for the slow one in the gradient sync is lent to the slow one
    whenever the host is busy (the rest of a test suite), and most of the slowdown is made up;
    separate machines lend nothing. Needs two CPUs; with one, nothing is pinned."""

    def __init__(self, config: ClusterConfig, namespace: str, pod: str, fraction: float,
                 period: float = 0.02, apart: Sequence[str] = ()) -> None:
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), not {fraction}")
        self.pids = trainer_pids(config, namespace, pod)
        if not self.pids:
            raise FaultError(f"pod {namespace}/{pod} runs no {TRAINER_PROCESS_NAME} process")
        self.others = [pid for other in apart for pid in trainer_pids(config, namespace, other)]
        self.fraction, self.period = fraction, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._signal(signal.SIGSTOP)
            time.sleep(self.fraction * self.period)
            self._signal(signal.SIGCONT)
            self._stop.wait((1 - self.fraction) * self.period)

    def _pin(self, apart: bool) -> None:
        """The slowed trainers on the host's last CPU and the others on the rest (`apart`), or
        every one back on every CPU."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2 or not self.others:
            return
        if apart:
            pin(self.pids, set(cpus[-1:]))
            pin(self.others, set(cpus[:-1]))
        else:
            pin(self.pids + self.others, set(cpus))

    def __enter__(self) -> Slowdown:
        self._pin(apart=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._signal(signal.SIGCONT)
        self._pin(apart=False)


def pin(pids: Sequence[int], cpus: set[int]) -> None:
    """Every thread of `pids` and of their descendants allowed on `cpus` only (an affinity is
    a thread's own; threads started later inherit their starter's)."""
    for pid in pids:
        for proc in (pid, *_descendants(pid)):
            with contextlib.suppress(OSError):  # ended meanwhile
                for task in Path(f"/proc/{proc}/task").iterdir():
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(task.name), cpus)


def _pod_uid(config: ClusterConfig, namespace: str, pod: str) -> str:
    """The uid of the pod's newest run on this cluster's kubelets (from its state directory,
    `<namespace>_<pod>_<uid>`)."""
    return pod_dir(config, namespace, pod).name.rsplit("_", 1)[1]


def partition(config: ClusterConfig, namespace: str, pod: str) -> str:
    """Cut the pod off the network, its processes and files untouched; returns its uid."""
    uid = _pod_uid(config, namespace, pod)
    netns.set_pod_link(config.bridge, uid, up=False)
    return uid


def slow_port(config: ClusterConfig, namespace: str, pod: str, port: int,
              bytes_per_second: int) -> str:
    """What the pod sends to destination `port` goes at `bytes_per_second` at most; its uid."""
    uid = _pod_uid(config, namespace, pod)
    netns.limit_port_rate(config.bridge, uid, port, bytes_per_second)
    return uid


def unslow(config: ClusterConfig, namespace: str, pod: str) -> None:
    """Undo `slow_port`."""
    netns.clear_port_rates(config.bridge, _pod_uid(config, namespace, pod))


def heal(config: ClusterConfig, namespace: str, pod: str) -> None:
    """Undo `partition` (connections whose packets were only lost carry on)."""
    netns.set_pod_link(config.bridge, _pod_uid(config, namespace, pod), up=True)
