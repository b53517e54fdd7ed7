"""The real controllers act on what the process kubelet reports: GC and node lifecycle."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from hlat_testbed import faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.testing import python_pod, read_pod, wait_for, wait_pod_running

pytestmark = pytest.mark.cluster

UNREACHABLE = "node.kubernetes.io/unreachable"


def test_garbage_collector_deletes_pods_of_a_deleted_owner(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    owner: Any = core.create_namespaced_config_map(namespace, {  # type: ignore[arg-type]
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    for name in ("owned-0", "owned-1"):
        pod = python_pod(name, "import time; time.sleep(600)")
        pod["metadata"]["ownerReferences"] = [ref]
        core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    for name in ("owned-0", "owned-1"):
        wait_pod_running(core, namespace, name)
    core.delete_namespaced_config_map("owner", namespace)
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, 60,
             "the garbage collector to delete the owned pods")


def _node_state(core: client.CoreV1Api, name: str) -> tuple[str, set[str]]:
    node: Any = core.read_node(name)
    ready = next(c.status for c in node.status.conditions if c.type == "Ready")
    return ready, {t.key for t in node.spec.taints or []}


def test_node_taken_down_turns_not_ready_with_the_unreachable_taint_and_recovers(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    node = cluster.nodes()[1]
    pod = python_pod("on-lost-node", "import time; time.sleep(600)",
                     nodeSelector={"kubernetes.io/hostname": node})
    core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    wait_pod_running(core, namespace, "on-lost-node")
    faults.node_down(cluster.config, node)
    try:
        wait_for(lambda: (s := _node_state(core, node))[0] == "Unknown" and UNREACHABLE in s[1],
                 cluster.config.node_monitor_grace_s + 30, f"{node} NotReady and tainted")
        # the pod's process died with the node, but nobody can report it: still Running
        assert read_pod(core, namespace, "on-lost-node").status.phase == "Running"
    finally:
        faults.node_up(cluster.config, node)
    wait_for(lambda: _node_state(core, node) == ("True", set()), 60,
             f"{node} Ready without taints again")
