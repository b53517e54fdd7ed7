"""The operator as Kueue's integration for PretrainJob, without a cluster (queueing.py and its
place in reconcile): the Workload a queued job gets, no pods until Kueue admits it, the
admission's flavors in the pods, an eviction that stops the pods and releases the quota with no
restart counted, re-admission resuming as a new attempt, and the Workload Finished at the end.
test_e2e_kueue.py shows the same against a real Kueue."""

from __future__ import annotations

from dataclasses import replace

from opfakes import JOB, SETTINGS, World, raw_spec

from hlat_api.heartbeat import CHECKPOINT_REQUEST
from hlat_api.labels import Reason
from hlat_api.manifest import parse_spec
from hlat_operator import builders, queueing
from hlat_operator.config import OperatorSettings
from hlat_operator.observe import pod_from_raw
from hlat_operator.queueing import Flavor, ObservedWorkload, Queueing, WorkloadCondition
from hlat_operator.reconcile import KUEUE_REMAKES_PER_ATTEMPT, CreateObject

WL = "pretrainjob-tiny"
L3 = "topology.k8s.aws/network-node-layer-3"
RESERVED = {"QuotaReserved": WorkloadCondition("True", "QuotaReserved", "quota reserved"),
            "Admitted": WorkloadCondition("True", "Admitted", "admitted")}
FLAVOR = Flavor("trn1", {"node.kubernetes.io/instance-type": "trn1.32xlarge"},
                ({"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"},))


def _waiting(message: str = "insufficient unused quota for pods in flavor trn1, 2 more needed"
             ) -> ObservedWorkload:
    return ObservedWorkload(WL, {"QuotaReserved": WorkloadCondition("False", "Pending", message)})


def _admitted(**conditions: WorkloadCondition) -> ObservedWorkload:
    return ObservedWorkload(WL, {**RESERVED, **conditions}, "team-cq", {"workers": ("trn1",)})


def _queued_world(**spec: object) -> World:
    w = World(raw_spec(**spec))
    w.queueing = Queueing("team", "high", 1000)
    return w


def _workload(w: World) -> dict[str, object]:
    return w.objects[("Workload", WL)]


def test_a_queued_job_gets_a_workload_and_no_pods() -> None:
    w = _queued_world(**{"faultTolerance.spareNodes": 1,
                         "faultTolerance.restartStrategy": "InPlace"})
    w.step()
    body = _workload(w)
    spec = body["spec"]
    assert isinstance(spec, dict)
    assert spec["queueName"] == "team" and spec["priority"] == 1000
    assert spec["priorityClassRef"] == {"group": "kueue.x-k8s.io",
                                        "kind": "WorkloadPriorityClass", "name": "high"}
    # the spare node counts against quota like a worker
    assert [(s["name"], s["count"]) for s in spec["podSets"]] == [("workers", 2), ("spares", 1)]
    meta = body["metadata"]
    assert isinstance(meta, dict) and meta["ownerReferences"][0]["uid"] == JOB.uid
    assert w.status.phase == "Suspended" and not w.pods
    assert w.reasons()[-1] == Reason.QUEUED and w.status.reason == Reason.QUEUED

    w.queueing = replace(w.queueing, workload=_waiting())  # type: ignore[arg-type]
    w.run(30)
    assert not w.pods and w.status.phase == "Suspended"
    cond = next(c for c in w.status.conditions if c.type == "Suspended")
    assert cond.reason == Reason.QUEUED
    assert "LocalQueue team" in cond.message and "2 more needed" in cond.message
    assert w.decide().queued_seconds >= 30  # hlat_job_queued_seconds, the fleet dashboard's


def test_a_missing_priority_class_is_said_and_no_workload_is_made() -> None:
    w = World()
    w.queueing = Queueing("team", "urgent", None)
    w.run(5)
    assert ("Workload", WL) not in w.objects and not w.pods
    cond = next(c for c in w.status.conditions if c.type == "Suspended")
    assert "WorkloadPriorityClass urgent" in cond.message


def test_admission_starts_the_gang_with_the_flavor_s_labels_and_tolerations() -> None:
    w = _queued_world()
    w.step()
    w.queueing = replace(w.queueing, workload=_admitted(),  # type: ignore[arg-type]
                         flavors={"trn1": FLAVOR})
    decision = w.step()
    assert w.status.phase == "Pending" and w.reasons()[-1] == Reason.ADMITTED
    assert w.status.attempt == 0
    said = next(c for c in w.status.conditions if c.type == "Suspended")
    assert said.status == "False"
    pods = [a.obj for a in decision.actions
            if isinstance(a, CreateObject) and a.obj["kind"] == "Pod"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "trn1.32xlarge"
        assert {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"} \
            in pod["spec"]["tolerations"]
    w.until("Running", step=1)


def test_flavors_go_into_the_spec_the_pods_are_built_from() -> None:
    spec = parse_spec(raw_spec())
    q = Queueing("team", workload=_admitted(), flavors={"trn1": FLAVOR})
    placed = queueing.admitted_spec(spec, q)
    assert placed.scheduling.node_selector == {"node.kubernetes.io/instance-type": "trn1.32xlarge"}
    assert [t.key for t in placed.scheduling.tolerations] == ["aws.amazon.com/neuron"]
    # applied twice, the same
    assert queueing.admitted_spec(placed, q) == placed


PREEMPTED = WorkloadCondition("True", "Preempted", "Preempted to accommodate a workload "
                              "(UID: x) due to prioritization in the ClusterQueue")


def _training_world(settings: OperatorSettings = SETTINGS) -> World:
    """A queued job admitted and training at step 25, its checkpoint 20 complete (interval 20,
    0.5 s steps)."""
    w = World(raw_spec(), settings=settings)
    w.queueing = Queueing("team", "high", 1000)
    w.step()
    w.queueing = replace(w.queueing, workload=_admitted(), flavors={"trn1": FLAVOR})
    w.until("Running", step=5)
    w.schedule()
    w.beat(25, checkpoint_step=20)
    w.step()
    assert w.status.latest_checkpoint and w.status.latest_checkpoint.step == 20
    return w


def _requests(w: World) -> set[tuple[str, str]]:
    return {(a.name, a.annotations[CHECKPOINT_REQUEST]) for a in w.lease_patches}


def test_an_eviction_asks_for_a_checkpoint_now_then_stops_and_releases_the_quota() -> None:
    w = _training_world()
    w.queueing = replace(w.queueing, workload=_admitted(Evicted=PREEMPTED))  # type: ignore[arg-type]
    w.step()
    # at step 25 (20 the latest checkpoint): both workers' Leases ask for one at 26 or later,
    # and the gang trains on meanwhile
    assert w.status.phase == "Running" and len(w.live()) == 2
    assert _requests(w) == {("tiny-a0-0", "26"), ("tiny-a0-1", "26")}
    said = [e.message for e in w.events if e.reason == Reason.EVICTED_BY_KUEUE]
    assert said and "Preempted" in said[-1] and "checkpoint now (step 26" in said[-1], said
    w.advance(2)
    w.beat(29, checkpoint_step=20)
    w.step()
    assert w.status.phase == "Running" and not w.workload_writes
    w.advance(1)
    w.beat(30, checkpoint_step=27)  # the checkpoint asked for is complete: stop
    w.step()
    assert w.status.phase == "Suspended" and w.reasons()[-1] == Reason.EVICTED_BY_KUEUE
    assert w.status.reason == Reason.EVICTED_BY_KUEUE
    cond = next(c for c in w.status.conditions if c.type == "Suspended")
    assert "Preempted" in cond.message and "LocalQueue team" in cond.message
    assert not w.workload_writes, "quota released while pods still run"
    w.run(3)
    assert not w.pods
    released = w.workload_writes[-1]
    assert released.clear_admission
    written = {c["type"]: c for c in released.conditions}
    assert written["QuotaReserved"]["status"] == "False"
    assert written["Requeued"]["status"] == "True"  # preempted: Kueue queues it again
    assert w.status.restarts.total == 0

    # Kueue admits it again: a new attempt, from the checkpoint at the stop, no restart counted
    w.queueing = replace(w.queueing, workload=_admitted())  # type: ignore[arg-type]
    w.until("Running", step=28)
    assert w.status.attempt == 1 and w.status.restarts.total == 0
    assert w.state.stop_asked_since is None
    w.lease_patches.clear()
    w.run(3, step=29)
    assert not w.lease_patches, "the new attempt is not asked for anything"


def test_an_eviction_stops_at_once_when_asking_is_off_or_the_gang_is_not_ready() -> None:
    off = _training_world(SETTINGS.model_copy(update={"eviction_checkpoint_seconds": 0}))
    off.queueing = replace(off.queueing, workload=_admitted(Evicted=PREEMPTED))  # type: ignore[arg-type]
    off.step()
    assert off.status.phase == "Suspended" and not off.lease_patches
    starting = _queued_world()
    starting.step()
    starting.queueing = replace(starting.queueing, workload=_admitted(),  # type: ignore[arg-type]
                                flavors={"trn1": FLAVOR})
    starting.step()
    assert starting.status.phase == "Pending"
    starting.queueing = replace(starting.queueing, workload=_admitted(Evicted=PREEMPTED))  # type: ignore[arg-type]
    starting.step()
    assert starting.status.phase == "Suspended" and not starting.lease_patches


def test_an_eviction_waits_no_longer_than_its_bound() -> None:
    """A trainer that does not answer (an image without checkpoint requests; stuck): stopped
    once settings.eviction_checkpoint_seconds have passed, asked again on every pass till
    then."""
    w = _training_world(SETTINGS.model_copy(update={"eviction_checkpoint_seconds": 10}))
    w.queueing = replace(w.queueing, workload=_admitted(Evicted=PREEMPTED))  # type: ignore[arg-type]
    w.step()
    assert w.status.phase == "Running"
    w.advance(9)
    w.beat(30, checkpoint_step=20)  # no checkpoint yet
    w.step()
    assert w.status.phase == "Running" and len(w.lease_patches) == 4
    w.advance(2)
    w.beat(32, checkpoint_step=20)
    w.step()
    assert w.status.phase == "Suspended"


def test_a_fault_while_the_checkpoint_is_awaited_ends_the_wait() -> None:
    w = _training_world()
    w.queueing = replace(w.queueing, workload=_admitted(Evicted=PREEMPTED))  # type: ignore[arg-type]
    w.step()
    assert w.status.phase == "Running"
    w.advance(1)
    w.fail(1, exit_code=137)
    w.run(3)
    assert w.status.phase == "Suspended" and w.reasons()[-1] == Reason.EVICTED_BY_KUEUE
    w.run(3)
    assert not w.pods


def test_an_ended_job_finishes_its_workload_once() -> None:
    w = _queued_world()
    w.step()
    w.queueing = replace(w.queueing, workload=_admitted(), flavors={"trn1": FLAVOR})  # type: ignore[arg-type]
    w.until("Running", step=5)
    w.succeed_all()
    w.until("Succeeded", step=120)
    w.step()
    finished = [c for a in w.workload_writes for c in a.conditions if c["type"] == "Finished"]
    assert finished and finished[0]["status"] == "True" and finished[0]["reason"] == "Succeeded"
    w.queueing = replace(w.queueing, workload=_admitted(  # type: ignore[arg-type]
        Finished=WorkloadCondition("True", "Succeeded")))
    count = len(w.workload_writes)
    w.run(5)
    assert len(w.workload_writes) == count


def test_suspend_wins_over_an_admission() -> None:
    w = _queued_world()
    w.step()
    w.queueing = replace(w.queueing, workload=_admitted(), flavors={"trn1": FLAVOR})  # type: ignore[arg-type]
    w.until("Running", step=5)
    w.spec["suspend"] = True
    w.step()
    assert _requests(w) == {("tiny-a0-0", "6"), ("tiny-a0-1", "6")} and not w.workload_active
    w.beat(6, checkpoint_step=6)  # the checkpoint asked for is complete
    w.run(3)
    assert w.status.phase == "Suspended" and not w.pods
    assert w.reasons()[-1] == Reason.SUSPENDED


def test_a_suspended_job_gives_its_quota_back_and_queues_again_when_resumed() -> None:
    """spec.suspend on an admitted job: the pods stop and the Workload is deactivated (Kueue
    evicts it, reason Deactivated); once the pods are gone the reservation is released, not
    requeued. Resumed: the Workload is activated again, and the job waits in its queue."""
    w = _queued_world()
    w.step()
    w.queueing = replace(w.queueing, workload=_admitted(), flavors={"trn1": FLAVOR})  # type: ignore[arg-type]
    w.until("Running", step=5)
    w.spec["suspend"] = True
    w.step()
    w.beat(6, checkpoint_step=6)  # the checkpoint asked for at the suspension
    w.step()
    assert w.workload_active == [False] and w.state.deactivated_workload
    assert any("quota in LocalQueue team released" in e.message for e in w.events)
    deactivated = WorkloadCondition("True", "Deactivated", "The workload is deactivated")
    w.queueing = replace(w.queueing, workload=replace(  # type: ignore[arg-type]
        _admitted(Evicted=deactivated), active=False))
    w.run(3)
    assert not w.pods and w.status.phase == "Suspended" and w.status.reason == Reason.SUSPENDED
    released = w.workload_writes[-1]
    written = {c["type"]: c for c in released.conditions}
    assert released.clear_admission and written["QuotaReserved"]["status"] == "False"
    assert written["Requeued"]["status"] == "False"  # deactivated: out of the queue
    assert w.workload_active == [False]  # once observed inactive, not set again

    # Kueue released it: out of the queue until the job resumes
    w.queueing = replace(w.queueing, workload=ObservedWorkload(  # type: ignore[arg-type]
        WL, {"Evicted": deactivated}, active=False))
    w.spec["suspend"] = False
    w.step()
    assert w.workload_active == [False, True] and not w.state.deactivated_workload
    cond = next(c for c in w.status.conditions if c.type == "Suspended")
    assert w.status.phase == "Suspended" and cond.reason == Reason.QUEUED and not w.pods
    assert w.status.reason == Reason.QUEUED  # Suspended (spec.suspend) before: now Queued
    assert "activated again" in cond.message
    w.queueing = replace(w.queueing, workload=_admitted())  # type: ignore[arg-type]
    w.until("Running", step=8)
    assert w.workload_active == [False, True] and w.status.restarts.total == 0


def test_a_workload_someone_else_deactivated_stays_inactive_when_the_job_resumes() -> None:
    w = _queued_world()
    w.step()
    w.queueing = replace(w.queueing, workload=replace(_waiting(), active=False))  # type: ignore[arg-type]
    w.spec["suspend"] = True
    w.run(2)
    w.spec["suspend"] = False
    w.run(2)
    assert w.workload_active == [] and not w.pods


def test_the_workload_is_parsed_from_what_kueue_writes() -> None:
    assert not queueing.parse_workload({"metadata": {"name": WL},
                                        "spec": {"active": False}}).active
    assert queueing.parse_workload({"metadata": {"name": WL}, "spec": {}}).active
    raw = {"metadata": {"name": WL}, "status": {
        "conditions": [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                        "message": "Quota reserved in ClusterQueue team-cq"},
                       {"type": "Admitted", "status": "True", "reason": "Admitted"}],
        "admission": {"clusterQueue": "team-cq", "podSetAssignments": [
            {"name": "workers", "flavors": {"pods": "trn1", "cpu": "trn1"}, "count": 2}]}}}
    wl = queueing.parse_workload(raw)
    assert wl.cluster_queue == "team-cq" and wl.flavors == {"workers": ("trn1",)}
    assert queueing.state(Queueing("team", workload=wl)) == "admitted"
    assert not wl.placed_by_topology
    raw["status"]["admission"]["podSetAssignments"][0]["topologyAssignment"] = {  # type: ignore[index]
        "levels": [L3, "kubernetes.io/hostname"], "slices": []}
    assert queueing.parse_workload(raw).placed_by_topology
    flavor = queueing.parse_flavor({"metadata": {"name": "trn1"}, "spec": {
        "nodeLabels": {"a": "b"}, "tolerations": [{"key": "k", "operator": "Exists"}]}})
    assert flavor.node_labels == {"a": "b"} and flavor.tolerations[0]["key"] == "k"


def test_a_topology_becomes_the_workers_topology_request_ranks_as_the_pod_index() -> None:
    spec = parse_spec(raw_spec(**{"scheduling.topology": {"required": L3}}))
    body = queueing.build_workload(JOB, spec, Queueing("team"), SETTINGS)
    assert body["spec"]["podSets"][0]["topologyRequest"] == {
        "required": L3, "podIndexLabel": "hlat.dev/node-rank"}
    # spare pods hold no rank: the operator places by its own plan after admission
    spared = parse_spec(raw_spec(**{"scheduling.topology": {"required": L3},
                                    "faultTolerance.spareNodes": 1,
                                    "faultTolerance.restartStrategy": "InPlace"}))
    assert queueing.topology_request(spared) is None


def test_an_admission_by_topology_gates_the_pods_for_kueue_s_ungater() -> None:
    spec = parse_spec(raw_spec(**{"scheduling.topology": {"required": L3}}))
    placed_by_kueue = replace(_admitted(), placed_by_topology=True)
    q = Queueing("team", workload=placed_by_kueue, flavors={"trn1": FLAVOR})
    placed = queueing.admitted_spec(spec, q)
    assert placed.scheduling.topology is None  # no plan of the operator's own
    assert placed.template is not None
    pod = builders.build_worker_pod(JOB, placed, 0, 1, SETTINGS)
    assert {"name": "kueue.x-k8s.io/topology"} in pod["spec"]["schedulingGates"]
    meta = pod["metadata"]
    assert meta["annotations"]["kueue.x-k8s.io/workload"] == WL
    assert meta["annotations"]["kueue.x-k8s.io/podset-required-topology"] == L3
    assert meta["labels"]["kueue.x-k8s.io/podset"] == "workers"
    assert meta["labels"]["hlat.dev/node-rank"] == "1"
    # admitted without a topology assignment: the operator's own plan, no gate
    plain = queueing.admitted_spec(spec, Queueing("team", workload=_admitted(),
                                                  flavors={"trn1": FLAVOR}))
    assert plain.scheduling.topology is not None and plain.template is None


def test_a_checkpoint_in_flight_at_the_eviction_is_not_the_one_waited_for() -> None:
    """At step 45 with checkpoint 40 still being written (20 the latest complete), the one
    asked for is at 46 or later: 40 completing is not it."""
    w = _training_world()
    w.advance(1)
    w.beat(45, checkpoint_step=20)
    w.step()
    w.queueing = replace(w.queueing, workload=_admitted(Evicted=PREEMPTED))  # type: ignore[arg-type]
    w.step()
    assert _requests(w) == {("tiny-a0-0", "46"), ("tiny-a0-1", "46")}
    w.advance(1)
    w.beat(47, checkpoint_step=40)
    w.step()
    assert w.status.phase == "Running"
    w.advance(1)
    w.beat(48, checkpoint_step=47)
    w.step()
    assert w.status.phase == "Suspended"


def test_an_elastic_job_in_a_queue_keeps_its_full_size() -> None:
    """Kueue admitted the Workload at spec.nodes and counts it so: a queued elastic job short
    of a node waits for it (Schedulable says why) rather than shrink below what its quota
    holds, and its Workload keeps asking for every node."""
    w = World(raw_spec(**{"nodes": 3, "train.globalBatch": 6, "train.microBatch": 1,
                          "elastic": {"minNodes": 2, "waitSeconds": 30}}),
              nodes=("node-a", "node-b", "node-c"))
    w.queueing = Queueing("team", "high", 1000)
    w.step()
    (workers,) = [s for s in _workload(w)["spec"]["podSets"]  # type: ignore[index]
                  if s["name"] == "workers"]
    assert workers["count"] == 3
    w.queueing = replace(w.queueing, workload=_admitted(),  # type: ignore[arg-type]
                         flavors={"trn1": FLAVOR})
    w.until("Running", step=1)
    lost = w.pod_of(2).node
    assert lost is not None
    w.node_down(lost)
    w.run(180, step=2, every=2.0)
    assert Reason.SHRUNK not in w.reasons()
    assert w.status.size is None or w.status.size.nodes == 3
    assert w.status.phase == "Pending" and len([p for p in w.live() if p.node]) == 2


def test_a_pod_kueue_fails_before_it_runs_is_made_again_with_no_fault() -> None:
    """Rank 1's node lost: the operator restarts in place and makes rank 1's pod again, which
    Kueue's ungater places by the assignment of the day, on the lost node; Kueue's node
    controller then fails it there (condition TerminatedByKueue) and assigns another node.
    No fault of the job: the pod is deleted and made again at once, with no restart counted
    and no backoff, and the attempt runs."""
    w = _training_world()
    lost = w.pod_of(1).node
    assert lost is not None
    w.node_down(lost)
    for _ in range(120):
        w.step()
        made = [p for p in w.pods.values()
                if p.attempt == 1 and p.rank == 1 and p.node is None]
        if made:
            break
        w.advance(1)
    (pod,) = made
    restarts = w.status.restarts.model_copy()
    assert restarts.total == 1
    w.pods[pod.name] = replace(pod, phase="Failed", terminated_by_kueue=True,
                               message="Pod terminated by Kueue NodeController due to node "
                               "taint")
    w.step()
    assert pod.name not in w.pods  # deleted at once
    assert Reason.REPLACED_BY_KUEUE in w.reasons()
    w.step()
    (again,) = [p for p in w.pods.values() if p.attempt == 1 and p.rank == 1]
    w.schedule()
    w.until("Running", step=26)
    assert w.status.attempt == 1 and w.status.restarts == restarts
    assert w.pod_of(1).name == again.name and w.pod_of(1).node not in (None, lost)


def test_kueue_failing_the_made_again_pod_over_and_over_ends_as_a_fault() -> None:
    """Were Kueue to keep failing the pod made again (an assignment never updated), the
    operator makes it again KUEUE_REMAKES_PER_ATTEMPT times, then counts the next as the
    attempt's fault: a restart against the budget, said in a Warning, not a loop."""
    w = _training_world()
    lost = w.pod_of(1).node
    assert lost is not None
    w.node_down(lost)
    counted = None
    for _ in range(KUEUE_REMAKES_PER_ATTEMPT + 1):
        for _ in range(120):
            w.step()
            made = [p for p in w.pods.values()
                    if p.attempt == 1 and p.rank == 1 and p.node is None and p.phase == "Pending"]
            if made:
                break
            w.advance(1)
        (pod,) = made
        counted = w.status.restarts.counted
        w.pods[pod.name] = replace(pod, phase="Failed", terminated_by_kueue=True)
        w.step()
    assert w.reasons().count(Reason.REPLACED_BY_KUEUE) == KUEUE_REMAKES_PER_ATTEMPT + 1
    w.run(5, step=1)
    assert w.status.restarts.counted == (counted or 0) + 1
    assert w.status.attempt == 2


def test_a_pod_kueue_failed_is_told_from_its_condition() -> None:
    """As Kueue v0.17.0's TAS node controller writes it (node_controller.go `markPodsFailed`:
    phase Failed, condition TerminatedByKueue True, reason UnschedulableOnAssignedNode)."""
    raw = {"metadata": {"name": "tiny-a1-1", "labels": {"hlat.dev/attempt": "1",
                                                        "hlat.dev/node-rank": "1"}},
           "spec": {"hostname": "tiny-1"},
           "status": {"phase": "Failed", "conditions": [
               {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"},
               {"type": "TerminatedByKueue", "status": "True",
                "reason": "UnschedulableOnAssignedNode",
                "message": "Pod terminated by Kueue NodeController due to node taint"}]}}
    assert pod_from_raw(raw).terminated_by_kueue
    raw["status"]["conditions"][1]["status"] = "False"
    assert not pod_from_raw(raw).terminated_by_kueue


def test_slices_go_into_the_topology_request_and_the_pods_annotations() -> None:
    """scheduling.topology.sliceSize: the pod set's podSetSliceRequiredTopology and
    podSetSliceSize (apis/kueue/v1beta2/workload_types.go 221-234, v0.17.0), and the pods'
    slice annotations beside the topology one (topology_types.go 53-60)."""
    spec = parse_spec(raw_spec(nodes=4, **{
        "scheduling.topology": {"preferred": L3, "sliceSize": 2}, "train.globalBatch": 16}))
    assert queueing.topology_request(spec) == {
        "preferred": L3, "podIndexLabel": "hlat.dev/node-rank",
        "podSetSliceRequiredTopology": L3, "podSetSliceSize": 2}
    placed_by_kueue = replace(_admitted(), placed_by_topology=True)
    placed = queueing.admitted_spec(spec, Queueing("team", workload=placed_by_kueue,
                                                   flavors={"trn1": FLAVOR}))
    pod = builders.build_worker_pod(JOB, placed, 0, 1, SETTINGS)
    annotations = pod["metadata"]["annotations"]
    assert annotations["kueue.x-k8s.io/podset-slice-required-topology"] == L3
    assert annotations["kueue.x-k8s.io/podset-slice-size"] == "2"
    assert annotations["kueue.x-k8s.io/podset-preferred-topology"] == L3
