"""In-place restarts end to end (`faultTolerance.restartStrategy: InPlace`): the pods stay and
their launchers restart the trainers for the new attempt; only pods that are gone are
recreated. Checked at every poll: at most one trainer process per node rank (the launchers'
`hlat-trainer` children) and one gang. The losses of the steps the new attempt trained again
equal the first attempt's bit for bit (the same run, resumed exactly)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from e2e_env import (
    JOB,
    Env,
    TrainerCensus,
    attempt_log,
    losses,
    report_recovery_log,
    resumed_from,
)
from e2e_spec import tiny_spec
from kubernetes import client

from hlat_api import labels
from hlat_api.layout import list_checkpoints
from hlat_testbed import cgroups, faults

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def in_place_spec(steps: int, **fault_tolerance: object) -> dict[str, object]:
    return tiny_spec(steps=steps, restartStrategy="InPlace", **fault_tolerance)


def run_fault(job_env: Env, inject: Callable[[], object], reason: str | set[str],
              steps: int = 40, template: dict[str, object] | None = None,
              restart_within: float = 60, **ft: object) -> Iterator[dict[str, object]]:
    spec = in_place_spec(steps, **ft)
    if template is not None:
        spec["template"] = template
    job_env.create(spec)
    with TrainerCensus(job_env) as census:
        job_env.wait_saved(4)  # step 2 complete (by the log: the status lags)
        before = {p.metadata.name: p.metadata.uid for p in job_env.pods()}
        fault_at = time.time()
        inject()
        restarting = job_env.wait("the restart", lambda s: s.get("attempt", 0) >= 1, 60)
        reasons = {reason} if isinstance(reason, str) else reason
        assert restarting["lastFailure"]["reason"] in reasons, restarting["lastFailure"]
        done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    yield {"done": done, "before": before, "fault_at": fault_at, "census": census}


def check_in_place(job_env: Env, r: dict[str, object], kept: int, counted: int = 1) -> None:
    done, before = r["done"], r["before"]
    assert isinstance(done, dict) and isinstance(before, dict)
    assert done["restarts"] == {"total": 1, "counted": counted, "inPlace": 1}, done["restarts"]
    assert done["attempt"] == 1
    after = {p.metadata.name: p.metadata.uid for p in job_env.pods()}
    assert len(set(before.items()) & set(after.items())) == kept, (before, after)
    census = r["census"]
    assert isinstance(census, TrainerCensus)
    assert census.most == 1, f"two trainers of one node rank ran at once: {census.worst}"
    assert census.most_pods == 1, "two live pods of one node rank"
    log = job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0")
    seen = losses(log)
    assert max(seen) == 40
    again = {step: ls for step, ls in seen.items() if len(ls) > 1}
    for step, ls in again.items():  # trained again after the resume: the same numbers
        assert ls[0] == ls[-1], (step, ls)
    assert {"Created", "Completed"} <= set(job_env.events())


def test_a_killed_trainer_restarts_in_place(job_env: Env) -> None:
    victim = f"{JOB}-a0-1"
    r = next(run_fault(job_env, lambda: faults.kill_trainer(
        job_env.cluster.config, job_env.ns, victim), "Killed"))
    check_in_place(job_env, r, kept=2)
    report_recovery_log(job_env, "trainer SIGKILLed, in place",
                        job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0"), 1,
                        float(r["fault_at"]))  # type: ignore[arg-type]


def test_a_trainer_out_of_memory_is_reported_and_restarted_in_place(job_env: Env) -> None:
    """The trainer that takes /fsx/leak (HLAT_FAULT_LEAK_ONCE) allocates without bound until
    the kernel kills it at its container's 3Gi limit (the rig enforces it in a memory cgroup,
    as a runtime does): its launcher reports OOMKilled (the group counted the kill), not a
    plain SIGKILL; the trainers restart in place, the pods kept.

    The heartbeat timeout is set far above the kill's time: near its limit the kernel first
    reclaims the group's file pages (the trainer's mapped libraries, which its threads then
    fault in again), and in one full run that took over 22 s, the auto timeout: the hang
    detector, rightly, restarted a trainer that made no progress, before the OOM kill came
    (a CI failure, 2026-11-28). Which detector fires first is not what this test is about."""
    if not cgroups.can_limit_memory():
        pytest.skip("no writable memory cgroup on this machine: limits are not enforced")
    template = {"spec": {"containers": [{
        "name": "trainer", "resources": {"limits": {"memory": "3Gi"}},
        "env": [{"name": "HLAT_FAULT_LEAK_ONCE", "value": "/fsx/leak"}]}]}}
    r = next(run_fault(job_env, lambda: (job_env.fsx / "leak").write_text("x"), "OOMKilled",
                       template=template, restart_within=300,
                       heartbeat={"startupTimeoutSeconds": 120, "timeoutSeconds": 600}))
    check_in_place(job_env, r, kept=2)
    done = r["done"]
    assert isinstance(done, dict)
    assert "ran out of memory" in done["lastFailure"]["message"], done["lastFailure"]
    assert "OOMKilled" in set(job_env.events())
    report_recovery_log(job_env, "trainer out of memory (container limit), in place",
                        job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0"), 1,
                        float(r["fault_at"]))  # type: ignore[arg-type]


def test_a_hung_trainer_is_restarted_in_place(job_env: Env) -> None:
    """SIGSTOP to rank 1's trainer only (its launcher and node fine: a stuck collective)."""
    timeout = 6
    victim = f"{JOB}-a0-1"
    r = next(run_fault(job_env, lambda: faults.hang_trainer(
        job_env.cluster.config, job_env.ns, victim), "HeartbeatTimeout",
        heartbeat={"startupTimeoutSeconds": 120, "timeoutSeconds": timeout}))
    check_in_place(job_env, r, kept=2)
    report_recovery_log(job_env, f"trainer hung (SIGSTOP, timeout {timeout}s), in place",
                        job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0"), 1,
                        float(r["fault_at"]))  # type: ignore[arg-type]


def test_a_lost_node_s_pod_alone_is_recreated(job_env: Env) -> None:
    victim = f"{JOB}-a0-1"
    node = ""

    def node_down() -> None:
        nonlocal node
        pod = job_env.core.read_namespaced_pod(victim, job_env.ns)
        node = pod.spec.node_name
        faults.node_down(job_env.cluster.config, node)

    try:
        r = next(run_fault(job_env, node_down, "NodeLost", heartbeat={
            "startupTimeoutSeconds": 120, "timeoutSeconds": 60}))  # the node is lost first
    finally:
        if node:
            faults.node_up(job_env.cluster.config, node)
    check_in_place(job_env, r, kept=1, counted=0)  # an infrastructure fault
    names = {p.metadata.name for p in job_env.pods()}
    assert names == {f"{JOB}-a0-0", f"{JOB}-a1-1"}, names
    report_recovery_log(job_env, "node lost, in place (its pod recreated)",
                        job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0"), 1,
                        float(r["fault_at"]))  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["deleted", "evicted"])
def test_a_deleted_or_evicted_pod_alone_is_recreated(job_env: Env, how: str) -> None:
    """Rank 1's pod deleted (kubectl delete) or evicted (the Eviction API, as a drain does):
    only that pod is recreated, rank 0's pod and its launcher are kept. Both are
    infrastructure faults (not counted against the budget)."""
    victim = f"{JOB}-a0-1"

    def remove() -> None:
        if how == "deleted":
            job_env.core.delete_namespaced_pod(victim, job_env.ns)
        else:
            # a drain that goes ahead anyway: the job's PodDisruptionBudget refuses evictions
            # (test_e2e_disruption), so an admin removes it first; the in-place attempt
            # makes it again
            client.PolicyV1Api(job_env.cluster.admin_api()).delete_namespaced_pod_disruption_budget(
                JOB, job_env.ns)
            job_env.core.create_namespaced_pod_eviction(victim, job_env.ns, client.V1Eviction(
                metadata=client.V1ObjectMeta(name=victim, namespace=job_env.ns)))

    # an eviction seen only once the pod is gone reads as PodDeleted (both infrastructure)
    reasons = {"PodDeleted"} if how == "deleted" else {"Evicted", "PodDeleted"}
    r = next(run_fault(job_env, remove, reasons))
    check_in_place(job_env, r, kept=1, counted=0)
    names = {p.metadata.name for p in job_env.pods()}
    assert names == {f"{JOB}-a0-0", f"{JOB}-a1-1"}, names
    report_recovery_log(job_env, f"pod {how}, in place (that pod recreated)",
                        job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0"), 1,
                        float(r["fault_at"]))  # type: ignore[arg-type]


def test_in_place_attempts_that_keep_failing_fall_back_to_a_new_gang(job_env: Env) -> None:
    """While a file on the shared volume exists every starting trainer exits 1: attempts 1 and
    2 (in place) fail before training, so restart 3 recreates the gang; with the file gone
    attempt 3 finishes."""
    flag = job_env.fsx / "break-starts"
    spec = in_place_spec(30)
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "HLAT_FAULT_EXIT_WHILE_EXISTS", "value": "/fsx/break-starts"}]}]}}
    job_env.create(spec)
    job_env.wait_saved(4)  # step 2 complete (by the log: the status lags)
    flag.write_text("x")
    faults.kill_trainer(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1")
    third = job_env.wait("restart 3", lambda s: s.get("restarts", {}).get("total", 0) >= 3, 120)
    flag.unlink()
    assert third["restarts"]["inPlace"] == 2, third["restarts"]
    message = next(c["message"] for c in third["conditions"] if c["type"] == "Restarting")
    assert "in-place attempts in a row failed" in message, message
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    assert done["attempt"] == 3 and done["restarts"]["total"] == 3
    assert {p.metadata.name for p in job_env.pods()} == {f"{JOB}-a3-0", f"{JOB}-a3-1"}


def test_rank_0_s_failed_pod_moves_to_a_warm_spare_which_becomes_the_master(job_env: Env
                                                                          ) -> None:
    """Rank 0's pod fails as a whole (its launcher killed: no in-place restart for it): the
    ready spare takes rank 0, and with it the rendezvous master's address; rank 1's pod is
    kept, its trainer finds the new master, and the job finishes."""
    victim = f"{JOB}-a0-0"

    def pod_fails() -> None:
        job_env.wait("the spare ready", lambda s: (s.get("spares") or {}).get("ready") == 1, 60)
        faults.kill(job_env.cluster.config, job_env.ns, victim)

    # steps enough that the job still trains once the spare is ready on a loaded machine
    r = next(run_fault(job_env, pod_fails, {"Killed", "PodFailed"}, steps=100, spareNodes=1))
    done, before = r["done"], r["before"]
    assert isinstance(done, dict) and isinstance(before, dict)
    assert done["spares"]["promoted"] == 1, done["spares"]
    pods = {p.metadata.name: p for p in job_env.pods()}
    assert pods[f"{JOB}-s0"].metadata.labels["hlat.dev/node-rank"] == "0"
    assert pods[f"{JOB}-a0-1"].metadata.uid == before[f"{JOB}-a0-1"]
    assert done["restarts"]["total"] == 1, done["restarts"]


def test_a_lost_node_s_rank_moves_to_a_warm_spare(job_env: Env) -> None:
    """spareNodes 1 on the rig's 3 nodes: the spare's launcher waits with warm standbys; rank
    1's node goes down; rank 0's launcher finds it unreachable and the operator acts within
    5 s (before the Node turns NotReady); the spare takes rank 1 at once (no pod scheduled, no
    force-delete waited for); rank 0's pod is kept."""
    victim = f"{JOB}-a0-1"
    node = spare_uid = ""
    down_at = 0.0

    def node_down() -> None:
        nonlocal node, spare_uid, down_at
        # the spare comes once the attempt trains: after run_fault's snapshot of the pods
        job_env.wait("the spare ready", lambda s: (s.get("spares") or {}).get("ready") == 1, 60)
        spare_uid = job_env.core.read_namespaced_pod(f"{JOB}-s0", job_env.ns).metadata.uid
        node = job_env.core.read_namespaced_pod(victim, job_env.ns).spec.node_name
        down_at = time.time()
        faults.node_down(job_env.cluster.config, node)

    try:
        r = next(run_fault(job_env, node_down, "NodeLost", spareNodes=1, heartbeat={
            "startupTimeoutSeconds": 120, "timeoutSeconds": 60}))  # the node is lost first
    finally:
        if node:
            faults.node_up(job_env.cluster.config, node)
    done, before = r["done"], r["before"]
    assert isinstance(done, dict) and isinstance(before, dict)
    assert done["restarts"] == {"total": 1, "counted": 0, "inPlace": 1}, done["restarts"]
    assert done["spares"]["promoted"] == 1, done["spares"]
    # found by rank 0's launcher (hlat_trainer.peers), not by the node lifecycle controller
    # (16 s of grace on the rig): within 5 s of the fault
    failure = done["lastFailure"]
    assert "unreachable from its peers" in failure["message"], failure
    at = datetime.fromisoformat(failure["time"].replace("Z", "+00:00")).timestamp()
    detected = at - down_at
    print(f"lost node found by its peers {detected:.2f}s after the fault")
    assert 0 < detected <= 5.0, (detected, failure)
    pods = {p.metadata.name: p for p in job_env.pods()}
    spare = pods[f"{JOB}-s0"]
    assert spare.metadata.uid == spare_uid  # the same pod, now rank 1
    assert spare.metadata.labels["hlat.dev/node-rank"] == "1"
    assert "hlat.dev/spare" not in spare.metadata.labels
    assert pods[f"{JOB}-a0-0"].metadata.uid == before[f"{JOB}-a0-0"]
    census = r["census"]
    assert isinstance(census, TrainerCensus)
    # a new spare was requested (it may be gone by now: a finished job stops its spares)
    assert f"{JOB}-s1" in census.names, sorted(census.names)
    deadline = time.monotonic() + 30  # and the finished job's spares do not linger
    while any(q.metadata.labels.get("hlat.dev/spare") and q.metadata.deletion_timestamp is None
              for q in job_env.pods()):
        assert time.monotonic() < deadline, "a spare still runs after the job succeeded"
        time.sleep(0.5)
    assert census.most == 1 and census.most_pods == 1, census.worst
    log = job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0")
    seen = losses(log) | losses(job_env.cluster.pod_log(job_env.ns, f"{JOB}-s0"))
    assert max(seen) == 40
    report_recovery_log(job_env, "node lost, its rank taken by a warm spare", log, 1,
                        float(r["fault_at"]))  # type: ignore[arg-type]


class CommitWatch:
    """When each checkpoint of the job became complete (its `done` marker first seen, sampled
    every 0.05 s: `keep` purges old ones, so the end state would not show them)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.first_seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for entry in list_checkpoints(self.root, JOB):
                if entry.step not in self.first_seen and entry.complete:
                    self.first_seen[entry.step] = now
            self._stop.wait(0.05)

    def __enter__(self) -> CommitWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


FENCED = "not committing"
"""The trainer's warning when it skips a commit: no renewal accepted for the Lease's duration."""


def test_a_trainer_cut_off_from_the_api_server_commits_nothing_once_its_lease_ran_out(
        job_env: Env) -> None:
    """A 1-node job's pod cut off the network (the API server and any peer) but not from the
    shared checkpoint volume: its trainer trains on alone and keeps saving, but once no renewal
    was accepted for the Lease's duration no checkpoint of it is marked complete, while the
    operator, which sees the heartbeat stop, restarts in place (a new attempt that may hold
    the rank at any moment). The partition heals: the launcher replaces the fenced trainer, the
    new attempt resumes from a checkpoint made before the cut, and the steps it trains again
    give the same losses; never two trainers at once."""
    steps, timeout = 400, 8
    spec = tiny_spec(steps=steps, restartStrategy="InPlace",
                     heartbeat={"startupTimeoutSeconds": 120, "timeoutSeconds": timeout})
    spec["nodes"] = 1
    # durable commits are this test's subject: no snapshots (auto by default) to resume from
    spec["checkpoint"].update({"interval": 10, "memoryInterval": "off"})
    job_env.create(spec)
    pod, config = f"{JOB}-a0-0", job_env.cluster.config
    coordination = client.CoordinationV1Api(job_env.cluster.admin_api())
    with TrainerCensus(job_env) as census, CommitWatch(job_env.fsx / "checkpoints") as commits:
        job_env.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                     and (s.get("latestCheckpoint") or {}).get("step", 0) >= 10, 180)
        lease = coordination.read_namespaced_lease(labels.worker_lease_name(JOB, 0, 0),
                                                   job_env.ns)
        assert lease.spec is not None and lease.spec.lease_duration_seconds
        duration = float(lease.spec.lease_duration_seconds)
        stale = faults.trainer_pids(config, job_env.ns, pod)
        assert len(stale) == 1
        cut_at = time.time()
        faults.partition(config, job_env.ns, pod)
        try:
            restarting = job_env.wait("the restart", lambda s: s.get("attempt", 0) >= 1, 60)
            assert restarting["lastFailure"]["reason"] == "HeartbeatTimeout"
            # hold the cut until the stale trainer has refused to commit (its saves go on),
            # 45 s at most
            deadline = time.monotonic() + 45
            while (FENCED not in job_env.cluster.pod_log(job_env.ns, pod)
                   and time.monotonic() < deadline):
                time.sleep(0.5)
        finally:
            faults.heal(config, job_env.ns, pod)
        done = job_env.wait_trained()  # 400 steps: 240 s were not always enough under load
    gone_at = census.last_seen[stale[0]]
    late = {step: at for step, at in commits.first_seen.items()
            if cut_at + duration + 1 < at <= gone_at}
    assert not late, f"the cut-off trainer committed {late} after its lease ran out"
    log = job_env.cluster.pod_log(job_env.ns, pod)
    assert FENCED in attempt_log(log, 0), "the cut-off trainer never tried to commit"
    assert done["restarts"]["total"] == 1 and done["restarts"]["inPlace"] == 1, done["restarts"]
    assert census.most == 1 and census.most_pods == 1, census.worst
    resumed = resumed_from(attempt_log(log, done["attempt"]))
    before_cut = [step for step, at in commits.first_seen.items() if at <= cut_at + duration + 1]
    assert resumed in before_cut, (resumed, commits.first_seen, cut_at)
    seen = losses(log)
    assert max(seen) == steps
    again = {step: ls for step, ls in seen.items() if len(ls) > 1}
    assert again, "no step was trained twice: the new attempt did not resume from before the cut"
    for step, ls in again.items():
        assert ls[0] == ls[-1], (step, ls)
