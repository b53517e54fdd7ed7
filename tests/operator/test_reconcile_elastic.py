"""Elastic sizing (spec.elastic) through the operator's decisions, on the fake cluster: a job
short of nodes shrinks after elastic.waitSeconds to a size that keeps its global batch, trains
there, and grows back at the first checkpoint after the nodes return; no restart budget spent."""

from __future__ import annotations

import json
from typing import Any

import pytest
from opfakes import World, raw_spec

from hlat_api import InvalidSpecError, labels, parse_spec
from hlat_api.gang import GangRecord
from hlat_api.heartbeat import CHECKPOINT_REQUEST
from hlat_api.labels import Reason
from hlat_operator.metrics import OperatorMetrics
from hlat_operator.observe import ObservedNode
from hlat_trainer import peers

WAIT = 60.0


AVOID = 30.0
"""faultTolerance.avoidFailedNodesSeconds in these tests: a lost node's entry has expired by
the time a test brings it back (the job shrinks after WAIT); the default (3600 s) keeps a
returning node out, as `test_an_elastic_job_does_not_grow_back_onto_a_node_it_avoids` shows."""


def elastic_spec(**overrides: Any) -> dict[str, Any]:
    """3 nodes of one rank, 6 sequences of 1: it can train on 3, 2 or 1 nodes."""
    return raw_spec(**{"nodes": 3, "train.globalBatch": 6, "train.microBatch": 1,
                       "elastic": {"minNodes": 2, "waitSeconds": WAIT},
                       "faultTolerance.avoidFailedNodesSeconds": AVOID, **overrides})


def _config_nodes(w: World) -> int:
    """The size the trainers run at: the ConfigMap they read is the spec as written, at its
    full size with its `elastic` (a job resized in place keeps its pods and their copy of the
    file), sized by the world their launchers start (`PretrainJobSpec.at_world`)."""
    (config,) = [o for (kind, _), o in w.objects.items() if kind == "ConfigMap"]
    written = parse_spec(json.loads(next(iter(config["data"].values()))))
    assert written.nodes == 3 and written.elastic is not None
    return written.at_world(len(w.live()) * written.ranks_per_node).nodes


def _checkpoint(w: World, step: int, passes: int) -> None:
    """The workers report checkpoint `step` complete, over `passes` passes a second apart."""
    for _ in range(passes):
        w.schedule()
        w.beat(step, checkpoint_step=step)
        w.step()
        w.advance(1.0)


def _shrunk(w: World) -> str:
    w.until("Running", step=1)
    lost = w.pod_of(2).node
    assert lost is not None
    w.node_down(lost)
    w.until("Restarting", step=2)
    return lost


def test_a_job_short_of_a_node_shrinks_after_the_wait_and_grows_back_at_a_checkpoint() -> None:
    w = World(elastic_spec(), nodes=("node-a", "node-b", "node-c"))
    lost = _shrunk(w)
    assert w.status.goodput.capacity == 1.0  # on all its nodes so far
    assert w.status.last_failure is not None and w.status.last_failure.reason == Reason.NODE_LOST
    waited = w.until("Running", step=3, limit=WAIT + 120)
    assert waited >= WAIT, "shrunk before elastic.waitSeconds"
    # the wait counts from the loss, not from when the new gang's pod was found unplaceable
    # (after the pod on the dead node was force-deleted, 30 s here)
    assert waited <= WAIT + 5
    assert Reason.SHRUNK in w.reasons()
    assert len(w.live()) == 2 and _config_nodes(w) == 2
    assert w.status.size is not None and w.status.size.nodes == 2 and w.status.size.desired == 3
    assert w.status.size.text == "2/3"  # kubectl get pj, column Nodes
    (degraded,) = [c for c in w.status.conditions if c.type == "Degraded"]
    assert degraded.status == "True" and degraded.reason == Reason.SHRUNK
    assert w.status.restarts.total == 1, "the resize is not a restart: only the node loss"

    # the node returns: the job grows once a checkpoint newer than the latest then is complete
    w.node_up(lost)
    w.run(30, step=20, every=1.0)
    assert len(w.live()) == 2, "grew before a new checkpoint"
    g = w.status.goodput
    assert g.capacity is not None and 2 / 3 < g.capacity < 1, g  # 30 s and more at 2 of 3
    assert g.node_seconds == pytest.approx(g.capacity * g.desired_node_seconds, rel=1e-4)
    shrinking = g.badput_seconds.resize
    assert shrinking > 0, "the shrink's teardown is not counted as a resize"
    _checkpoint(w, 40, 5)  # the workers report checkpoint step 40 complete
    w.until("Running", step=41, limit=60)
    assert len(w.live()) == 3 and _config_nodes(w) == 3 and w.status.size.text == "3/3"
    assert [r.nodes for r in w.status.size.resizes] == [2, 3]
    assert [r.reason for r in w.status.size.resizes] == [Reason.SHRUNK, Reason.GROWN]
    badput = w.status.goodput.badput_seconds
    assert badput.resize > shrinking, "growing back is not counted as a resize"
    assert badput.backoff == 0, "a planned resize waited a backoff"
    (degraded,) = [c for c in w.status.conditions if c.type == "Degraded"]
    assert degraded.status == "False"
    assert w.status.restarts.total == 1


def test_the_size_its_time_and_the_capacity_reach_status_and_metrics() -> None:
    """`status.size.since` is when the current size began (the shrink's resize), and the
    Prometheus gauges say the same as the status: current and desired nodes, and the capacity
    fraction below 1 while shrunk."""
    m = OperatorMetrics()
    w = World(elastic_spec(), nodes=("node-a", "node-b", "node-c"))
    _shrunk(w)
    w.until("Running", step=3, limit=WAIT + 120)
    w.run(20, step=10, every=1.0)
    d = w.step()
    m.observe("default", "tiny", d)
    size = w.status.size
    assert size is not None and size.resizes[-1].reason == Reason.SHRUNK
    assert size.since == size.resizes[-1].at
    job = {"namespace": "default", "pretrainjob": "tiny"}
    assert m.registry.get_sample_value("hlat_job_nodes", job) == 2
    assert m.registry.get_sample_value("hlat_job_nodes_desired", job) == 3
    capacity = m.registry.get_sample_value("hlat_job_capacity_ratio", job)
    assert capacity is not None and 2 / 3 < capacity < 1
    assert capacity == pytest.approx(d.status.goodput.capacity, abs=1e-6)


def test_an_elastic_job_does_not_grow_back_onto_a_node_it_avoids() -> None:
    """A lost node back within faultTolerance.avoidFailedNodesSeconds is not capacity to an
    elastic job: it trains on 2 of 3 (a rigid job would take the node back: it has no other
    way to train) and grows once the entry has expired, at the next checkpoint."""
    w = World(elastic_spec(**{"faultTolerance.avoidFailedNodesSeconds": 600}),
              nodes=("node-a", "node-b", "node-c"))
    lost = _shrunk(w)
    w.until("Running", step=3, limit=WAIT + 120)
    w.node_up(lost)
    for step in (50, 60):  # checkpoints after the node is back, still within its entry
        _checkpoint(w, step, 3)
    w.run(30, step=61, every=1.0)
    assert len(w.live()) == 2 and w.status.size is not None and w.status.size.text == "2/3"
    assert [a.node for a in w.status.avoided_nodes] == [lost]
    assert Reason.GROWN not in w.reasons()
    w.run(600, step=62, every=10.0)  # the entry expires
    assert w.status.avoided_nodes == []
    _checkpoint(w, 70, 3)
    w.until("Running", step=71, limit=60)
    assert len(w.live()) == 3 and w.status.size.text == "3/3"


def test_a_replacement_node_is_capacity_while_the_lost_one_stays_avoided() -> None:
    """The lost node stays down (or avoided); a new one joins (an EC2 replacement, a node a
    capacity reservation gives back): the job grows onto it at the next checkpoint."""
    w = World(elastic_spec(**{"faultTolerance.avoidFailedNodesSeconds": 600}),
              nodes=("node-a", "node-b", "node-c"))
    lost = _shrunk(w)
    w.until("Running", step=3, limit=WAIT + 120)
    w.nodes["node-d"] = ObservedNode("node-d", labels=dict(w.nodes["node-a"].labels))
    w.run(5, step=45, every=1.0)  # seen: it grows at the first checkpoint after this
    _checkpoint(w, 50, 3)
    w.until("Running", step=51, limit=60)
    assert len(w.live()) == 3 and w.status.size is not None and w.status.size.text == "3/3"
    assert {p.node for p in w.live()} == {"node-a", "node-b", "node-d"}
    assert [a.node for a in w.status.avoided_nodes] == [lost]


def test_an_elastic_job_shrinks_rather_than_go_back_to_a_node_it_avoids() -> None:
    """The lost node is Ready again before elastic.waitSeconds ends: the new gang's pod still
    may not go there, and the job shrinks to the nodes it may use."""
    w = World(elastic_spec(**{"faultTolerance.avoidFailedNodesSeconds": 600}),
              nodes=("node-a", "node-b", "node-c"))
    lost = _shrunk(w)
    w.run(WAIT / 2, step=2, every=1.0)  # its pod force-deleted meanwhile
    w.node_up(lost)
    w.until("Running", step=3, limit=WAIT + 120)
    assert Reason.SHRUNK in w.reasons()
    assert len(w.live()) == 2 and lost not in {p.node for p in w.live()}


def test_below_min_nodes_the_job_waits() -> None:
    w = World(elastic_spec(**{"elastic.minNodes": 3, "nodes": 4, "train.globalBatch": 12}),
              nodes=("node-a", "node-b", "node-c", "node-d"))
    w.until("Running", step=1)
    for rank in (2, 3):
        node = w.pod_of(rank).node
        assert node is not None
        w.node_down(node)
    w.until("Restarting", step=2)
    w.run(WAIT * 3, step=2, every=2.0)
    assert w.status.phase == "Pending" and Reason.SHRUNK not in w.reasons()
    # two placed, two unplaceable: 2 of 4 is below minNodes 3
    assert len([p for p in w.live() if p.node]) == 2


def test_a_size_that_splits_the_batch_unevenly_is_taken_and_its_cost_said() -> None:
    """5 micro-batches a step on 3 nodes (2, 2, 1) shrink to 2 (3 and 2): the size is taken,
    as one that divides them would be, and the Event says what it costs a step; the even
    split says nothing of the kind."""
    w = World(elastic_spec(**{"train.globalBatch": 5}), nodes=("node-a", "node-b", "node-c"))
    _shrunk(w)
    w.until("Running", step=3, limit=WAIT + 120)
    assert len(w.live()) == 2 and _config_nodes(w) == 2
    (shrunk,) = [e.message for e in w.events if e.reason == Reason.SHRUNK]
    assert shrunk.endswith("; 1 of its 2 data-parallel ranks train 3 micro-batches a step, "
                           "the others 2: about 67% of full speed"), shrunk
    even = World(elastic_spec(), nodes=("node-a", "node-b", "node-c"))
    _shrunk(even)
    even.until("Running", step=3, limit=WAIT + 120)
    (message,) = [e.message for e in even.events if e.reason == Reason.SHRUNK]
    assert message.endswith("the same global batch"), message


def test_without_elastic_the_job_waits_for_all_its_nodes() -> None:
    w = World(elastic_spec(elastic=None), nodes=("node-a", "node-b", "node-c"))
    _shrunk(w)
    w.run(WAIT * 3, step=2, every=2.0)
    assert w.status.phase == "Pending" and Reason.SHRUNK not in w.reasons()


@pytest.mark.parametrize(("change", "message"), [
    ({"elastic": {"minNodes": 4}}, r"spec\.elastic\.minNodes: 4 is more than nodes \(3\)"),
    # 3 ranks a node in tensor-parallel pairs: 3 nodes' 9 ranks make no whole pairs
    ({"nodes": 4, "processesPerNode": 3, "parallelism": {"tensor": 2},
      "elastic": {"minNodes": 3}},
     r"no size from 3 to 3 nodes keeps train\.globalBatch 6 .* allows: \[4, 2\]"),
])
def test_an_elastic_spec_that_cannot_shrink_is_refused(change: dict[str, Any],
                                                       message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_spec(elastic_spec(**change))


def test_a_job_that_starts_short_of_nodes_shrinks_without_a_fault_or_a_backoff() -> None:
    """No node failed: the pool is smaller than the job. It shrinks after the wait, at once
    (nothing failed, so no backoff), and counts no restart."""
    w = World(elastic_spec(), nodes=("node-a", "node-b"))
    waited = w.until("Running", step=1, limit=WAIT + 30)
    assert WAIT <= waited <= WAIT + 10
    assert len(w.live()) == 2 and w.status.restarts.total == 0
    assert w.status.last_failure is None


def test_under_in_place_restarts_the_resize_recreates_the_gang_and_later_faults_stay_in_place(
        ) -> None:
    """InPlace keeps the surviving pods at a fault; a resize changes every rank's world, so it
    recreates the gang; a later fault at the smaller size restarts in place again."""
    w = World(elastic_spec(**{"faultTolerance.restartStrategy": "InPlace"}),
              nodes=("node-a", "node-b", "node-c"))
    _shrunk(w)
    w.until("Running", step=3, limit=WAIT + 120)
    assert len(w.live()) == 2 and _config_nodes(w) == 2
    attempt = w.status.attempt
    kept = {p.name for p in w.live()}
    w.trainer_exit(1)
    w.step()
    assert w.status.phase == "Restarting"
    for _ in range(60):  # until the next attempt is published
        w.schedule()
        w.step()
        if w.status.attempt > attempt:
            break
        w.advance(1)
    assert w.status.attempt == attempt + 1 and {p.name for p in w.live()} == kept
    assert len(w.live()) == 2 and w.status.size is not None and w.status.size.nodes == 2


def test_with_a_spare_a_lost_node_moves_to_it_and_only_a_loss_with_none_left_shrinks() -> None:
    """Spares first: the first lost node's rank moves to the ready spare (the job keeps its 3
    nodes, no wait, no resize). The replacement spare finds no node, so the second loss has
    none: the job shrinks to 2 after the wait. When a node comes back the pending spare starts
    there, and that is capacity: the job grows back to 3 at the next checkpoint, and asks for
    a spare again."""
    w = World(elastic_spec(**{"faultTolerance.restartStrategy": "InPlace",
                              "faultTolerance.spareNodes": 1}),
              nodes=("node-a", "node-b", "node-c", "node-d"))
    w.until("Running", step=1)
    w.run(5, step=2)
    assert w.pods["tiny-s0"].phase == "Running" and w.pods["tiny-s0"].spare
    first = w.pod_of(2).node
    assert first is not None
    w.node_down(first)
    w.run(30, step=3)
    assert w.status.phase == "Running" and w.status.restarts.total == 1
    assert w.pods["tiny-s0"].rank == 2 and not w.pods["tiny-s0"].spare  # promoted
    assert w.status.size is not None and w.status.size.nodes == 3 and not w.status.size.resizes
    assert Reason.SHRUNK not in w.reasons()
    assert [p.node for p in w.live() if p.spare] == [None]  # asked for again: no node for it
    second = w.pod_of(1).node
    assert second is not None
    w.node_down(second)
    w.run(WAIT + 60, step=4)
    assert w.status.phase == "Running" and Reason.SHRUNK in w.reasons()
    assert w.status.size.nodes == 2 and len([p for p in w.live() if not p.spare]) == 2
    w.node_up(first)  # its avoid entry has expired (AVOID < WAIT): the spare starts there
    w.run(10, step=5)
    (spare,) = [p for p in w.live() if p.spare]
    assert spare.node == first and spare.phase == "Running"
    assert w.status.size.nodes == 2, "grew before a new checkpoint"
    (waits,) = [e.message for e in w.events if e.reason == Reason.GROWN]
    assert waits.endswith("growing to 3 of 3 nodes once its first checkpoint is complete "
                          "(asked for now)")
    # asked of the two workers at their size, one value however many passes ask
    assert {(a.name, a.annotations[CHECKPOINT_REQUEST]) for a in w.lease_patches} == {
        (f"tiny-a{w.status.attempt}-0", "1"), (f"tiny-a{w.status.attempt}-1", "1")}
    _checkpoint(w, 40, 30)
    assert w.status.size.nodes == 3 and _config_nodes(w) == 3
    assert first in {p.node for p in w.live() if not p.spare}
    assert [p.node for p in w.live() if p.spare] == [None]


def test_a_suspended_shrunk_job_resumes_at_its_size_and_grows_when_it_can() -> None:
    w = World(elastic_spec(), nodes=("node-a", "node-b", "node-c"))
    lost = _shrunk(w)
    assert w.status.goodput.capacity == 1.0  # on all its nodes so far
    w.until("Running", step=3, limit=WAIT + 120)
    w.spec["suspend"] = True
    w.step()
    w.beat(4, checkpoint_step=4)  # the checkpoint asked for at the suspension
    w.step()
    assert {a.name for a in w.lease_patches} == {"tiny-a2-0", "tiny-a2-1"}  # 2 of 3 nodes
    w.until("Suspended", step=4)
    assert not w.live()
    w.spec["suspend"] = False
    w.until("Running", step=4, limit=60)
    assert len(w.live()) == 2 and w.status.size is not None and w.status.size.text == "2/3"
    w.node_up(lost)
    for step in (50, 60):  # a checkpoint after the node is back, then one more
        _checkpoint(w, step, 3)
    w.until("Running", step=61, limit=60)
    assert len(w.live()) == 3 and w.status.size.text == "3/3"


def test_under_volcano_the_pod_group_s_min_member_follows_the_size() -> None:
    """Volcano binds a gang only when minMember pods can be: at 2 of 3 nodes it must ask for
    2, and for 3 again once grown (the PodGroup is the job's, patched per attempt)."""
    w = World(elastic_spec(**{"scheduling.schedulerName": "volcano"}),
              nodes=("node-a", "node-b", "node-c"))

    def min_member() -> int:
        (group,) = [o for (kind, _), o in w.objects.items() if kind == "PodGroup"]
        return int(group["spec"]["minMember"])

    lost = _shrunk(w)
    assert min_member() == 3
    w.until("Running", step=3, limit=WAIT + 120)
    assert len(w.live()) == 2 and min_member() == 2
    w.node_up(lost)
    w.run(30, step=20, every=1.0)
    _checkpoint(w, 40, 5)
    w.until("Running", step=41, limit=60)
    assert len(w.live()) == 3 and min_member() == 3


def _record(w: World) -> GangRecord | None:
    gang = w.objects.get(("Lease", labels.gang_lease_name("tiny")))
    return None if gang is None else GangRecord.from_annotations(gang["metadata"]["annotations"])


def _in_place_shrunk(lost_rank: int) -> tuple[World, dict[int, str], str]:
    """An elastic job restarted in place loses the node of `lost_rank` and shrinks to 2;
    returns the world, the pods by rank before, and the lost node."""
    w = World(elastic_spec(**{"faultTolerance.restartStrategy": "InPlace"}),
              nodes=("node-a", "node-b", "node-c"))
    w.until("Running", step=1)
    before = {pod.rank or 0: pod.name for pod in w.live()}
    lost = w.pod_of(lost_rank).node
    assert lost is not None
    w.node_down(lost)
    w.until("Restarting", step=2)
    waited = w.until("Running", step=3, limit=WAIT + 120)
    # at the wait's end, in one restart: neither the pod on the dead node's force-delete
    # (30 s here) nor an attempt with a pod of the lost rank that no node takes comes first
    assert WAIT <= waited <= WAIT + 3 and w.status.attempt == 1, (waited, w.status.attempt)
    assert not [pod for pod in w.pods.values() if pod.unschedulable_since is not None]
    assert Reason.SHRUNK in w.reasons() and w.status.size is not None
    assert w.status.size.text == "2/3" and _config_nodes(w) == 2
    assert {pod.attempt for pod in w.live()} == {w.status.attempt}
    leases = sorted(name for name in w.leases if name != labels.gang_lease_name("tiny"))
    assert leases == [labels.worker_lease_name("tiny", w.status.attempt, r) for r in (0, 1)]
    assert w.status.restarts.total == 1  # the node loss; the resize is none
    return w, before, lost


def _grown(w: World, lost: str) -> None:
    w.node_up(lost)
    w.run(AVOID, step=20, every=1.0)
    _checkpoint(w, 40, 5)
    w.until("Running", step=41, limit=60)
    assert w.status.size is not None and w.status.size.text == "3/3"
    assert sorted(pod.rank for pod in w.live()) == [0, 1, 2] and w.status.restarts.total == 1


def test_in_place_a_shrink_keeps_the_running_pods_and_growing_back_creates_one() -> None:
    """restartStrategy InPlace (the default) and node rank 2's node lost: after the wait the
    two pods still running stay (the one no node took is deleted, none created), and the
    restart record tells their launchers the new size, so their trainers restart on 2 nodes
    without a new gang's start. Growing back keeps them too and creates rank 2's pod."""
    w, before, lost = _in_place_shrunk(2)
    assert {pod.name: pod.rank for pod in w.live()} == {before[0]: 0, before[1]: 1}
    record = _record(w)
    assert record is not None and record.attempt == w.status.attempt and record.nodes == 2
    assert record.ranks == {before[0]: 0, before[1]: 1} and record.master_addr is None
    _grown(w, lost)
    live = {pod.name: pod.rank for pod in w.live()}
    assert live[before[0]] == 0 and live[before[1]] == 1 and len(live) == 3  # one created
    record = _record(w)
    assert record is not None and record.nodes == 3 and record.attempt == w.status.attempt


def test_in_place_a_shrink_moves_a_rank_down_and_growing_back_keeps_the_gang(
        ) -> None:
    """Node rank 1's node lost: node rank 2's pod takes rank 1 (the record names it), keeping
    its host name `<job>-2`. Growing back keeps the gang too: rank 2's new pod takes the free
    host name `<job>-1` (two pods of one name under the Service would each be found at the
    other's address), and the record names it, so its peers find it."""
    w, before, lost = _in_place_shrunk(1)
    assert {pod.name: pod.rank for pod in w.live()} == {before[0]: 0, before[2]: 1}
    record = _record(w)
    assert record is not None and record.nodes == 2
    assert record.ranks == {before[0]: 0, before[2]: 1} and record.master_addr is None
    _grown(w, lost)
    live = {pod.name: pod for pod in w.live()}
    assert {before[0], before[2]} < set(live)  # kept: the gang was not recreated
    (new,) = set(live) - {before[0], before[2]}
    assert live[new].rank == 2 and live[new].hostname == "tiny-1", live[new]
    assert new == f"tiny-a{w.status.attempt}-1"  # the name says the host name (pod_hostname)
    assert len({pod.hostname for pod in live.values()}) == 3
    record = _record(w)
    assert record is not None and record.nodes == 3 and record.master_addr is None
    assert record.ranks == {before[0]: 0, before[2]: 1, new: 2}, record.ranks
    assert peers.peer_host("tiny", record, 2) == f"tiny-1.{labels.service_name('tiny')}"


def test_in_place_a_shrink_that_loses_rank_0_gives_rank_0_and_its_address_to_a_kept_pod(
        ) -> None:
    w = World(elastic_spec(**{"faultTolerance.restartStrategy": "InPlace"}),
              nodes=("node-a", "node-b", "node-c"))
    w.until("Running", step=1)
    before = {pod.rank: pod for pod in w.live()}
    lost = w.pod_of(0).node
    assert lost is not None
    w.node_down(lost)
    w.until("Restarting", step=2)
    w.until("Running", step=3, limit=WAIT + 120)
    live = {pod.name: pod.rank for pod in w.live()}
    assert live == {before[1].name: 1, before[2].name: 0}, live
    record = _record(w)
    assert record is not None and record.nodes == 2
    assert record.master_addr == f"{before[2].hostname}.{labels.service_name('tiny')}"


def test_in_place_growing_back_with_a_spare_on_rank_0_keeps_the_gang() -> None:
    """A spare took rank 0 at the first loss; the second loss (no spare left) shrinks the job
    to 2. Growing back keeps the gang: rank 2's host name is free, and whatever pod takes rank
    2 learns rank 0's address (the spare's) before its trainers start (a promoted spare from
    the record, a new pod from its environment: `test_a_pod_made_beside_a_spare_that_took_...`
    in test_reconcile_inplace.py)."""
    w = World(elastic_spec(**{"faultTolerance.restartStrategy": "InPlace",
                              "faultTolerance.spareNodes": 1}),
              nodes=("node-a", "node-b", "node-c", "node-d"))
    w.until("Running", step=1)
    for _ in range(3):  # the spare is requested once the attempt trains
        w.schedule()
        w.beat(1)
        w.step()
        w.advance(1)
    (spare,) = [pod for pod in w.pods.values() if pod.spare and pod.node]
    first = w.pod_of(0).node
    assert first is not None
    w.node_down(first)
    w.until("Restarting", step=2)
    w.until("Running", step=3, limit=120)
    assert w.pod_of(0).name == spare.name
    second = w.pod_of(2).node
    assert second is not None
    w.node_down(second)
    w.until("Restarting", step=4)
    w.until("Running", step=5, limit=WAIT + 120)
    assert w.status.size is not None and w.status.size.text == "2/3"
    kept = {pod.name for pod in w.live() if not pod.spare}
    w.node_up(second)
    w.run(AVOID, step=20, every=1.0)
    _checkpoint(w, 40, 5)
    w.until("Running", step=41, limit=60)
    assert w.status.size is not None and w.status.size.text == "3/3"
    assert kept < {pod.name for pod in w.live()}  # kept: the gang was not recreated
    record = _record(w)
    assert record is not None and record.nodes == 3
    assert record.master_addr == f"{spare.hostname}.{labels.service_name('tiny')}"
