"""Heartbeats on the real local API server: a trainer in a rig pod renews its own Lease with
its pod's service-account token, and that token cannot touch another pod's Lease."""

from __future__ import annotations

import datetime
import itertools
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from hlat_api import ExitCode, Heartbeat
from hlat_api.heartbeat import CHECKPOINT_REQUEST
from hlat_testbed.cluster import Cluster
from hlat_testbed.testing import WaitTimeout, python_pod, terminated, wait_for, wait_pod_phase
from hlat_trainer.heartbeat import LeaseHeartbeat

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def grant_own_lease(cluster: Cluster, namespace: str, lease: str,
                    verbs: tuple[str, ...] = ("get", "update", "patch")) -> None:
    """What the operator sets up per job: the pod may get/update/patch (and, as the operator's
    Role allows, watch) only its Lease. Without `watch`: a Role an operator of an earlier
    version made."""
    api = cluster.admin_api()
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "trainer"}})
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "own-lease"},
        "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                   "resourceNames": [lease], "verbs": list(verbs)}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "own-lease"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "own-lease"},
        "subjects": [{"kind": "ServiceAccount", "name": "trainer", "namespace": namespace}]})
    coord = client.CoordinationV1Api(api)
    for name in ("w-0", "w-1"):
        coord.create_namespaced_lease(namespace, {"metadata": {"name": name}, "spec": {}})


def start_trainer(cluster: Cluster, namespace: str, config: Path) -> None:
    """A trainer pod `w-0` as the operator would run it: its Lease w-0, attempt 0, beats
    every 0.5 s, the service account of `grant_own_lease`."""
    env = [{"name": k, "value": v} for k, v in {
        "HLAT_HEARTBEAT_LEASE": "w-0", "HLAT_NAMESPACE": namespace, "HLAT_POD_NAME": "w-0",
        "HLAT_HEARTBEAT_PERIOD_SECONDS": "0.5", "HLAT_ATTEMPT": "0", "OMP_NUM_THREADS": "1"}.items()]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w-0"}, "spec": {
        "restartPolicy": "Never", "serviceAccountName": "trainer",
        "containers": [{"name": "trainer", "image": "host", "env": env,
                        "command": [sys.executable, "-m", "hlat_trainer", "--config", str(config)]}]}}
    client.CoreV1Api(cluster.admin_api()).create_namespaced_pod(namespace, pod)


def read_beat(cluster: Cluster, namespace: str, name: str) -> tuple[Heartbeat | None, Any]:
    lease: Any = client.CoordinationV1Api(cluster.admin_api()).read_namespaced_lease(name, namespace)
    return Heartbeat.from_annotations(lease.metadata.annotations), lease.spec.renew_time


def test_trainer_renews_its_lease_with_progress(
    cluster: Cluster, namespace: str, write_config: Callable[..., Path]
) -> None:
    grant_own_lease(cluster, namespace, "w-0")
    # long enough for several 0.5 s beats while training (30 tiny steps took about one period:
    # the beat past step 3 was sometimes never published before the trainer finished)
    config = write_config(train__steps=600, checkpoint__interval=200)
    start_trainer(cluster, namespace, config)

    renewals = set()
    core = client.CoreV1Api(cluster.admin_api())

    def training() -> Heartbeat | None:
        beat, renewed = read_beat(cluster, namespace, "w-0")
        renewals.add(renewed)
        phase = core.read_namespaced_pod("w-0", namespace).status.phase
        assert phase in ("Pending", "Running"), (phase, cluster.pod_log(namespace, "w-0")[-3000:])
        return beat if beat and beat.phase == "training" and beat.step >= 3 else None

    try:
        beat = wait_for(training, 240, "a training heartbeat past step 3", interval=0.2)
    except WaitTimeout as err:
        pod = core.read_namespaced_pod("w-0", namespace)
        raise AssertionError(f"{err}; pod {pod.status.phase} on {pod.spec.node_name}: "
                             f"{pod.status.conditions}; log: "
                             f"{cluster.pod_log(namespace, 'w-0')[-3000:]}") from err
    assert beat.loss is not None and beat.tokens > 0 and beat.step_seconds and beat.attempt == 0
    done = wait_pod_phase(client.CoreV1Api(cluster.admin_api()), namespace, "w-0",
                          {"Succeeded", "Failed"}, timeout=300)
    assert terminated(done).exit_code == 0, cluster.pod_log(namespace, "w-0")[-3000:]
    final, _ = read_beat(cluster, namespace, "w-0")
    assert final is not None and final.phase == "finished"
    assert (final.step, final.checkpoint_step) == (600, 600)
    # the loop's own clock moved on with it, and the saves' length was reported
    assert beat.progress_time and final.progress_time and final.progress_time > beat.progress_time
    assert final.checkpoint_seconds is not None and final.checkpoint_seconds > 0
    assert len(renewals - {None}) >= 2, "renewTime advances"


def test_a_pod_token_cannot_touch_another_pods_lease(cluster: Cluster, namespace: str) -> None:
    grant_own_lease(cluster, namespace, "w-0")
    script = """
        from kubernetes import client, config
        from kubernetes.client.exceptions import ApiException
        config.load_incluster_config()
        api = client.CoordinationV1Api()
        body = {"metadata": {"annotations": {"hlat.dev/step": "7"}}}
        api.patch_namespaced_lease("w-0", "NAMESPACE", body)
        try:
            api.patch_namespaced_lease("w-1", "NAMESPACE", body)
            print("OTHER-LEASE-PATCHED")
        except ApiException as err:
            print("OTHER-LEASE-DENIED", err.status)
    """.replace("NAMESPACE", namespace)
    pod = python_pod("prober", script, serviceAccountName="trainer")
    core = client.CoreV1Api(cluster.admin_api())
    core.create_namespaced_pod(namespace, pod)
    done = wait_pod_phase(core, namespace, "prober", {"Succeeded", "Failed"}, timeout=120)
    log = cluster.pod_log(namespace, "prober")
    assert terminated(done).exit_code == 0, log
    assert "OTHER-LEASE-DENIED 403" in log
    own, _ = read_beat(cluster, namespace, "w-0")
    other, _ = read_beat(cluster, namespace, "w-1")
    assert own is not None and own.step == 7
    assert other is None


def test_a_trainer_whose_lease_is_taken_away_stops_itself(
    cluster: Cluster, namespace: str, write_config: Callable[..., Path]
) -> None:
    """Fencing on the real API server: the Role is replaced as the operator replaces it for a
    new attempt (naming only that attempt's Leases); the old trainer's next renewal is refused
    (403) and it stops itself with ExitCode.FENCED instead of training on."""
    grant_own_lease(cluster, namespace, "w-0")
    config = write_config(train__steps=5000, checkpoint__interval=10)
    core = client.CoreV1Api(cluster.admin_api())
    start_trainer(cluster, namespace, config)

    def training() -> Heartbeat | None:
        beat, _ = read_beat(cluster, namespace, "w-0")
        return beat if beat and beat.phase == "training" and beat.step >= 3 else None

    wait_for(training, 240, "a training heartbeat past step 3", interval=0.2)
    client.RbacAuthorizationV1Api(cluster.admin_api()).patch_namespaced_role(
        "own-lease", namespace, {"rules": [{
            "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
            "resourceNames": ["w-1"], "verbs": ["get", "update", "patch"]}]})
    fenced_at, _ = read_beat(cluster, namespace, "w-0")
    done = wait_pod_phase(core, namespace, "w-0", {"Succeeded", "Failed"}, timeout=120)
    log = cluster.pod_log(namespace, "w-0")
    assert terminated(done).exit_code == ExitCode.FENCED, log[-3000:]
    assert "its attempt is over" in log
    last, _ = read_beat(cluster, namespace, "w-0")
    assert fenced_at is not None and last is not None and last.step < 5000


def test_the_renewal_loop_renews_once_per_period_as_it_runs(cluster: Cluster,
                                                            namespace: str) -> None:
    """The heartbeat thread against the real API server, its renewals counted from the
    Lease's watch over twelve periods: one per period (a loop that slept twice the period, or
    the period plus each call's latency, would show), none missed."""
    grant_own_lease(cluster, namespace, "w-0")
    coord = client.CoordinationV1Api(cluster.admin_api())
    renewals: list[datetime.datetime] = []
    ready, done = threading.Event(), threading.Event()

    def observe() -> None:
        w = watch.Watch()
        ready.set()
        for event in w.stream(coord.list_namespaced_lease, namespace,
                              field_selector="metadata.name=w-0", timeout_seconds=60):
            renewed = event["object"].spec.renew_time
            if renewed is not None and (not renewals or renewals[-1] != renewed):
                renewals.append(renewed)
            if done.is_set():
                w.stop()

    watcher = threading.Thread(target=observe, daemon=True)
    watcher.start()
    ready.wait(10)
    time.sleep(0.5)  # the watch established
    period, periods = 0.5, 12
    beat = LeaseHeartbeat(coord, namespace, "w-0", "w-0", period, attempt=0).start()
    time.sleep(period * periods + 0.25)
    beat.stop()
    done.set()
    coord.patch_namespaced_lease("w-0", namespace, {"metadata": {"labels": {"end": "1"}}})
    watcher.join(10)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(renewals)]
    assert periods <= len(renewals) <= periods + 2, (len(renewals), gaps)
    assert statistics.median(gaps) == pytest.approx(period, abs=0.05), gaps
    assert max(gaps) < 2 * period, gaps


def test_a_worker_that_starts_training_says_so_at_once_not_a_period_later(
        cluster: Cluster, namespace: str) -> None:
    """The operator's Ready, its recovery time and a spare's release wait for a worker's
    `training`: published when the loop leaves its start, not at the next beat (10 s apart on
    EKS). Checkpoint phases keep to the period (one write per save would double the writes)."""
    grant_own_lease(cluster, namespace, "w-0")
    coord = client.CoordinationV1Api(cluster.admin_api())
    period = 6.0
    beat = LeaseHeartbeat(coord, namespace, "w-0", "w-0", period, attempt=0).start()
    try:
        wait_for(lambda: (read_beat(cluster, namespace, "w-0")[0] or Heartbeat()).attempt == 0,
                 5, "the first renewal")
        _, first = read_beat(cluster, namespace, "w-0")
        beat.update(phase="compiling")  # still starting: no renewal before the period
        beat.update(phase="training", step=1, tokens=8)
        wait_for(lambda: (read_beat(cluster, namespace, "w-0")[0] or Heartbeat()).phase
                 == "training", period / 3, "the training phase on the Lease")
        training, renewed = read_beat(cluster, namespace, "w-0")
        assert training is not None and training.step == 1 and renewed > first
        beat.update(phase="checkpointing")  # a save: kept to the period
        time.sleep(period / 3)
        held, _ = read_beat(cluster, namespace, "w-0")
        assert held is not None and held.phase == "training"
    finally:
        beat.stop()


def test_a_checkpoint_the_operator_asks_for_on_the_lease_is_saved_once(
    cluster: Cluster, namespace: str, write_config: Callable[..., Path]
) -> None:
    """The operator's request (hlat.dev/checkpoint-request on the worker's Lease, as a
    preemption writes it) reaches a real trainer through its renewals' answers (its Role has
    no `watch` here, as an earlier operator's: the watch is refused): it saves the step it
    agreed on, once, between its periodic checkpoints, and reports it complete."""
    grant_own_lease(cluster, namespace, "w-0")
    config = write_config(train__steps=5000, checkpoint__interval=1000)
    start_trainer(cluster, namespace, config)
    coord = client.CoordinationV1Api(cluster.admin_api())

    def training() -> Heartbeat | None:
        beat, _ = read_beat(cluster, namespace, "w-0")
        return beat if beat and beat.phase == "training" and beat.step >= 3 else None

    wait_for(training, 240, "a training heartbeat past step 3", interval=0.2)
    coord.patch_namespaced_lease("w-0", namespace, {"metadata": {"annotations": {
        CHECKPOINT_REQUEST: "4"}}})

    def saved() -> int | None:
        found = re.findall(r"checkpoint step_(\d+): asked for by the operator \(request 4\)",
                           cluster.pod_log(namespace, "w-0"))
        return int(found[0]) if found else None

    step = wait_for(saved, 30, "the checkpoint asked for", interval=0.2)
    assert 3 < step < 1000
    wait_for(lambda: (beat := read_beat(cluster, namespace, "w-0")[0]) is not None
             and beat.checkpoint_step == step, 30, f"step_{step} reported complete")
    time.sleep(1.5)  # three more renewals answered with the same request
    log = cluster.pod_log(namespace, "w-0")
    assert len(re.findall(r"asked for by the operator", log)) == 1, log[-3000:]
    client.CoreV1Api(cluster.admin_api()).delete_namespaced_pod("w-0", namespace,
                                                                grace_period_seconds=0)


def test_a_checkpoint_request_is_seen_when_written_not_at_the_next_renewal(
        cluster: Cluster, namespace: str) -> None:
    """A trainer watching its Lease (`watch_requests`) sees the operator's request as it is
    written: here the renewals are 10 minutes apart, and each request is read within the
    wait's bound with no renewal in between. (The pod token's `watch` by name, as the
    operator's Role grants it, is the restart record's watch too: test_e2e_inplace.)"""
    grant_own_lease(cluster, namespace, "w-0")
    beat = LeaseHeartbeat(client.CoordinationV1Api(cluster.admin_api()), namespace, "w-0",
                          "w-0", 600.0, attempt=0).start().watch_requests()
    try:
        wait_for(lambda: (read_beat(cluster, namespace, "w-0")[0] or Heartbeat()).attempt == 0,
                 10, "the first renewal")
        _, renewed = read_beat(cluster, namespace, "w-0")
        for request in (5, 9):
            client.CoordinationV1Api(cluster.admin_api()).patch_namespaced_lease(
                "w-0", namespace,
                {"metadata": {"annotations": {CHECKPOINT_REQUEST: str(request)}}})
            wait_for(lambda r=request: beat.checkpoint_request == r,  # type: ignore[misc]
                     20, f"request {request} seen by the watch")
        assert read_beat(cluster, namespace, "w-0")[1] == renewed  # no renewal carried them
    finally:
        beat.stop()
