"""One pod on one node: its network, volumes, processes and the status the kubelet reports.

A ``PodWorker`` thread owns a pod from the moment it is bound to the node until it is deleted:
it creates the pod's netns and volumes, runs init containers in order and then the containers
as local processes (each the leader of its own process group and, where cgroup v2 can be
written, alone in its own cgroup with everything it starts, as under a container runtime), applies
the restart policy, and reports status after every change: Pending, then Running with podIP and
Ready, then Succeeded or Failed with each container's exit code and reason (a signal ``n`` is
exit code ``128+n``, as container runtimes report it; ``OOMKilled`` when the kernel OOM-killed a
process of the container, whose memory limit it enforces: `cgroups`) and termination message
(the file at its ``terminationMessagePath``, or its log's tail: `termination_message`).

Sidecars (KEP-753: an init container with ``restartPolicy: Always``) are started in their turn
among the init containers, and the next one starts without waiting for them to exit; they run
beside the containers, are restarted whenever they exit, whatever the pod's restart policy, and
are stopped, last first, once the containers are done. The pod's phase is the containers' alone.

Deletion follows the kubelet's contract: SIGTERM to each main process (the sidecars' once the
containers have exited, last sidecar first), SIGKILL to the whole container (its cgroup and
process group) after the grace period, a final status, then the pod object is deleted with grace
0 and a UID precondition. When the main process exits, whatever it left behind is killed, as a
container's pid namespace would be: with cgroups that includes workers started in other sessions
(torchrun's), which a process group misses.

Each container's stdout and stderr go to ``<pods_dir>/<ns>_<pod>_<uid>/<container>.log`` and its
pid to ``<container>.pid``, which is how ``hlat-cluster logs`` and fault injection find it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kubernetes.client import ApiClient

from hlat_testbed import cgroups, netns, podfiles, podrun, podspec
from hlat_testbed.config import API_PORT, K8S_CLUSTER_DOMAIN, ClusterConfig
from hlat_testbed.kube import Obj, Pod

Status = dict[str, Any]


class Agent(Protocol):
    """What a pod worker needs of its node's kubelet (`hlat_testbed.kubelet.NodeAgent`), so the
    two modules do not import each other."""

    config: ClusterConfig
    api: ApiClient
    allocatable: dict[str, str]
    online: threading.Event

    def log(self, message: str) -> None: ...
    def allocate_ip(self, uid: str) -> str: ...
    def release_ip(self, uid: str) -> None: ...
    def report_status(self, worker: PodWorker, status: Status) -> None: ...
    def pod_gone(self, worker: PodWorker) -> None: ...


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRun:
    """What the kubelet knows about one container of the pod."""

    spec: Obj
    init: bool = False
    proc: subprocess.Popen[bytes] | None = None
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    reason: str = "ContainerCreating"
    message: str | None = None
    restarts: int = 0
    last_state: Status | None = None
    group: cgroups.ContainerGroup | None = None
    log_start: int = 0
    """Where this run's output begins in the container's log (runs of a container share one)."""

    @property
    def sidecar(self) -> bool:
        """An init container with ``restartPolicy: Always`` (KEP-753)."""
        return self.init and getattr(self.spec, "restart_policy", None) == "Always"

    def kill_all(self) -> None:
        """SIGKILL the main process's group and everything in the container's cgroup."""
        if self.proc is not None:
            _killpg(self.proc.pid, signal.SIGKILL)
        if self.group is not None:
            self.group.kill()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.exit_code is None

    def state(self) -> Status:
        if self.running:
            return {"running": {"startedAt": self.started_at}}
        if self.exit_code is not None:
            term: Status = {"exitCode": self.exit_code, "reason": self.reason,
                            "startedAt": self.started_at, "finishedAt": self.finished_at}
            if self.exit_code >= 128:
                term["signal"] = self.exit_code - 128
            if self.message:
                term["message"] = self.message
            return {"terminated": term}
        waiting: Status = {"reason": self.reason}
        if self.message:
            waiting["message"] = self.message
        return {"waiting": waiting}

    def status(self, pod_uid: str) -> Status:
        out: Status = {
            "name": self.spec.name, "image": self.spec.image or "host",
            "imageID": "", "containerID": f"hlat://{pod_uid}/{self.spec.name}",
            "ready": self.running and (self.sidecar or not self.init), "started": self.running,
            "restartCount": self.restarts, "state": self.state(),
        }
        if self.last_state:
            out["lastState"] = self.last_state
        return out


TERMINATION_PATH = "/dev/termination-log"
"""The API server's default terminationMessagePath."""
MAX_TERMINATION_BYTES = 4096
"""The kubelet reads at most the last this many bytes of the file."""
FALLBACK_LOG_LINES, FALLBACK_LOG_BYTES = 80, 2048
"""terminationMessagePolicy FallbackToLogsOnError: the log's tail instead, this long at most."""


def termination_path(spec: Obj) -> str:
    return getattr(spec, "termination_message_path", None) or TERMINATION_PATH


def termination_message(file: Path, log: Path, log_start: int, spec: Obj,
                        exit_code: int) -> str | None:
    """A terminated container's message, made as the kubelet makes it (kubernetes
    pkg/kubelet/kuberuntime/kuberuntime_container.go, convertToKubeContainerStatus): the last
    4096 bytes of the file at its terminationMessagePath; if that is empty, the policy is
    FallbackToLogsOnError and the container failed, the tail of this run's log (from
    ``log_start``): its last 80 lines, at most 2048 bytes (the last 80 lines of the last 2048
    bytes are the same)."""
    try:
        message = _tail(file, MAX_TERMINATION_BYTES)
    except OSError:
        message = b""
    if (not message and exit_code != 0
            and getattr(spec, "termination_message_policy", None) == "FallbackToLogsOnError"):
        with contextlib.suppress(OSError):
            lines = _tail(log, FALLBACK_LOG_BYTES, log_start).splitlines(keepends=True)
            message = b"".join(lines[-FALLBACK_LOG_LINES:])
    return message.decode(errors="replace") or None


def _tail(path: Path, max_bytes: int, start: int = 0) -> bytes:
    """The last ``max_bytes`` of ``path``, none before offset ``start``."""
    with path.open("rb") as f:
        f.seek(max(start, f.seek(0, os.SEEK_END) - max_bytes))
        return f.read()


def exit_code_of(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class PodWorker:
    """Runs one pod; ``terminate`` and ``kill_silently`` may be called from other threads."""

    def __init__(self, agent: Agent, pod: Pod) -> None:
        self.agent = agent
        self.pod = pod
        self.uid: str = pod.metadata.uid
        self.key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        self.dir = podfiles.directory_for(agent.config, pod.metadata.namespace,
                                          pod.metadata.name, self.uid)
        self.pod_ip = ""
        self.start_time = now()
        self.phase = "Pending"
        self.init_runs = [ContainerRun(c, init=True) for c in pod.spec.init_containers or []]
        self.sidecars = [r for r in self.init_runs if r.sidecar]
        self.runs = [ContainerRun(c) for c in pod.spec.containers]
        self.deleting = threading.Event()
        grace = pod.spec.termination_grace_period_seconds
        self.grace_s: float = 30 if grace is None else grace  # deletion's may replace it
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def terminate(self, grace_s: float) -> None:
        """The pod was deleted: stop its processes within ``grace_s``, then remove it."""
        self.grace_s = grace_s
        self.deleting.set()

    def kill_silently(self) -> None:
        """The node went down: every process dies at once (reported when the node is back)."""
        for run in [*self.init_runs, *self.runs]:
            if run.running:
                run.kill_all()

    def _run(self) -> None:
        try:
            self._setup()
            self.phase = self._run_containers()
        except podspec.PodConfigError as err:
            self._config_error(str(err))
        except Exception as err:
            self.agent.log(f"pod {self.key}: {err!r}")
            self._config_error(f"process kubelet: {err}")
        self.report()
        self.deleting.wait()
        self._teardown()

    def _config_error(self, message: str) -> None:
        for run in self.runs:
            if run.exit_code is None:
                run.reason, run.message = "CreateContainerConfigError", message
        self.report()
        self.deleting.wait()

    # --- setup ---------------------------------------------------------------------------
    def _setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pod_ip = self.agent.allocate_ip(self.uid)
        self.report()
        spec, meta = self.pod.spec, self.pod.metadata
        hostname = spec.hostname or meta.name
        fqdn = (f"{hostname}.{spec.subdomain}.{meta.namespace}.svc.{K8S_CLUSTER_DOMAIN}"
                if spec.subdomain else hostname)
        host = self.agent.config.host_ip
        netns.create_pod_network(
            self.agent.config.bridge, self.uid, f"{self.pod_ip}/{self.agent.config.network.prefixlen}",
            host, _resolv_conf(meta.namespace, host),
            f"127.0.0.1\tlocalhost\n{self.pod_ip}\t{fqdn} {hostname}\n")
        resolver = podspec.PodResolver(self.agent.api, self.pod, self.pod_ip, host,
                                       self.agent.allocatable)
        self.volumes = {v.name: podspec.materialize_volume(resolver, v, self.dir / "volumes")
                        for v in spec.volumes or []}
        base = podspec.base_env(hostname, host, API_PORT)
        for run in [*self.init_runs, *self.runs]:
            run.group = cgroups.for_container(self.agent.config.bridge, self.uid, run.spec.name)
            limit = podspec.memory_limit(run.spec)
            if limit is not None and (run.group is None or not run.group.limit_memory(limit)):
                self.agent.log(f"pod {self.key}: container {run.spec.name}: memory limit "
                               f"{limit} bytes not enforced (no writable memory cgroup)")
            env = podspec.container_env(resolver, run.spec, base)
            self._write_launch_spec(run, env, hostname)

    def _write_launch_spec(self, run: ContainerRun, env: dict[str, str], hostname: str) -> None:
        mounts = []
        for m in run.spec.volume_mounts or []:
            source = self.volumes[m.name]
            if m.sub_path:
                source = source / m.sub_path
                if not source.exists():
                    source.mkdir(parents=True)
            mounts.append({"source": str(source), "target": m.mount_path,
                           "readOnly": bool(m.read_only)})
        # the termination-message file, emptied for each run by _spawn, bind-mounted at the
        # container's terminationMessagePath (kuberuntime_container.go makeMounts), read at exit
        mounts.append({"source": str(self._termination_file(run)),
                       "target": termination_path(run.spec), "readOnly": False})
        launch = {"argv": podspec.container_argv(run.spec, env), "env": env, "mounts": mounts,
                  "hostname": hostname, "workingDir": run.spec.working_dir or "/",
                  "cgroupMounts": cgroups.container_mounts() if run.group is not None else []}
        (self.dir / f"{run.spec.name}.json").write_text(json.dumps(launch))

    # --- processes -----------------------------------------------------------------------
    def _spawn(self, run: ContainerRun) -> None:
        name = run.spec.name
        argv = ["ip", "netns", "exec", netns.pod_netns_name(self.agent.config.bridge, self.uid),
                "unshare", "--mount", "--uts", "--propagation", "private",
                sys.executable, podrun.__file__, str(self.dir / f"{name}.json")]
        if run.group is not None:  # join the cgroups first, so everything started is in them
            run.group.create()
            run.group.mark_oom()
            for procs in run.group.join_files():
                argv = ["sh", "-c", cgroups.JOIN, str(procs), *argv]
        self._termination_file(run).write_bytes(b"")  # a new file for each run, as the kubelet's
        with (self.dir / f"{name}.log").open("ab") as log:
            run.log_start = log.tell()
            run.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        (self.dir / f"{name}.pid").write_text(str(run.proc.pid))
        run.started_at, run.exit_code, run.finished_at, run.message = now(), None, None, None

    def _termination_file(self, run: ContainerRun) -> Path:
        return self.dir / f"{run.spec.name}.termination-log"

    def _reap(self, run: ContainerRun) -> bool:
        """Record ``run``'s exit if its main process ended; True if it did."""
        if run.proc is None or run.exit_code is not None or run.proc.poll() is None:
            return False
        run.kill_all()  # whatever the main process left behind
        code = exit_code_of(run.proc.returncode)
        run.exit_code, run.finished_at = code, now()
        oom_killed = run.group is not None and run.group.oom_killed()
        run.reason = "Completed" if code == 0 else "OOMKilled" if oom_killed else "Error"
        run.message = termination_message(self._termination_file(run),
                                          self.dir / f"{run.spec.name}.log", run.log_start,
                                          run.spec, code)
        with contextlib.suppress(FileNotFoundError):
            (self.dir / f"{run.spec.name}.pid").unlink()
        return True

    def _run_containers(self) -> str:
        # As kubernetes pkg/kubelet/kuberuntime/kuberuntime_container.go
        # computeInitContainerActions (KEP-753): init containers start in order; the next one
        # starts once a sidecar has started, but only once a regular one has exited 0.
        for run in self.init_runs:
            if self.deleting.is_set():
                return self._stop_all()
            self._spawn(run)
            self.report()
            if run.sidecar:
                continue
            while not self._reap(run):
                if self.deleting.wait(0.1):
                    return self._stop_all()
                if self._keep_sidecars():
                    self.report()
            if run.exit_code != 0:
                self._stop(*self._sidecars_last_first())
                return "Failed"
        for run in self.runs:
            self._spawn(run)
        self.phase = "Running"
        self.report()
        return self._supervise()

    def _supervise(self) -> str:
        policy = self.pod.spec.restart_policy or "Always"
        while True:
            if self.deleting.wait(0.1):
                return self._stop_all()
            changed = [run for run in self.runs if self._reap(run)]
            if self.agent.online.is_set():  # a node that is down restarts nothing
                for run in self.runs:
                    if run.exit_code is not None and _should_restart(policy, run):
                        self._restart(run)
                        changed.append(run)
                if all(r.exit_code is not None for r in self.runs):
                    # nothing left to keep running: the sidecars are stopped, not restarted
                    # (kuberuntime_manager.go computePodActions), and the phase is the
                    # containers' alone (kubelet_pods.go getPhase)
                    self._stop(*self._sidecars_last_first())
                    return self._phase()
            changed += self._keep_sidecars()
            if changed:
                self.report()

    def _keep_sidecars(self) -> list[ContainerRun]:
        """Reap the sidecars and restart those that exited, whatever the pod's restart policy
        (computeInitContainerActions), unless the node is down; those that changed."""
        changed = [run for run in self.sidecars if self._reap(run)]
        if self.agent.online.is_set():
            for run in self.sidecars:
                if run.exit_code is not None:
                    self._restart(run)
                    changed.append(run)
        return changed

    def _restart(self, run: ContainerRun) -> None:
        run.last_state = run.state()
        time.sleep(min(10.0, 0.5 * 2 ** run.restarts))
        run.restarts += 1
        self._spawn(run)

    def _sidecars_last_first(self) -> list[list[ContainerRun]]:
        return [[run] for run in reversed(self.sidecars)]

    def _phase(self) -> str:
        return "Succeeded" if all(r.exit_code == 0 for r in self.runs) else "Failed"

    def _stop_all(self) -> str:
        """Deletion: the containers (and a running init container) first, then the sidecars,
        the last one first, all in one grace period (kuberuntime_container.go killContainer,
        kuberuntime_termination_order.go)."""
        self._stop([r for r in [*self.init_runs, *self.runs] if not r.sidecar],
                   *self._sidecars_last_first())
        return self._phase()

    def _stop(self, *groups: list[ContainerRun]) -> None:
        """Stop ``groups`` in turn: SIGTERM to a group's main processes once the group before
        has exited; SIGKILL to whatever is left when the grace period ends."""
        deadline = time.monotonic() + self.grace_s
        for group in groups:
            live = [(r, r.proc) for r in group if r.running and r.proc is not None]
            for _, proc in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
            while time.monotonic() < deadline and any(p.poll() is None for _, p in live):
                time.sleep(0.05)
            for run, proc in live:
                run.kill_all()
                proc.wait()
                self._reap(run)

    def _teardown(self) -> None:
        self.report()
        self._remove_groups()
        netns.delete_pod_network(self.agent.config.bridge, self.uid)
        self.agent.release_ip(self.uid)
        self.agent.pod_gone(self)
        shutil.rmtree(self.dir / "volumes", ignore_errors=True)

    def shutdown(self) -> None:
        """Kubelet exit: kill everything and remove the network, report nothing."""
        self.kill_silently()
        for run in [*self.init_runs, *self.runs]:
            if run.proc is not None:
                run.proc.wait()
        self._remove_groups()
        netns.delete_pod_network(self.agent.config.bridge, self.uid)

    def _remove_groups(self) -> None:
        for run in [*self.init_runs, *self.runs]:
            if run.group is not None:
                run.group.remove()

    # --- status --------------------------------------------------------------------------
    def report(self) -> None:
        self.agent.report_status(self, self.status())

    def status(self) -> Status:
        with self.lock:
            runs_ready = all(r.running for r in [*self.sidecars, *self.runs])
            initialized = all(r.started_at is not None if r.sidecar else r.exit_code == 0
                              for r in self.init_runs)
            ready = self.phase == "Running" and runs_ready
            status: Status = {
                "phase": self.phase,
                "hostIP": self.agent.config.host_ip,
                "hostIPs": [{"ip": self.agent.config.host_ip}],
                "startTime": self.start_time,
                "conditions": [
                    _condition("PodReadyToStartContainers", bool(self.pod_ip)),
                    _condition("Initialized", initialized),
                    _condition("ContainersReady", ready),
                    _condition("Ready", ready),
                ],
                "containerStatuses": [r.status(self.uid) for r in self.runs],
            }
            if self.init_runs:
                status["initContainerStatuses"] = [r.status(self.uid) for r in self.init_runs]
            if self.pod_ip:
                status["podIP"], status["podIPs"] = self.pod_ip, [{"ip": self.pod_ip}]
            return status


def _condition(kind: str, ok: bool) -> Status:
    return {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": now()}


def _should_restart(policy: str, run: ContainerRun) -> bool:
    return policy == "Always" or (policy == "OnFailure" and run.exit_code != 0)


def _resolv_conf(namespace: str, dns_ip: str) -> str:
    d = K8S_CLUSTER_DOMAIN
    return (f"search {namespace}.svc.{d} svc.{d} {d}\nnameserver {dns_ip}\n"
            "options ndots:5\n")


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
