"""What the end-to-end tests share: the module's operator, a job's namespace and shared volume,
and `Env`, one test's view of its job (create it, watch its status with a stopwatch, read its
pods, logs and events)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_api.labels import ATTEMPT, COMPONENT, NODE_RANK, SPARE, WORKER, gang_lease_name
from hlat_api.labels import JOB as JOB_LABEL
from hlat_testbed import faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import GROUP, PLURAL, VERSION, OperatorProcess
from hlat_testbed.podfiles import PodNotFound
from hlat_testbed.testing import WaitTimeout, wait_for

JOB = "tiny"


# --- helpers -------------------------------------------------------------------------------


class Env:
    """One test's job: create it, watch its status (recording phase transitions with a
    stopwatch), read its pods and logs."""

    def __init__(self, cluster: Cluster, namespace: str, fsx: Path,
                 operator: dict[str, OperatorProcess], name: str = JOB) -> None:
        self.cluster, self.ns, self.fsx, self.operator = cluster, namespace, fsx, operator
        self.name = name
        api = cluster.admin_api()
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.coordination = client.CoordinationV1Api(api)
        self._restart_record = False
        self.transitions: list[tuple[str, float]] = []
        self.max_gangs = 0

    def create(self, spec: dict[str, Any], labels: dict[str, str] | None = None) -> None:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
                "metadata": {"name": self.name, "labels": labels or {}}, "spec": spec}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def patch_spec(self, patch: dict[str, Any]) -> None:
        """A merge patch of the job's spec (a user's `kubectl patch` mid-run)."""
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name,
                                                   {"spec": patch})

    def delete(self) -> None:
        with contextlib.suppress(ApiException):
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL,
                                                       self.name)

    def job(self) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.get_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, self.ns, PLURAL, self.name)
        return job

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.job().get("status") or {}
        phase = status.get("phase")
        if phase and (not self.transitions or self.transitions[-1][0] != phase):
            self.transitions.append((phase, time.monotonic()))
        self._count_gangs()
        return status

    def _count_gangs(self) -> None:
        """Gangs alive at once: never more than one. Without a restart record, the attempts
        with a live (not terminating, not finished) pod. Under InPlace (the job has its restart
        record) every launcher runs the record's attempt, whatever its pod's label says, and a
        restart moves the kept pods to the new attempt one label patch at a time (a poll
        between two patches sees two attempts: CI did); there a second gang is a second live
        pod holding one node rank (an old pod left beside its replacement)."""
        live = [labels for _, labels, alive in self.pod_rows() if alive]
        if self._in_place():
            holders = Counter(labels[NODE_RANK] for labels in live
                              if NODE_RANK in labels and SPARE not in labels)
            gangs = max(holders.values(), default=0)
        else:
            gangs = len({labels.get(ATTEMPT) for labels in live})
        self.max_gangs = max(self.max_gangs, gangs)

    def _in_place(self) -> bool:
        """Whether the job has its restart record (an InPlace job has it from its first pass
        on: remembered once seen)."""
        if not self._restart_record:
            try:
                self.coordination.read_namespaced_lease(gang_lease_name(self.name), self.ns)
                self._restart_record = True
            except ApiException as err:
                if err.status != 404:
                    raise
        return self._restart_record

    @property
    def _workers(self) -> str:
        """The job's worker pods (spares too), not its evaluation Jobs' pods."""
        return f"{JOB_LABEL}={self.name},{COMPONENT}={WORKER}"

    def pods(self) -> list[Any]:
        return list(self.core.list_namespaced_pod(
            self.ns, label_selector=self._workers).items)

    def pod_rows(self) -> list[tuple[str, dict[str, str], bool]]:
        """The job's pods: name, labels, and live (Pending or Running, not terminating), read
        from the list's JSON as it comes (the polls of `status` and `TrainerCensus` ask up to
        ten times a second; building the client's models each time cost a tenth of a core)."""
        response = self.core.list_namespaced_pod(
            self.ns, label_selector=self._workers, _preload_content=False)
        return [(pod["metadata"]["name"], pod["metadata"].get("labels") or {},
                 "deletionTimestamp" not in pod["metadata"]
                 and (pod.get("status") or {}).get("phase") in ("Pending", "Running"))
                for pod in json.loads(response.data)["items"]]

    def wait(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float
             ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = self.status()
            if pred(status):
                return status
            if status.get("phase") == "Failed" and "Failed" not in what:
                pytest.fail(f"job Failed while waiting for {what}: {status.get('conditions')}")
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                             f"status: {json.dumps(status)[:1500]}; see the operator log")

    def wait_trained(self, stall: float = 90, limit: float = 900) -> dict[str, Any]:
        """Until Succeeded, for a job with many steps left: bounded by progress, not by speed.
        Fails once neither the phase, the attempt nor the step moved for `stall` seconds (a
        loaded machine trains slower, a stuck job does not train), or after `limit`."""
        moved, last = time.monotonic(), None

        def done(status: dict[str, Any]) -> bool:
            nonlocal moved, last
            now = (status.get("phase"), status.get("attempt"),
                   (status.get("progress") or {}).get("step"))
            if now != last:
                moved, last = time.monotonic(), now
            elif time.monotonic() - moved > stall:
                raise AssertionError(f"no progress for {stall:.0f}s waiting for Succeeded; "
                                     f"status: {json.dumps(status)[:1500]}")
            return status.get("phase") == "Succeeded"

        return self.wait("Succeeded", done, limit)

    def wait_pods(self, count: int, timeout: float) -> list[Any]:
        """The job's pods once there are at least `count` of them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = self.pods()
            if len(pods) >= count:
                return pods
            self.status()
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout}s waiting for {count} pods of "
                             f"{self.name}; status: {json.dumps(self.status())[:1500]}")

    def wait_phase(self, phase: str, timeout: float) -> dict[str, Any]:
        """Until the status shows `phase`. "Restarting" is a restart under way: the phase, or
        the next attempt Pending while the Restarting condition is still True (a restart after
        progress has no backoff, and its Restarting phase can pass between two polls)."""
        if phase == "Restarting":
            return self.wait("a restart (phase Restarting, or the next attempt Pending)",
                             restart_under_way, timeout)
        return self.wait(f"phase {phase}", lambda s: s.get("phase") == phase, timeout)

    def phases(self) -> list[str]:
        return [p for p, _ in self.transitions]

    def stopwatch_running(self, until: float) -> float:
        """Seconds in Running by the transitions this test observed."""
        total = 0.0
        for i, (phase, t) in enumerate(self.transitions):
            end = self.transitions[i + 1][1] if i + 1 < len(self.transitions) else until
            if phase == "Running":
                total += end - t
        return total

    def pod_log(self, attempt: int, rank: int) -> str:
        return self.cluster.pod_log(self.ns, f"{self.name}-a{attempt}-{rank}")

    def wait_saved(self, step: int, attempt: int = 0, rank: int = 1, timeout: float = 180
                   ) -> None:
        """Until node rank `rank`'s trainer logged its save of step_`step` (polled every 20 ms):
        the moment to fault a run mid-way. The status is no clock for that: written every 2 s,
        it lags a tiny run by dozens of steps, and a fault timed by it landed after the last
        step in CI runs. With sync saves, step_`step` logged means the checkpoint before it
        is complete (rank 0 committed it before the collectives of the steps since)."""
        line = f"checkpoint step_{step}:"

        def logged() -> bool:
            try:
                return line in self.pod_log(attempt, rank)
            except (PodNotFound, OSError):
                return False

        try:
            wait_for(logged, timeout, f"'{line}' in {self.name}-a{attempt}-{rank}'s log",
                     interval=0.02)
        except WaitTimeout as err:
            raise AssertionError(f"{err}; status: {json.dumps(self.status())[:1500]}") from err

    def wait_process(self, pod: str, timeout: float = 60) -> None:
        """Until the kubelet has started the pod's container (its pid file exists)."""
        from hlat_testbed.podfiles import container_pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                container_pid(self.cluster.config, self.ns, pod)
                return
            except Exception:
                time.sleep(0.25)
        raise AssertionError(f"pod {pod}'s process never started")

    def other(self, name: str) -> Env:
        """Another job in the same namespace (and on the same shared volume)."""
        return Env(self.cluster, self.ns, self.fsx, self.operator, name)

    def event_messages(self) -> list[tuple[str, str]]:
        evs = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={self.name}").items
        return [(e.reason, e.message) for e in evs]

    def events(self) -> list[str]:
        evs = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={self.name}").items
        return [e.reason for e in evs]

    def diagnosis(self, lines: int = 25) -> str:
        """What a failed test prints (CI keeps no pod logs): the job's events, and the last
        `lines` lines of every log the kubelets kept for the namespace's pods (each incarnation of a
        recreated pod has its own)."""
        out: list[str] = []
        with contextlib.suppress(ApiException):
            evs = self.core.list_namespaced_event(self.ns).items
            for e in sorted(evs, key=lambda e: str(e.last_timestamp or e.event_time or "")):
                out.append(f"event {e.last_timestamp or e.event_time} {e.involved_object.name}"
                           f" {e.reason}: {e.message}")
        for directory in sorted(self.cluster.config.pods_dir.glob(f"{self.ns}_*")):
            for log in sorted(directory.glob("*.log")):
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {directory.name}/{log.name} (last {len(tail)} lines)")
                out.extend(tail)
        return "\n".join(out)


def after_a_fresh_beat(env: Env, lease: str, interval: int, act: Callable[[], None],
                       timeout: float = 60) -> None:
    """Run `act` right after the Lease `lease` carried a new step well inside a checkpoint
    interval (at least 5 steps before the next save): its writer is training, not saving, and
    will be for a few steps (a fault timed this way meets the training loop, not a save)."""
    leases = client.CoordinationV1Api(env.cluster.admin_api())
    last = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        notes = leases.read_namespaced_lease(lease, env.ns).metadata.annotations or {}
        step = notes.get("hlat.dev/step")
        if (last is not None and step != last and step is not None
                and notes.get("hlat.dev/phase") == "training"
                and 1 <= int(step) % interval <= interval - 5):
            act()
            return
        last = step
        time.sleep(0.02)
    raise AssertionError(f"{lease} carried no new step inside an interval for {timeout:.0f} s")


def metric_lines(log: str) -> list[dict[str, Any]]:
    """A trainer's JSON metric lines (one per logged step), in order, whole lines only: a log
    read while the trainer writes to it may end in part of a line (seen in CI: a step's line
    cut at its 194th character), which is left out, as it is not written yet."""
    whole = log[:log.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines()
            if line.startswith("{") and '"step"' in line]


def steps_logged(log: str) -> list[int]:
    """The steps a trainer logged (its JSON metric lines), in order."""
    return [int(row["step"]) for row in metric_lines(log)]


def resumed_from(log: str) -> int | None:
    m = re.search(r"resumed from checkpoint step_(\d+)", log)
    return int(m.group(1)) if m else None


def restart_under_way(status: dict[str, Any]) -> bool:
    """Phase Restarting, or Pending with the Restarting condition True (until Running)."""
    restarting = any(c.get("type") == "Restarting" and c.get("status") == "True"
                     for c in status.get("conditions") or [])
    return status.get("phase") == "Restarting" or (
        status.get("phase") == "Pending" and restarting)


def first_step_time(log: str) -> float | None:
    """The wall-clock time of the first step a trainer logged (its JSON `time`)."""
    rows = metric_lines(log)
    return float(rows[0]["time"]) if rows else None


def report_recovery(env: Env, what: str, fault_at: float, attempt: int = 1) -> float:
    """Print (and return) the seconds from a fault (`time.time()` when it was made) to the next
    training step of `attempt`: the figure of docs/operator.md's fault matrix."""
    first = first_step_time(env.pod_log(attempt, 0))
    assert first is not None, f"attempt {attempt} trained no step"
    print(f"[fault matrix] {what}: next training step {first - fault_at:.1f}s after the fault")
    return first - fault_at


def attempt_log(log: str, attempt: int) -> str:
    """The part of an in-place pod's log (one pod, several attempts) from its launcher starting
    `attempt` on ("" before that)."""
    i = log.find(f"hlat-launch: attempt {attempt}: started")
    return "" if i < 0 else log[i:]


def report_recovery_log(env: Env, what: str, log: str, attempt: int, fault_at: float) -> float:
    """`report_recovery` for a pod kept by an in-place restart."""
    first = first_step_time(attempt_log(log, attempt))
    assert first is not None, f"attempt {attempt} trained no step"
    print(f"[fault matrix] {what}: next training step {first - fault_at:.1f}s after the fault")
    return first - fault_at


class TrainerCensus:
    """Samples, every 0.1 s, the trainer processes each worker pod's launcher runs, and the live
    pods of each node rank: the most ever seen at once for one pod must be the node's process
    count, and for one rank 1 (the pods of an in-place restart are moved to the new attempt
    one by one, so "one attempt label at a time" is not the rule here)."""

    def __init__(self, env: Env) -> None:
        self.env, self.most, self.most_pods = env, 0, 0
        self.worst: tuple[str, list[str]] | None = None
        """The pod and its trainers (pid, state, parent, command line) when `most` was seen."""
        self.names: set[str] = set()  # every pod seen while the job ran
        self.last_seen: dict[int, float] = {}  # trainer pid -> when last seen running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            ranks: dict[str, int] = {}
            for name, labels, live in self.env.pod_rows():
                self.names.add(name)
                if not live:
                    continue
                rank = labels.get("hlat.dev/node-rank")
                if rank is not None:
                    ranks[rank] = ranks.get(rank, 0) + 1
                    self.most_pods = max(self.most_pods, ranks[rank])
                try:
                    pids = faults.trainer_pids(self.env.cluster.config, self.env.ns, name)
                except (PodNotFound, OSError, ValueError):
                    continue
                if len(pids) > self.most:
                    self.most, self.worst = len(pids), (name, [_describe(p) for p in pids])
                self.last_seen.update(dict.fromkeys(pids, time.time()))
            self._stop.wait(0.1)

    def __enter__(self) -> TrainerCensus:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _describe(pid: int) -> str:
    """A process as the census saw it: pid, state and parent (/proc/PID/stat), command line."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError as err:
        return f"{pid}: gone ({err})"
    return f"{pid} state {fields[0]} parent {fields[1]} at {time.time():.2f}: {cmd}"


def losses(log: str) -> dict[int, list[float]]:
    """Every loss each step was logged with, in order (a step trained twice has two)."""
    out: dict[int, list[float]] = {}
    for row in metric_lines(log):
        out.setdefault(int(row["step"]), []).append(float(row["loss"]))
    return out


async def kopf_logged_in() -> Any:
    """kopf's settings, with its client logged in from $KUBECONFIG (as kopf.run does): for
    tests that drive kopf's observers against the local cluster without a whole operator."""
    import kopf
    from kopf._cogs.clients import auth
    from kopf._cogs.structs import credentials

    settings = kopf.OperatorSettings()
    vault = credentials.Vault()
    info = kopf.login_with_kubeconfig(settings=settings)
    assert info is not None
    await vault.populate({"kubeconfig": info})
    auth.vault_var.set(vault)
    return settings
