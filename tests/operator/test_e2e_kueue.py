"""PretrainJobs admitted by a real Kueue (v0.17.0, built from its Go module) on the local
cluster: a job waits in its LocalQueue, with no pods, while the ClusterQueue's quota is taken;
a higher-priority job preempts a running one, which stops, waits and resumes from its
checkpoint with no restart counted (a checkpoint asked for at the preemption). The operator is Kueue's integration for PretrainJob (an
external framework): it creates each job's Workload and follows what Kueue writes there.

The ClusterQueue's quota is on `pods` (one worker pod takes one node): Kueue counts a pod set's
pods when the ClusterQueue covers `pods` (pkg/scheduler/flavorassigner/flavorassigner.go,
v0.17.0). On EKS the quota would be on aws.amazon.com/neuron; the tiny jobs here request none.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_env import Env, kopf_logged_in, losses
from e2e_network import L3
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from hlat_testbed import faults, kueue
from hlat_testbed.cluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
OPERATOR_METRICS = True
"""The module's operator serves its metrics: Workload watch events are counted there."""

QUEUE = "team"
CLUSTER_QUEUE = "hlat-e2e"
FLAVOR = "trn1"
INSTANCE_LABEL = "node.kubernetes.io/instance-type"
INTERVAL = 150
"""The preempted job's checkpoint interval: 15 s apart at the ~10 steps/s the rig trains, so
the checkpoint asked for at the preemption is told from the periodic ones."""


@pytest.fixture(scope="module")
def kueue_up(cluster: Cluster) -> Iterator[None]:
    """Kueue's manager with a flavor for the rig's trn1 nodes, a ClusterQueue with quota for
    two worker pods that preempts lower priorities, and two WorkloadPriorityClasses."""
    kueue.start(cluster)
    api = cluster.admin_api()
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "ResourceFlavor",
                      "metadata": {"name": FLAVOR},
                      "spec": {"nodeLabels": {INSTANCE_LABEL: "trn1.32xlarge"}}})
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "ClusterQueue",
                      "metadata": {"name": CLUSTER_QUEUE},
                      "spec": {"namespaceSelector": {},
                               "preemption": {"withinClusterQueue": "LowerPriority"},
                               "resourceGroups": [{
                                   "coveredResources": ["pods"],
                                   "flavors": [{"name": FLAVOR, "resources": [
                                       {"name": "pods", "nominalQuota": 2}]}]}]}})
    for name, value in (("hlat-low", 10), ("hlat-high", 1000)):
        kueue.apply(api, {"apiVersion": kueue.API, "kind": "WorkloadPriorityClass",
                          "metadata": {"name": name}, "value": value})
    yield
    kueue.stop(cluster)


@pytest.fixture
def queue(kueue_up: None, job_env: Env) -> str:
    kueue.apply(job_env.cluster.admin_api(), {
        "apiVersion": kueue.API, "kind": "LocalQueue",
        "metadata": {"name": QUEUE, "namespace": job_env.ns},
        "spec": {"clusterQueue": CLUSTER_QUEUE}})
    return QUEUE


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def _pods(env: Env) -> list[Any]:
    return [p for p in env.pods() if p.metadata.labels.get("hlat.dev/job") == env.name]


def _workload(env: Env) -> dict[str, Any]:
    found: dict[str, Any] = client.CustomObjectsApi(env.cluster.admin_api()) \
        .get_namespaced_custom_object(kueue.GROUP, kueue.VERSION, env.ns, "workloads",
                                      f"pretrainjob-{env.name}")  # type: ignore[assignment]
    return found


def _workload_condition(env: Env, type_: str) -> dict[str, Any]:
    try:
        return _condition(_workload(env).get("status") or {}, type_)
    except ApiException:
        return {}


def _frozen(env: Env) -> list[str]:
    """Freeze the job's running pods (SIGSTOP): it holds its quota, however fast the machine
    trains, until `_thawed`. Its heartbeat timeout must be fixed (FROZEN_OK)."""
    names = [p.metadata.name for p in _pods(env) if p.status.phase == "Running"]
    assert names, f"{env.name} has no running pod to freeze"
    for name in names:
        faults.hang(env.cluster.config, env.ns, name)
    return names


def _thawed(env: Env, names: list[str]) -> None:
    for name in names:
        faults.resume(env.cluster.config, env.ns, name)


FROZEN_OK = {"heartbeat": {"startupTimeoutSeconds": 120, "timeoutSeconds": 600}}
"""Fault tolerance for a job the test freezes a while: no hang restart meanwhile."""


def test_a_job_waits_in_its_queue_without_pods_until_the_quota_frees(
        job_env: Env, queue: str) -> None:
    first, second = job_env.other("first"), job_env.other("second")
    first.create(tiny_spec(steps=60, **FROZEN_OK), labels={"kueue.x-k8s.io/queue-name": queue})
    first.wait("first Running", lambda s: s.get("phase") == "Running", 120)
    # the admission's flavor went into the pods: its node label in their node selector
    for pod in _pods(first):
        assert (pod.spec.node_selector or {}).get(INSTANCE_LABEL) == "trn1.32xlarge", pod.spec
    frozen = _frozen(first)  # it runs (and holds its quota) for as long as the test looks

    second.create(tiny_spec(steps=6), labels={"kueue.x-k8s.io/queue-name": queue})
    waiting = second.wait(
        "second waiting in its queue",
        lambda s: s.get("phase") == "Suspended"
        and _condition(s, "Suspended").get("reason") == "Queued"
        and "quota" in _condition(s, "Suspended").get("message", ""), 60)
    message = _condition(waiting, "Suspended")["message"]
    assert f"LocalQueue {queue}" in message, message
    assert waiting.get("reason") == "Queued", waiting  # kubectl get pj's Why column
    assert not _pods(second), "a job waiting for admission has pods"
    _thawed(first, frozen)

    def first_done(status: dict[str, Any]) -> bool:
        """The second has no pod while the first runs (its pods, then the first's phase again:
        the first may have ended between the two reads)."""
        if _pods(second):
            assert first.status().get("phase") == "Succeeded", "both jobs had pods at once"
        return status.get("phase") == "Succeeded"

    done = first.wait("first Succeeded", first_done, 300)
    assert done["restarts"]["total"] == 0
    # the ended job's Workload is Finished (the next pass writes it), which frees the quota
    first.wait("first's Workload Finished",
               lambda _s: _workload_condition(first, "Finished").get("status") == "True", 30)
    assert _workload_condition(first, "Finished").get("reason") == "Succeeded"

    finished = second.wait("second Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    assert finished["restarts"]["total"] == 0 and finished["attempt"] == 0
    reasons = [r for r, _ in second.event_messages()]
    assert "Queued" in reasons and "Admitted" in reasons, second.event_messages()
    # Kueue's writes reached the operator as watch events (it started before Kueue's CRDs
    # existed: kopf found them when they appeared), not only by its resync
    assert _watch_events(job_env, "Workload") >= 4


def _watch_events(env: Env, kind: str) -> float:
    port = env.operator["op"].metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "hlat_operator_watch_events_total"
               and s.labels.get("kind") == kind)


def test_a_suspended_job_frees_its_quota_and_queues_again_when_resumed(
        job_env: Env, queue: str) -> None:
    """spec.suspend on an admitted job deactivates its Workload: Kueue evicts it, the quota
    goes to the job waiting behind it; resumed, it waits in its queue and then trains on from
    its checkpoint, no restart counted."""
    first, second = job_env.other("first"), job_env.other("second")
    spec = tiny_spec(steps=600, **FROZEN_OK)
    spec["checkpoint"]["interval"] = 20
    first.create(spec, labels={"kueue.x-k8s.io/queue-name": queue})
    first.wait("first past a checkpoint", lambda s: s.get("phase") == "Running"
               and (s.get("latestCheckpoint") or {}).get("step", -1) >= 20, 120)
    frozen = _frozen(first)
    second.create(tiny_spec(steps=6), labels={"kueue.x-k8s.io/queue-name": queue})
    second.wait("second waiting in its queue", lambda s: _condition(
        s, "Suspended").get("reason") == "Queued", 60)
    _thawed(first, frozen)
    first.patch_spec({"suspend": True})
    first.wait("first Suspended", lambda s: s.get("phase") == "Suspended"
               and _condition(s, "Suspended").get("reason") == "Suspended", 60)
    # the pass that writes phase Suspended deactivates the Workload right after that status
    # write (the status goes first: a stale pass must lose before it acts), so a read between
    # the two still sees it active
    first.wait("first's Workload deactivated",
               lambda _s: _workload(first)["spec"]["active"] is False, 30)
    second.wait("second admitted while the first is suspended", lambda s: s.get("phase") in (
        "Pending", "Running", "Succeeded"), 120)
    assert first.status()["phase"] == "Suspended"
    # Kueue frees an inactive Workload's quota in its own books at once (v0.17.0
    # pkg/controller/core/workload_controller.go, Update: !active -> cache.DeleteWorkload);
    # the operator releases the reservation on the Workload once the pods are gone
    first.wait("first's reservation released", lambda _s: _workload_condition(
        first, "QuotaReserved").get("status") == "False", 60)
    assert _workload_condition(first, "Requeued").get("status") == "False"

    first.patch_spec({"suspend": False})
    second.wait("second Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    done = first.wait_trained()
    assert _workload(first)["spec"]["active"] is True
    assert done["restarts"]["total"] == 0 and done["attempt"] == 1, done
    # suspended with a checkpoint asked for: resumed from it (or from a periodic one its
    # workers wrote later, before their pods stopped)
    saved = re.findall(r"checkpoint step_(\d+): asked for by the operator", first.pod_log(0, 0))
    resumed = re.findall(r"resumed from checkpoint step_(\d+)", first.pod_log(1, 0))
    assert saved and resumed and int(resumed[0]) >= int(saved[0]), (saved, resumed)
    reasons = [r for r, _ in first.event_messages()]
    assert "Suspended" in reasons and reasons.count("Admitted") >= 2, first.event_messages()


def test_a_higher_priority_job_preempts_a_running_one_which_checkpoints_and_resumes_there(
        job_env: Env, queue: str) -> None:
    low, high = job_env.other("low"), job_env.other("high")
    spec = tiny_spec(steps=900)
    spec["checkpoint"].update({"interval": INTERVAL})
    low.create(spec, labels={"kueue.x-k8s.io/queue-name": queue,
                             "kueue.x-k8s.io/priority-class": "hlat-low"})
    running = low.wait("low past its first checkpoint",
                       lambda s: s.get("phase") == "Running"
                       and (s.get("latestCheckpoint") or {}).get("step", -1) >= INTERVAL, 240)
    assert running["progress"]["step"] < 600, "the job ran to its end before the preemption"

    high.create(tiny_spec(steps=6), labels={"kueue.x-k8s.io/queue-name": queue,
                                            "kueue.x-k8s.io/priority-class": "hlat-high"})
    held = low.wait("low evicted by Kueue",
                    lambda s: s.get("phase") == "Suspended"
                    and _condition(s, "Suspended").get("reason") == "EvictedByKueue", 180)
    assert "Preempted" in _condition(held, "Suspended")["message"], held
    # the workers were asked for a checkpoint now, wrote it between their periodic ones, and
    # stopped once it was complete
    said = [m for r, m in low.event_messages() if r == "EvictedByKueue"
            and "checkpoint now" in m]
    assert said, low.event_messages()
    asked = int(re.search(r"checkpoint now \(step (\d+)", said[0]).group(1))  # type: ignore[union-attr]
    stopped_at = held["latestCheckpoint"]["step"]
    saved = [int(n) for n in re.findall(r"checkpoint step_(\d+): asked for by the operator",
                                        low.pod_log(0, 0))]
    assert saved == [stopped_at] and stopped_at >= asked, (saved, stopped_at, asked)
    # it waits with no pods: its gang is gone while the higher-priority job holds the quota
    deadline = time.monotonic() + 30
    while [p for p in low.pods() if p.metadata.name.startswith(f"{low.name}-a0-")]:
        assert time.monotonic() < deadline, [p.metadata.name for p in low.pods()]
        time.sleep(0.25)
    if high.status().get("phase") != "Succeeded":  # else Kueue may have admitted low again
        assert not low.pods(), [p.metadata.name for p in low.pods()]
        assert low.status().get("phase") == "Suspended"
    high_done = high.wait("high Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    assert high_done["restarts"]["total"] == 0

    done = low.wait("low Succeeded", lambda s: s.get("phase") == "Succeeded", 600)
    # no restart counted, one more attempt: the one Kueue admitted again, from the checkpoint
    # asked for; trained twice: only the steps between that save and the pods' stop
    assert done["restarts"]["total"] == 0, done["restarts"]
    assert done["attempt"] == 1 and done["progress"]["step"] == 900
    resumed = re.findall(r"resumed from checkpoint step_(\d+)", low.pod_log(1, 0))
    assert resumed and int(resumed[0]) == stopped_at, (resumed, stopped_at)
    trained = max(losses(low.pod_log(0, 0)))
    print(f"preempted: stopped at step {trained} after checkpoint {stopped_at} (asked at "
          f"{asked}): {trained - stopped_at} steps trained again; the periodic checkpoint "
          f"before was step {stopped_at // INTERVAL * INTERVAL}")
    assert trained - stopped_at < INTERVAL, (trained, stopped_at)


# --- a ResourceFlavor per instance type --------------------------------------------------------

TRN2 = "trn2.48xlarge"
TRN2_FIRST_INDEX = 60
"""Pod ranges of the trn2 pool: clear of the session's node-<i>, test_e2e_eks_nodes' pools (40..)
and e2e_network's (50..)."""


@pytest.fixture
def types_queue(kueue_up: None, job_env: Env) -> Iterator[str]:
    """Two trn2.48xlarge nodes beside the session's trn1.32xlarge ones (untainted: the CPU jobs
    here request no Neuron device), a ResourceFlavor per instance type, and a ClusterQueue
    with quota for two worker pods of each."""
    cluster = job_env.cluster
    added = cluster.add_node_pool("kq-trn2", 2, TRN2, "managed", TRN2_FIRST_INDEX, taint=False)
    api = cluster.admin_api()
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "ResourceFlavor",
                      "metadata": {"name": "trn2"},
                      "spec": {"nodeLabels": {INSTANCE_LABEL: TRN2}}})
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "ClusterQueue",
                      "metadata": {"name": "hlat-e2e-types"},
                      "spec": {"namespaceSelector": {},
                               "resourceGroups": [{
                                   "coveredResources": ["pods"],
                                   "flavors": [
                                       {"name": FLAVOR, "resources": [
                                           {"name": "pods", "nominalQuota": 2}]},
                                       {"name": "trn2", "resources": [
                                           {"name": "pods", "nominalQuota": 2}]}]}]}})
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "LocalQueue",
                      "metadata": {"name": "types", "namespace": job_env.ns},
                      "spec": {"clusterQueue": "hlat-e2e-types"}})
    try:
        yield "types"
    finally:
        cluster.remove_nodes(added)


def _on(instance: str, steps: int, **fault_tolerance: Any) -> dict[str, Any]:
    """A tiny job pinned to an instance type, as a trn job's own node selector pins it (the CPU
    jobs here carry it in spec.scheduling)."""
    spec = tiny_spec(steps=steps, **fault_tolerance)
    spec["scheduling"] = {"nodeSelector": {INSTANCE_LABEL: instance}}
    return spec


def test_each_instance_type_is_a_flavor_with_its_own_quota(job_env: Env, types_queue: str
                                                             ) -> None:
    """Kueue admits a job only into the flavor of its instance type: with the trn1 quota held,
    a trn2 job is admitted into the trn2 flavor and trains on the trn2 nodes, while another
    trn1 job waits in the same queue, its message naming the trn1 flavor."""
    holder, other, waiter = (job_env.other(n) for n in ("holder", "other", "waiter"))
    labels = {"kueue.x-k8s.io/queue-name": types_queue}
    holder.create(_on("trn1.32xlarge", 60, **FROZEN_OK), labels=labels)
    holder.wait("holder Running", lambda s: s.get("phase") == "Running", 120)
    frozen = _frozen(holder)
    try:
        other.create(_on(TRN2, 6), labels=labels)
        waiter.create(_on("trn1.32xlarge", 6), labels=labels)
        done = other.wait("the trn2 job Succeeded", lambda s: s.get("phase") == "Succeeded",
                          240)
        assert done["restarts"]["total"] == 0
        nodes = {p.spec.node_name for p in _pods(other)}
        assert nodes == {"kq-trn2-0", "kq-trn2-1"}, nodes
        admission = (_workload(other).get("status") or {}).get("admission") or {}
        flavors = {f for ps in admission.get("podSetAssignments") or []
                   for f in (ps.get("flavors") or {}).values()}
        assert flavors == {"trn2"}, admission
        waiting = waiter.wait("the second trn1 job waiting", lambda s: _condition(
            s, "Suspended").get("reason") == "Queued", 60)
        message = _condition(waiting, "Suspended")["message"]
        assert f"flavor {FLAVOR}" in message and not _pods(waiter), message
    finally:
        _thawed(holder, frozen)
    holder.wait("holder Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    waiter.wait("the second trn1 job Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    assert {p.spec.node_name for p in _pods(waiter)} <= {"node-0", "node-1", "node-2",
                                                        "net-0", "net-1"}


# --- topology through Kueue's topology-aware scheduling ----------------------------------------

HOSTNAME = "kubernetes.io/hostname"


@pytest.fixture
def tas_queue(kueue_up: None, job_env: Env, network: dict[str, str]) -> str:
    """A LocalQueue whose ClusterQueue's flavor has a Topology: the network's layer-3 blocks,
    then the nodes (Kueue places a pod set within one block and returns the nodes)."""
    api = job_env.cluster.admin_api()
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "Topology",
                      "metadata": {"name": "hlat-e2e-network"},
                      "spec": {"levels": [{"nodeLabel": L3}, {"nodeLabel": HOSTNAME}]}})
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "ResourceFlavor",
                      "metadata": {"name": "trn1-network"},
                      "spec": {"nodeLabels": {INSTANCE_LABEL: "trn1.32xlarge"},
                               "topologyName": "hlat-e2e-network"}})
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "ClusterQueue",
                      "metadata": {"name": "hlat-e2e-network"},
                      "spec": {"namespaceSelector": {},
                               "resourceGroups": [{
                                   "coveredResources": ["pods", "cpu"],
                                   "flavors": [{"name": "trn1-network", "resources": [
                                       {"name": "pods", "nominalQuota": 10},
                                       {"name": "cpu", "nominalQuota": 1000}]}]}]}})
    kueue.apply(api, {"apiVersion": kueue.API, "kind": "LocalQueue",
                      "metadata": {"name": "network", "namespace": job_env.ns},
                      "spec": {"clusterQueue": "hlat-e2e-network"}})
    return "network"


NODE_CPU = "100"
"""A worker's cpu request: more than half a rig node's allocatable (trn1.32xlarge, 127610m), so
one worker per node, as a Trainium worker that requests all the node's devices (the tiny CPU
jobs request nothing, and Kueue's topology-aware scheduling would pack them onto one node)."""


def _spec_in_blocks(nodes: int) -> dict[str, Any]:
    spec = tiny_spec(steps=4)
    spec["nodes"] = nodes
    spec["train"]["globalBatch"] = 2 * nodes
    spec["scheduling"] = {"topology": {"required": L3}}
    spec["template"] = {"spec": {"containers": [
        {"name": "trainer", "resources": {"requests": {"cpu": NODE_CPU}}}]}}
    return spec


def test_kueue_places_a_job_requiring_a_block_in_one_block_by_rank(
        job_env: Env, tas_queue: str, network: dict[str, str]) -> None:
    job_env.create(_spec_in_blocks(3), labels={"kueue.x-k8s.io/queue-name": tas_queue})
    # (the wait returns the job's status, which may still be empty: Kueue can admit before
    # the operator first writes it; the Workload's condition is what the wait checked)
    job_env.wait("admitted by topology",
                 lambda _s: _workload_condition(job_env, "Admitted").get("status") == "True",
                 120)
    assignment = _workload(job_env)["status"]["admission"]["podSetAssignments"][0]
    # with the hostname level in the Topology, Kueue assigns nodes (the lowest level only)
    assert assignment["topologyAssignment"]["levels"] == [HOSTNAME], assignment

    def bound() -> dict[int, Any] | None:
        pods = [p for p in _pods(job_env) if p.metadata.labels.get("hlat.dev/attempt") == "0"]
        if len(pods) < 3 or not all(p.spec.node_name for p in pods):
            return None
        return {int(p.metadata.labels["hlat.dev/node-rank"]): p for p in pods}
    job_env.wait("3 pods bound", lambda _s: bound() is not None, 120)
    pods = bound()
    assert pods is not None
    # Kueue's ungater lifted the gate and pinned each rank to its node of one block
    nodes = {r: p.spec.node_name for r, p in pods.items()}
    assert {network[n] for n in nodes.values()} == {"nn-blk-b"}, nodes
    assert len(set(nodes.values())) == 3, nodes  # one worker per node: each takes a node's cpu
    # ranks follow the topology, as the operator's own plan orders them (levels, then node
    # name): Kueue sorts the assigned domains by their level values, the hostname last
    # (v0.17.0 pkg/cache/scheduler/tas_flavor_snapshot.go buildAssignment), and its ungater
    # gives rank i the i-th pod of that order (pkg/controller/tas/topology_ungater.go
    # rankToDomainID) by the pods' podIndexLabel, hlat.dev/node-rank
    assert [nodes[r] for r in sorted(nodes)] == sorted(nodes.values()), nodes
    for pod in pods.values():
        assert not pod.spec.scheduling_gates, pod.spec.scheduling_gates
        assert pod.spec.node_selector.get(HOSTNAME) == pod.spec.node_name, pod.spec.node_selector
    done = job_env.wait_trained()
    assert done["progress"]["step"] == 4


def test_kueue_admits_a_job_in_slices_only_where_whole_slices_fit(
        job_env: Env, tas_queue: str, network: dict[str, str]) -> None:
    """Four ranks preferring blocks in slices of 2 (`sliceSize`: the pod set's
    podSetSliceRequiredTopology and podSetSliceSize). With one node of block a cordoned, the
    blocks hold 1 and 3 usable nodes: 3 + 1 would do for the ranks alone, but only one whole
    slice fits, so Kueue leaves the job in its queue with no pods. Uncordoned, it admits the
    job 2 + 2, ranks 0-1 in one block and 2-3 in the other."""
    core = client.CoreV1Api(job_env.cluster.admin_api())
    cordoned = sorted(n for n, block in network.items() if block == "nn-blk-a")[0]
    core.patch_node(cordoned, {"spec": {"unschedulable": True}})
    try:
        spec = _spec_in_blocks(4)
        spec["train"]["steps"] = 2
        spec["scheduling"]["topology"] = {"preferred": L3, "sliceSize": 2}
        job_env.create(spec, labels={"kueue.x-k8s.io/queue-name": tas_queue})
        request = _workload_when_made(job_env)["spec"]["podSets"][0]["topologyRequest"]
        assert (request["podSetSliceRequiredTopology"], request["podSetSliceSize"]) == (L3, 2)
        status = job_env.wait("waiting in the queue for whole slices",
                              lambda s: _condition(s, "Suspended").get("reason") == "Queued",
                              60)
        time.sleep(10)  # Kueue has had several scheduling cycles to admit it, and did not
        assert _workload_condition(job_env, "Admitted").get("status") != "True", status
        assert not _pods(job_env)
    finally:
        core.patch_node(cordoned, {"spec": {"unschedulable": False}})
    job_env.wait("4 pods bound", lambda _s: len(_ranked_nodes(job_env)) == 4, 180)
    placed = _ranked_nodes(job_env)
    blocks = [network[placed[r]] for r in range(4)]
    assert blocks[0] == blocks[1] and blocks[2] == blocks[3] and blocks[0] != blocks[2], placed
    assert job_env.wait_trained()["progress"]["step"] == 2


def _workload_when_made(env: Env) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def made(_s: dict[str, Any]) -> bool:
        try:
            found.update(_workload(env))
        except ApiException:
            return False
        return True
    env.wait("the Workload made", made, 60)
    return found


def test_a_job_no_block_holds_waits_in_its_queue_with_kueue_s_reason(
        job_env: Env, tas_queue: str, network: dict[str, str]) -> None:
    job_env.create(_spec_in_blocks(4), labels={"kueue.x-k8s.io/queue-name": tas_queue})
    status = job_env.wait(
        "waiting in the queue for a block",
        lambda s: _condition(s, "Suspended").get("reason") == "Queued"
        and "topology" in _condition(s, "Suspended").get("message", ""), 60)
    assert status["phase"] == "Suspended" and not _pods(job_env)


def test_kopf_rescans_a_group_whose_resource_is_served_after_the_start(
        kueue_up: None, cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf starts the watch of a CRD installed after the operator only if a CRD event comes
    after the API server's discovery lists it (late_apis); here kopf's record says nothing is
    watched though Kueue's Workloads are served, as when kopf lost that race: follow has kopf
    rescan, and the Workloads are watched (by the operator's handlers' registry)."""
    import asyncio

    import kopf

    from hlat_operator import handlers, late_apis

    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))

    async def follow() -> Any:
        settings = await kopf_logged_in()
        insights = late_apis.insights()
        insights.ready_resources.set()  # as after kopf's scan at its start, which missed them
        assert not late_apis.watched(insights, kueue.GROUP, "workloads")
        await asyncio.wait_for(late_apis.follow(
            insights, settings, kopf.get_default_registry(),
            [(kueue.GROUP, "workloads")], period=0.2), 30)
        return insights

    insights = asyncio.run(follow())
    assert late_apis.watched(insights, kueue.GROUP, "workloads")
    assert (kueue.GROUP, "workloads") in handlers.FOLLOWED



# --- a node lost under Kueue's topology-aware scheduling ---------------------------------------
# Kueue v0.17.0 replaces a failed node of a TAS-admitted Workload itself (TASFailedNodeReplacement,
# TASFailedNodeReplacementFailFast and TASReplaceNodeOnPodTermination: beta, on by default,
# pkg/features/kube_features.go 432-452): once the node is NotReady and the Workload's pods on it
# terminated, its node controller lists it in the Workload's status.unhealthyNodes
# (pkg/controller/tas/node_controller.go), and the scheduler finds a free node in the same
# domain and rewrites the topologyAssignment, or, finding none, evicts the Workload with reason
# NodeFailures (pkg/scheduler/scheduler.go `evictWorkloadAfterFailedTASReplacement`).

def _in_place_in_blocks(nodes: int) -> dict[str, Any]:
    spec = _spec_in_blocks(nodes)
    spec["train"]["steps"] = 600  # about 25 s of training: the node is lost mid-run
    spec["checkpoint"] = {**spec["checkpoint"], "interval": 50}
    spec["faultTolerance"] = {"restartStrategy": "InPlace"}
    return spec


def _ranked_nodes(env: Env) -> dict[int, str]:
    return {int(p.metadata.labels["hlat.dev/node-rank"]): p.spec.node_name for p in _pods(env)
            if p.metadata.deletion_timestamp is None and p.spec.node_name}


def test_a_node_lost_under_kueue_s_topology_is_replaced_in_its_block_in_place(
        job_env: Env, tas_queue: str, network: dict[str, str]) -> None:
    """Block a cordoned: two ranks requiring one block are admitted into block b (3 nodes, one
    left free). Rank 1's node goes down: the operator restarts in place (rank 0's pod kept)
    and makes rank 1's pod again with Kueue's scheduling gate; Kueue marks the node unhealthy,
    assigns the block's free node in its place, and its ungater puts the pod there. The
    Workload is never evicted, and the job ends Succeeded."""
    core = client.CoreV1Api(job_env.cluster.admin_api())
    cordoned = sorted(n for n, block in network.items() if block == "nn-blk-a")
    for name in cordoned:  # Kueue's topology-aware scheduling skips unschedulable nodes
        core.patch_node(name, {"spec": {"unschedulable": True}})
    try:
        job_env.create(_in_place_in_blocks(2),
                       labels={"kueue.x-k8s.io/queue-name": tas_queue})
        job_env.wait("training", lambda s: s.get("phase") == "Running"
                     and s.get("progress", {}).get("step", 0) >= 1, 180)
        placed = _ranked_nodes(job_env)
        assert {network[n] for n in placed.values()} == {"nn-blk-b"}, placed
        (free,) = {n for n, block in network.items() if block == "nn-blk-b"} - set(placed.values())
        kept = next(p.metadata.name for p in _pods(job_env)
                    if p.metadata.labels["hlat.dev/node-rank"] == "0")
        lost = placed[1]
        faults.node_down(job_env.cluster.config, lost)
        try:
            job_env.wait("rank 1 on the block's free node",
                         lambda s: s.get("attempt", 0) >= 1 and s.get("phase") == "Running"
                         and _ranked_nodes(job_env).get(1) == free, 180)
            assert _workload_condition(job_env, "Evicted").get("status") != "True"
            ranks = {p.metadata.labels["hlat.dev/node-rank"]: p for p in _pods(job_env)
                     if p.metadata.deletion_timestamp is None}
            assert ranks["0"].metadata.name == kept  # in place: rank 0's pod stayed
            assert not ranks["1"].spec.scheduling_gates  # Kueue's ungater placed it
            assert ranks["1"].spec.node_selector.get(HOSTNAME) == free
            assignment = _workload(job_env)["status"]["admission"]["podSetAssignments"][0]
            assert lost not in json.dumps(assignment["topologyAssignment"]), assignment
            done = job_env.wait_trained()
        finally:
            faults.node_up(job_env.cluster.config, lost)
            job_env.cluster.wait_nodes_ready([lost], timeout=60)
    finally:
        for name in cordoned:
            core.patch_node(name, {"spec": {"unschedulable": False}})
    assert done["phase"] == "Succeeded" and done["progress"]["step"] == 600, done
    # the node loss only: a pod Kueue failed on the lost node before it ran (when the ungater
    # placed it by the assignment of the day) is made again, no restart (NodeReplacedByKueue)
    assert done["restarts"]["inPlace"] == 1 and done["restarts"]["total"] == 1, done["restarts"]
    assert _workload_condition(job_env, "Evicted").get("status") != "True"


def test_a_node_lost_under_kueue_s_topology_with_no_free_node_in_its_block_moves_the_job(
        job_env: Env, tas_queue: str, network: dict[str, str]) -> None:
    """Two ranks requiring one block are admitted into block a (2 nodes, the tightest). Rank
    1's node goes down; the block has no node to replace it, so Kueue evicts the Workload
    (NodeFailures): the operator stops the job, which waits in its queue (no restart counted),
    and Kueue admits it again in block b, where it resumes and ends Succeeded."""
    job_env.create(_in_place_in_blocks(2), labels={"kueue.x-k8s.io/queue-name": tas_queue})
    job_env.wait("training", lambda s: s.get("phase") == "Running"
                 and s.get("progress", {}).get("step", 0) >= 1, 180)
    placed = _ranked_nodes(job_env)
    assert {network[n] for n in placed.values()} == {"nn-blk-a"}, placed
    lost = placed[1]
    faults.node_down(job_env.cluster.config, lost)
    try:
        job_env.wait("admitted again, in block b",
                     lambda s: s.get("attempt", 0) >= 1 and s.get("phase") == "Running"
                     and len(moved := _ranked_nodes(job_env)) == 2
                     and {network[n] for n in moved.values()} == {"nn-blk-b"}, 180)
        evicted = [m for r, m in job_env.event_messages() if r == "EvictedByKueue"]
        assert evicted and "NodeFailures" in evicted[0] and lost in evicted[0], evicted
        done = job_env.wait_trained()
    finally:
        faults.node_up(job_env.cluster.config, lost)
        job_env.cluster.wait_nodes_ready([lost], timeout=60)
    assert done["phase"] == "Succeeded" and done["progress"]["step"] == 600, done
    moved = {p.metadata.labels["hlat.dev/node-rank"]: p.spec.node_name for p in _pods(job_env)}
    assert {network[n] for n in moved.values()} == {"nn-blk-b"}, moved
