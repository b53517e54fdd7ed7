"""Simulated nodes (bench_operator_scale's): the real scheduler binds only pods that ask for
them, the simulator reports them Running, a fault reports the container terminated, and a
pod being deleted is removed at once."""

from __future__ import annotations

import random

import pytest
from kubernetes import client

from hlat_testbed import simnodes
from hlat_testbed.cluster import Cluster
from hlat_testbed.testing import python_pod, read_pod, wait_for

pytestmark = pytest.mark.cluster


def _pod(name: str, simulated: bool) -> dict[str, object]:
    if not simulated:
        return python_pod(name, "pass")
    return python_pod(name, "pass", nodeSelector={simnodes.LABEL: "true"},
                      tolerations=[simnodes.TOLERATION])


def test_simulated_nodes_run_the_pods_that_ask_for_them_and_fail_them_on_demand(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    nodes = simnodes.SimNodes(cluster.admin_api(), 2, prefix="simtest", pods=4).start()
    try:
        for i in range(3):
            core.create_namespaced_pod(namespace, _pod(f"w-{i}", True))  # type: ignore[arg-type]
        core.create_namespaced_pod(namespace, _pod("other", False))  # type: ignore[arg-type]

        def running() -> bool:
            pods = [read_pod(core, namespace, f"w-{i}") for i in range(3)]
            return all(p.status.phase == "Running" and p.status.pod_ip for p in pods)

        wait_for(running, 60, "the simulated nodes' pods running")
        assert {read_pod(core, namespace, f"w-{i}").spec.node_name for i in range(3)} <= {
            "simtest-0", "simtest-1"}
        other = read_pod(core, namespace, "other")
        assert not (other.spec.node_name or "").startswith("simtest")  # the taint keeps it off

        hit = nodes.fail(random.Random(0), exit_code=137)
        assert hit is not None and hit[0] == namespace
        failed = read_pod(core, namespace, hit[1])
        assert failed.status.phase == "Failed"
        assert failed.status.container_statuses[0].state.terminated.exit_code == 137

        core.delete_namespaced_pod("w-0", namespace)
        wait_for(lambda: "w-0" not in {p.metadata.name for p in
                                       core.list_namespaced_pod(namespace).items},
                 30, "the deleted pod removed by its simulated node")
    finally:
        nodes.stop()
        nodes.remove()
