"""Nodes registered by the process kubelet look like EKS trn1.32xlarge workers."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from hlat_testbed.cluster import Cluster
from hlat_testbed.instancetypes import EFA, NEURON, NEURONCORE

pytestmark = pytest.mark.cluster


def test_nodes_carry_instance_type_zone_and_neuron_efa_capacity(
        cluster: Cluster, core: client.CoreV1Api) -> None:
    nodes: Any = core.list_node()
    assert {n.metadata.name for n in nodes.items} >= set(cluster.nodes())
    for node in nodes.items:
        labels, alloc = node.metadata.labels, node.status.allocatable
        assert labels["node.kubernetes.io/instance-type"] == "trn1.32xlarge"
        assert labels["topology.kubernetes.io/zone"].startswith("us-west-2")
        assert (alloc[NEURON], alloc[NEURONCORE], alloc[EFA]) == ("16", "32", "8")


def test_node_leases_are_renewed(cluster: Cluster) -> None:
    coord = client.CoordinationV1Api(cluster.admin_api())
    node = cluster.nodes()[0]
    first: Any = coord.read_namespaced_lease(node, "kube-node-lease")
    time.sleep(cluster.config.lease_renew_s * 2)
    second: Any = coord.read_namespaced_lease(node, "kube-node-lease")
    assert second.spec.renew_time > first.spec.renew_time
    assert second.spec.holder_identity == node
