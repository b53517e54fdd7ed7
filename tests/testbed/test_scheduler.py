"""The real scheduler places pods by the nodes' Neuron/EFA capacity and by node affinity."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from hlat_testbed.cluster import Cluster
from hlat_testbed.instancetypes import EFA, NEURON
from hlat_testbed.testing import python_pod, read_pod, wait_for, wait_pod_running

pytestmark = pytest.mark.cluster

SLEEP = "import time; time.sleep(600)"


def _whole_node_pod(name: str, node: str) -> dict[str, Any]:
    limits = {NEURON: "16", EFA: "8"}
    return python_pod(name, SLEEP, nodeSelector={"kubernetes.io/hostname": node},
                      container={"resources": {"limits": limits, "requests": limits}})


def _unschedulable_message(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    pod = read_pod(core, namespace, name)
    for cond in pod.status.conditions or []:
        if cond.type == "PodScheduled" and cond.reason == "Unschedulable":
            return str(cond.message)
    return None


def test_sixteen_neuron_devices_fit_one_node_and_a_second_such_pod_does_not(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    node = cluster.nodes()[-1]
    core.create_namespaced_pod(namespace, _whole_node_pod("first", node))  # type: ignore[arg-type]
    first = wait_pod_running(core, namespace, "first")
    assert first.spec.node_name == node
    core.create_namespaced_pod(namespace, _whole_node_pod("second", node))  # type: ignore[arg-type]
    message = wait_for(lambda: _unschedulable_message(core, namespace, "second"), 30,
                       "the second pod to be unschedulable")
    assert f"Insufficient {NEURON}" in message
    assert read_pod(core, namespace, "second").spec.node_name is None


def test_node_affinity_not_in_keeps_pods_off_a_node(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    avoided = cluster.nodes()[0]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [avoided]}]}]}}}
    names = [f"spread-{i}" for i in range(4)]
    for name in names:
        core.create_namespaced_pod(namespace, python_pod(name, SLEEP, affinity=affinity))  # type: ignore[arg-type]
    placed = {wait_pod_running(core, namespace, name).spec.node_name for name in names}
    assert avoided not in placed
    assert placed <= set(cluster.nodes())
