"""Placement that recovers: avoided nodes expire and never shrink the pool below the job, pods
that cannot be placed are reported (Schedulable=False), and refused objects end the job."""

from __future__ import annotations

from dataclasses import replace

from opfakes import JOB, SETTINGS, World, at, raw_spec

from hlat_api.labels import Reason
from hlat_api.status import AvoidedNode, PretrainJobStatus
from hlat_operator.observe import Observed, ObservedNode, ObservedPod
from hlat_operator.reconcile import DeletePod, decide, reject


def _running(world: World) -> World:
    world.until("Running", step=1)
    return world


def _lose_node_of(world: World, rank: int) -> str:
    node = world.pod_of(rank).node
    assert node is not None
    world.node_down(node)
    world.step()
    assert world.status.phase == "Restarting" and world.status.last_failure is not None
    assert world.status.last_failure.reason == Reason.NODE_LOST
    return node


def test_two_failed_nodes_that_recovered_do_not_keep_the_job_pending() -> None:
    """The reported case: a 2-node job on a 3-node pool, two nodes failed one after the other
    and came back; the job must run again (it used to wait forever, avoiding both)."""
    w = _running(World())
    first = _lose_node_of(w, 1)
    w.until("Running", step=2)
    w.node_up(first)
    second = _lose_node_of(w, 0 if w.pod_of(0).node != first else 1)
    w.until("Pending")
    w.node_up(second)
    w.until("Running", step=3, limit=60)
    assert [a.node for a in w.status.avoided_nodes] == [first, second]
    # the pool is 3 nodes: avoiding both would leave 1 for a 2-node job, so the least recently
    # failed one is let back and only the latest stays out
    assert all(w.avoid[p.name] == [second] for p in w.live())


def test_avoided_nodes_expire() -> None:
    w = _running(World(raw_spec(**{"faultTolerance.avoidFailedNodesSeconds": 100})))
    lost = _lose_node_of(w, 1)
    w.until("Running", step=2)
    w.node_up(lost)
    assert w.status.avoided_nodes[0].node == lost
    w.run(101, step=3, every=5)
    assert w.status.avoided_nodes == []
    assert "is no longer avoided" in " ".join(e.message for e in w.events)


def test_a_pending_pod_whose_avoid_rule_is_stale_is_recreated() -> None:
    """Node affinity is immutable: a pod created to avoid a node that is avoided no longer
    (expired, or let back for the pool) goes, and the next pass creates it anew."""
    nodes = {"node-a": ObservedNode("node-a")}
    pods = [ObservedPod(f"tiny-a1-{r}", 1, r, avoided=("node-a",),
                        unschedulable_since=at(0), schedule_message="0/1 nodes are available")
            for r in range(2)]
    status = PretrainJobStatus(phase="Pending", attempt=1, start_time="2025-01-01T00:00:00Z")
    observed = Observed(job=JOB, pods=pods, nodes=nodes)
    d = decide(raw_spec(), status, observed, at(1), SETTINGS)
    assert {a.name for a in d.actions if isinstance(a, DeletePod)} == {"tiny-a1-0", "tiny-a1-1"}
    # still current: left alone
    entry = AvoidedNode(node="node-a", failed_at="2025-01-01T00:00:00Z",
                        until="2025-01-01T01:00:00Z")
    kept = status.model_copy(update={"avoided_nodes": [entry]})
    two = {n: ObservedNode(n) for n in ("node-a", "node-b")}
    d = decide(raw_spec(nodes=1, **{"train.globalBatch": 4}), kept,
               replace(observed, pods=pods[:1], nodes=two), at(1), SETTINGS)
    assert not [a for a in d.actions if isinstance(a, DeletePod)]


def test_pods_that_cannot_be_placed_set_schedulable_false_after_the_bound() -> None:
    w = World(nodes=("node-a",))
    w.run(SETTINGS.unschedulable_after_seconds - 5)
    assert not [c for c in w.status.conditions if c.type == "Schedulable"]
    w.run(10)
    (cond,) = [c for c in w.status.conditions if c.type == "Schedulable"]
    assert cond.status == "False" and cond.reason == Reason.UNSCHEDULABLE
    assert "1 of 2 worker pods cannot be placed" in cond.message
    assert "0/1 nodes are available" in cond.message  # the scheduler's words
    assert w.reasons().count(Reason.UNSCHEDULABLE) == 1  # one Event, not one per pass
    assert w.decide().unschedulable_seconds >= SETTINGS.unschedulable_after_seconds
    assert w.status.phase == "Pending"  # reported, not failed: capacity may come
    w.nodes["node-b"] = ObservedNode("node-b")
    w.until("Running", step=1)
    (cond,) = [c for c in w.status.conditions if c.type == "Schedulable"]
    assert cond.status == "True" and cond.reason == Reason.SCHEDULED
    assert w.decide().unschedulable_seconds == 0


def test_a_refused_object_fails_the_job_with_the_server_s_message() -> None:
    w = _running(World())
    message = 'create Pod x: HTTP 403 Forbidden: violates PodSecurity "baseline:latest"'
    d = reject(w.status, w.observed(), w.now, SETTINGS, message)
    for action in d.actions:
        w.apply(action)
    assert w.status.phase == "Failed"
    (failed,) = [c for c in w.status.conditions if c.type == "Failed"]
    assert failed.reason == Reason.REJECTED and "PodSecurity" in failed.message
    assert all(p.terminating or p.name not in w.pods for p in w.live())
    assert Reason.REJECTED in w.reasons()
