"""The in-place launcher's view of its restart record on the real local API server, with the
credentials a worker has: the Role the operator builds for the job's workers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kubernetes import client

from hlat_api import labels, load_job
from hlat_api.apitimeouts import bound_requests
from hlat_api.gang import GangRecord
from hlat_operator.builders import JobRef, build_role
from hlat_testbed.cluster import Cluster
from hlat_testbed.kube import api_client
from hlat_testbed.testing import wait_for
from hlat_trainer.agent import REPORT_TRIES, LeaseControl

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrainjob-tiny.yaml"


def workers_with_the_operator_s_role(cluster: Cluster, namespace: str, attempt: int = 0
                                     ) -> client.ApiClient:
    """A client with the token of a service account bound to `build_role` of job `tiny` at
    `attempt`."""
    api = cluster.admin_api()
    rbac = client.RbacAuthorizationV1Api(api)
    role = build_role(JobRef("tiny", namespace, "uid"), load_job(EXAMPLE).spec, attempt=attempt)
    role["metadata"] = {"name": "workers"}  # no owner: there is no job to own it here
    rbac.create_namespaced_role(namespace, role)
    client.CoreV1Api(api).create_namespaced_service_account(
        namespace, {"metadata": {"name": "workers"}})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "workers"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "workers"},
        "subjects": [{"kind": "ServiceAccount", "name": "workers", "namespace": namespace}]})
    return bound_requests(api_client(cluster.service_account_kubeconfig(namespace, "workers")))


def test_a_launcher_watches_its_restart_record_with_the_workers_own_role(
        cluster: Cluster, namespace: str) -> None:
    """A new attempt reaches the launcher through its watch as soon as it is published (no
    poll interval in between), which the workers' Role allows on the record alone."""
    admin = client.CoordinationV1Api(cluster.admin_api())
    gang = labels.gang_lease_name("tiny")
    first = GangRecord(attempt=0, ranks={"tiny-a0-0": 0, "tiny-a0-1": 1})
    admin.create_namespaced_lease(namespace, {"metadata": {
        "name": gang, "annotations": first.to_annotations()}, "spec": {}})
    worker = client.CoordinationV1Api(workers_with_the_operator_s_role(cluster, namespace))
    control = LeaseControl(worker, namespace, gang, "tiny", node_rank=1)
    control.start_watch()
    try:
        _sees_new_attempts_through_its_watch(control, admin, namespace, gang, first)
    finally:
        control.stop_watch()
    # the same token may not watch (nor read) any other Lease of the namespace
    admin.create_namespaced_lease(namespace, {"metadata": {"name": "other"}, "spec": {}})
    with pytest.raises(client.exceptions.ApiException) as denied:
        worker.list_namespaced_lease(namespace, field_selector="metadata.name=other",
                                     watch=True, timeout_seconds=1)
    assert denied.value.status == 403


def _sees_new_attempts_through_its_watch(control: LeaseControl, admin: client.CoordinationV1Api,
                                         namespace: str, gang: str, first: GangRecord) -> None:
    wait_for(lambda: control.pushed, 30, "the launcher's watch of its restart record")
    assert control.record() == first

    published = time.monotonic()
    second = GangRecord(attempt=1, steps_done=40, ranks={"tiny-a0-0": 0, "tiny-a0-1": 1},
                        master_addr="tiny-0.tiny")
    admin.patch_namespaced_lease(gang, namespace, {"metadata": {
        "annotations": second.to_annotations()}})
    wait_for(lambda: control.record() == second, 10, "the new attempt seen by the launcher")
    seen = time.monotonic() - published
    assert control.pushed, "seen by a poll, not the watch"
    print(f"new attempt seen {seen * 1000:.0f} ms after it was published")
    assert control.record(fresh=True) == second  # and a read of its own agrees


class CountedPatches(client.CoordinationV1Api):
    """The API server's Lease API, counting the launcher's patches (its exit reports)."""

    patches = 0

    def patch_namespaced_lease(self, *args: object, **kwargs: object) -> object:
        self.patches += 1
        return super().patch_namespaced_lease(*args, **kwargs)  # type: ignore[arg-type]


def test_an_exit_report_refused_once_the_next_attempt_began_is_dropped_at_once(
        cluster: Cluster, namespace: str) -> None:
    """The operator moved on: the workers' Role names attempt 1's Leases only and the record
    attempt 1. The launcher's report of attempt 0's exit is refused, and it does not retry
    (which kept it from starting attempt 1's trainer for a second and a half); while the
    record has not moved on, a refusal is retried (the authorizer may lag a moment)."""
    admin = client.CoordinationV1Api(cluster.admin_api())
    gang = labels.gang_lease_name("tiny")
    admin.create_namespaced_lease(namespace, {"metadata": {
        "name": gang, "annotations": GangRecord(attempt=1).to_annotations()}, "spec": {}})
    admin.create_namespaced_lease(namespace, {
        "metadata": {"name": labels.worker_lease_name("tiny", 0, 0)}, "spec": {}})
    worker = CountedPatches(workers_with_the_operator_s_role(cluster, namespace, attempt=1))
    control = LeaseControl(worker, namespace, gang, "tiny", node_rank=0)
    control.report_exit(0, 0, 1)
    assert worker.patches == 1

    admin.patch_namespaced_lease(gang, namespace, {"metadata": {
        "annotations": GangRecord(attempt=0).to_annotations()}})
    control.report_exit(0, 0, 1)
    assert worker.patches == 1 + REPORT_TRIES


def test_a_peers_report_reaches_the_lease_the_operator_watches_and_is_cleared(
        cluster: Cluster, namespace: str) -> None:
    """With the workers' own Role: a report of an unreachable neighbour lands on the Lease of
    this node's rank in the attempt with the label the operator's watch selects (so it acts at
    once), beside the trainer's own annotations; clearing it leaves `[]`, drops the time, and
    keeps the label (an exit report may share it)."""
    from datetime import UTC, datetime

    from hlat_api.heartbeat import Heartbeat

    admin = client.CoordinationV1Api(cluster.admin_api())
    name = labels.worker_lease_name("tiny", 0, 1)
    trainer = Heartbeat(attempt=0, step=7).to_annotations()
    admin.create_namespaced_lease(namespace, {"metadata": {
        "name": name, "labels": {labels.JOB: "tiny"}, "annotations": trainer}, "spec": {}})
    worker = client.CoordinationV1Api(workers_with_the_operator_s_role(cluster, namespace))
    control = LeaseControl(worker, namespace, labels.gang_lease_name("tiny"), "tiny",
                           node_rank=0)  # a promoted spare: created as rank 0, runs rank 1
    since = datetime.now(UTC)
    assert control.report_unreachable(0, 1, [2], since)
    meta = admin.read_namespaced_lease(name, namespace).metadata
    beat = Heartbeat.from_annotations(meta.annotations)
    assert beat is not None and beat.unreachable_ranks == [2] and beat.step == 7
    assert beat.unreachable_since is not None
    assert abs((beat.unreachable_since - since).total_seconds()) < 0.001
    assert meta.labels[labels.REPORTED] == "peers"
    assert control.report_unreachable(0, 1, [], None)
    meta = admin.read_namespaced_lease(name, namespace).metadata
    beat = Heartbeat.from_annotations(meta.annotations)
    assert beat is not None and beat.unreachable_ranks == [] and beat.unreachable_since is None
    assert meta.labels[labels.REPORTED] == "peers" and beat.step == 7
    # another attempt's Lease is not this Role's: refused, and not made again (the attempt
    # is over)
    assert control.report_unreachable(3, 1, [2], since)
