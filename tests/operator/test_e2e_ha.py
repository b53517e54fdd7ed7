"""Two operator replicas with leader election on the local cluster: the standby finishes the
restart the leader began, with one gang and nothing counted twice."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest
from e2e_env import Env
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed import chart, faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import OperatorProcess
from hlat_testbed.testing import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LEASE_SECONDS = 6


def _holder(api: client.ApiClient, name: str) -> str | None:
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(name, chart.NAMESPACE)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return lease.spec.holder_identity  # type: ignore[no-any-return]


def _pid_of(identity: str) -> int:
    return int(identity.split("-")[-2])  # <hostname>-<pid>-<random>


def test_a_standby_operator_takes_over_mid_restart(
        cluster: Cluster, crd: None, namespace: str, sample_data: Path, tmp_path: Path) -> None:
    fsx = tmp_path / "fsx"
    shutil.copytree(sample_data, fsx / "data" / "sample")
    cluster.create_shared_volume(namespace, "fsx", fsx)
    lease = f"hlat-operator-{uuid.uuid4().hex[:5]}"
    env = {"HLAT_OPERATOR_LEADER_ELECTION": "true",
           "HLAT_OPERATOR_LEADER_ELECTION_NAMESPACE": chart.NAMESPACE,
           "HLAT_OPERATOR_LEADER_ELECTION_NAME": lease,
           "HLAT_OPERATOR_LEADER_LEASE_SECONDS": str(LEASE_SECONDS),
           "HLAT_OPERATOR_LEADER_RENEW_DEADLINE_SECONDS": "4",
           "HLAT_OPERATOR_LEADER_RETRY_SECONDS": "1"}
    kubeconfig = chart.operator_kubeconfig(cluster)
    api = cluster.admin_api()
    replicas = [OperatorProcess(cluster, tmp_path / f"operator-{i}.log", [namespace], env,
                                kubeconfig) for i in range(2)]
    try:
        replicas[0].start()
        first = wait_for(lambda: _holder(api, lease), 30, "a leader")
        replicas[1].start()
        leader = next(r for r in replicas if r.pid == _pid_of(first))
        standby = next(r for r in replicas if r is not leader)
        job = Env(cluster, namespace, fsx, {"op": leader})
        job.create(tiny_spec(steps=30, backoff={"initialSeconds": 4, "maxSeconds": 8}))
        job.wait_saved(4)  # step 2 complete (by the log: the status lags)
        assert "standby until it holds the Lease" in standby.log_path.read_text()
        faults.kill(cluster.config, namespace, "tiny-a0-0")
        job.wait_phase("Restarting", 30)
        leader.kill()  # mid-recovery: the old gang going away
        killed = time.monotonic()
        second = wait_for(lambda: (h := _holder(api, lease)) != first and h, 30, "a new leader")
        assert _pid_of(second) == standby.pid
        took = time.monotonic() - killed
        assert took <= LEASE_SECONDS + 1 + 5, took  # the lease + a retry + slack
        done = job.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
        assert done["attempt"] == 1
        assert done["restarts"] == {"total": 1, "counted": 1}  # not counted again
        assert done["progress"]["step"] == 30
        assert job.max_gangs == 1
        job.delete()
    finally:
        for replica in replicas:
            replica.stop()
