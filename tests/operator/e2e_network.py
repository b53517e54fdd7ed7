"""The rig as a network of two layer-3 blocks, for the topology tests (test_e2e_topology.py,
test_e2e_kueue.py): two nodes added to the session's three, the five labelled with EKS's
`topology.k8s.aws/network-node-layer-1..3` as blocks of sizes 2 and 3 whose members' names
interleave (so that name order, the scheduler's tie-break, is not topology order). The rig's
own labels (each node its own block, eksnodes.py) are put back after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kubernetes import client

from hlat_testbed.cluster import Cluster

L1, L2, L3 = (f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3))
FIRST_INDEX = 50  # pod ranges clear of the session's node-<i> and test_e2e_eks_nodes' pools
BLOCKS = {"nn-blk-a": ("node-0", "net-1"), "nn-blk-b": ("node-1", "node-2", "net-0")}
BLOCK_OF = {node: block for block, nodes in BLOCKS.items() for node in nodes}


@contextmanager
def labelled_network(cluster: Cluster) -> Iterator[dict[str, str]]:
    """Node -> its layer-3 block, on five nodes (the session's three and two more)."""
    core = client.CoreV1Api(cluster.admin_api())
    added = cluster.add_node_pool("net", 2, "trn1.32xlarge", "managed", FIRST_INDEX)
    saved = {}
    try:
        for node, block in BLOCK_OF.items():
            labels = core.read_node(node).metadata.labels
            saved[node] = {k: labels.get(k) for k in (L1, L2, L3)}
            core.patch_node(node, {"metadata": {"labels": {
                L1: "nn-e2e-top", L2: "nn-e2e-mid", L3: block}}})
        yield BLOCK_OF
    finally:
        for node, labels in saved.items():
            if node not in added:
                core.patch_node(node, {"metadata": {"labels": labels}})
        cluster.remove_nodes(added)
