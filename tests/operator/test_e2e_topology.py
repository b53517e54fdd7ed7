"""Network-topology placement end to end (spec.scheduling.topology), through node affinity and
the real kube-scheduler, no Kueue: a job that requires one layer-3 block gets all its nodes in
one block and its node ranks follow the topology; a gang too big for any block waits with the
reason and no pods; a gang that prefers blocks spans as few as hold it, its ranks contiguous
per block, and in slices takes whole slices from each; a gang whose block loses a node it
needs moves whole to the block that holds it; under Volcano's scheduler the same plan holds.

The rig's nodes carry EKS's labels `topology.k8s.aws/network-node-layer-1..3`, each node its
own layer-3 block (eksnodes.py). This module adds two nodes and labels the five as a network of
two layer-3 blocks, of sizes 2 and 3, whose members' names interleave (so that name order, the
scheduler's tie-break, is not topology order), and puts the rig's labels back after (the
`network` fixture, e2e_network.py; test_e2e_kueue.py places by the same network through Kueue).
"""

from __future__ import annotations

from typing import Any

import pytest
from e2e_env import Env
from e2e_network import L3
from e2e_spec import tiny_spec

from hlat_testbed import faults, volcano
from hlat_testbed.cluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

def _spec(nodes: int, topology: dict[str, str], steps: int = 4) -> dict[str, Any]:
    spec = tiny_spec(steps=steps)
    spec["nodes"] = nodes
    spec["train"]["globalBatch"] = 2 * nodes
    spec["scheduling"] = {"topology": topology}
    return spec


def _placed(env: Env, count: int) -> dict[int, str]:
    """Node rank -> node, once all `count` pods of attempt 0 are bound."""
    def bound() -> dict[int, str] | None:
        pods = [p for p in env.pods() if p.metadata.labels.get("hlat.dev/attempt") == "0"]
        if len(pods) < count or not all(p.spec.node_name for p in pods):
            return None
        return {int(p.metadata.labels["hlat.dev/node-rank"]): p.spec.node_name for p in pods}
    status = env.wait(f"{count} pods bound", lambda _s: bound() is not None, 120)
    placed = bound()
    assert placed is not None, status
    return placed


def test_a_job_requiring_a_block_trains_in_one_block_its_ranks_in_topology_order(
        job_env: Env, network: dict[str, str]) -> None:
    job_env.create(_spec(3, {"required": L3}))
    placed = _placed(job_env, 3)
    # the one block that holds 3 (b), its nodes by name: rank order is the plan's, not the
    # scheduler's own (which spreads by its scores and breaks ties at random)
    assert placed == {0: "net-0", 1: "node-1", 2: "node-2"}, placed
    messages = [m for r, m in job_env.event_messages() if r == "Placed"]
    assert messages and f"in {L3}=nn-blk-b" in messages[0], messages
    done = job_env.wait_trained()
    assert done["progress"]["step"] == 4


def test_under_volcano_a_job_requiring_a_block_is_bound_whole_in_one_block(
        job_env: Env, network: dict[str, str], cluster: Cluster) -> None:
    """The same plan under Volcano's scheduler (`schedulerName: volcano`, its PodGroup's
    minMember the gang): node affinity carries it there too (Volcano's own networkTopology
    needs HyperNodes, v1.12 or later, which the rig cannot have: docs/operator.md), so all
    three ranks are bound in the block of 3 on the nodes the plan gave them, and the job
    trains."""
    volcano.start(cluster)
    try:
        spec = _spec(3, {"required": L3})
        spec["scheduling"]["schedulerName"] = "volcano"
        job_env.create(spec)
        placed = _placed(job_env, 3)
        assert placed == {0: "net-0", 1: "node-1", 2: "node-2"}, placed  # as kube-scheduler's
        group = volcano.pod_group(cluster.admin_api(), job_env.ns, job_env.name)
        assert group is not None and int(group["spec"]["minMember"]) == 3
        assert job_env.wait_trained()["progress"]["step"] == 4
    finally:
        volcano.stop(cluster)


def test_a_gang_no_block_holds_waits_with_the_reason_and_no_pods(
        job_env: Env, network: dict[str, str]) -> None:
    job_env.create(_spec(4, {"required": L3}))
    status = job_env.wait(
        "Schedulable False (TopologyUnavailable)",
        lambda s: any(c["type"] == "Schedulable" and c["reason"] == "TopologyUnavailable"
                      for c in s.get("conditions") or []), 60)
    assert status["phase"] == "Pending"
    cond = next(c for c in status["conditions"] if c["type"] == "Schedulable")
    assert f"no {L3} domain has 4 usable nodes (the largest, nn-blk-b, has 3)" in cond["message"]
    assert job_env.pods() == []
    assert "TopologyUnavailable" in job_env.events()


def test_a_gang_preferring_blocks_spans_as_few_as_hold_it_its_ranks_contiguous(
        job_env: Env, network: dict[str, str]) -> None:
    """Four ranks: block b whole and one node of a; a's rank first (the blocks in label
    order), so ranks 1-3 share b's switch and only the 0-1 link crosses blocks."""
    job_env.create(_spec(4, {"preferred": L3}, steps=2))
    placed = _placed(job_env, 4)
    assert [network[placed[r]] for r in range(4)] == ["nn-blk-a"] + ["nn-blk-b"] * 3, placed
    assert placed == {0: "net-1", 1: "net-0", 2: "node-1", 3: "node-2"}


def test_a_gang_in_slices_takes_whole_slices_from_each_block(
        job_env: Env, network: dict[str, str]) -> None:
    """The same four ranks in slices of 2 (`sliceSize`, as an UltraServer's 4): one slice
    from each block, never the 3 + 1 above, ranks 0-1 in a and 2-3 in b, each pod required
    in its slice's block."""
    spec = _spec(4, {"preferred": L3}, steps=2)
    spec["scheduling"]["topology"]["sliceSize"] = 2
    job_env.create(spec)
    placed = _placed(job_env, 4)
    assert [network[placed[r]] for r in range(4)] == ["nn-blk-a"] * 2 + ["nn-blk-b"] * 2, placed
    assert placed == {0: "net-1", 1: "node-0", 2: "net-0", 3: "node-1"}
    for pod in job_env.pods():
        terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
        wanted = network[pod.spec.node_name]
        assert any(e.key == L3 and e.values == [wanted]
                   for t in terms.node_selector_terms for e in t.match_expressions), terms
    assert job_env.wait_trained()["progress"]["step"] == 2


def test_a_gang_whose_block_loses_a_node_moves_whole_to_the_block_that_holds_it(
        job_env: Env, network: dict[str, str]) -> None:
    """Two ranks requiring one block get block a (2 nodes, the tightest); rank 1's node goes
    down (kubelet and processes stopped). Block a cannot hold the gang any more: the restart
    recreates it in block b, its ranks in topology order, instead of restarting in place and
    leaving rank 1's pod Pending for good; the job then finishes there."""
    spec = _spec(2, {"required": L3}, steps=40)
    spec["faultTolerance"] = {"restartStrategy": "InPlace"}
    job_env.create(spec)
    placed = _placed(job_env, 2)
    assert {network[n] for n in placed.values()} == {"nn-blk-a"}, placed
    job_env.wait("training", lambda s: s.get("phase") == "Running"
                 and s.get("progress", {}).get("step", 0) >= 1, 180)
    node = placed[1]
    faults.node_down(job_env.cluster.config, node)
    try:
        restarting = job_env.wait_phase("Restarting", 90)
        assert restarting["lastFailure"]["node"] == node, restarting
        job_env.wait("attempt 1 running", lambda s: s.get("attempt", 0) >= 1
                     and s.get("phase") == "Running", 180)
        said = [m for _, m in job_env.event_messages() if "restarting the gang" in m]
        assert said and f"so it moves to {L3}=nn-blk-b" in said[0], said
        moved = {int(p.metadata.labels["hlat.dev/node-rank"]): p.spec.node_name
                 for p in job_env.pods() if p.metadata.labels.get("hlat.dev/attempt") == "1"}
        assert moved == {0: "net-0", 1: "node-1"}, moved  # block b, in the plan's order
        done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
        assert done["progress"]["step"] == 40 and not done["restarts"].get("inPlace"), done
    finally:
        faults.node_up(job_env.cluster.config, node)
        job_env.cluster.wait_nodes_ready([node], timeout=60)
