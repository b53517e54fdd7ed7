"""Kueue: the operator as Kueue's integration for PretrainJob (pure; executed by reconcile/k8s).

A PretrainJob labelled `kueue.x-k8s.io/queue-name: <LocalQueue>` waits for Kueue's admission.
Kueue starts no controller for an external framework (`integrations.externalFrameworks` only
registers the kind): the integration creates the Workload and acts on it, as Kueue's own
jobframework does for built-in jobs (kubernetes-sigs/kueue v0.17,
pkg/controller/jobframework/reconciler.go, `ReconcileGenericJob`). What this module decides:

- the Workload (kueue.x-k8s.io/v1beta2): one pod set of `nodes` workers (and one of the spare
  nodes, so that they count against quota like workers), each pod's template as the operator
  builds it (its resources, node selector, tolerations), the LocalQueue, and the priority of the
  `kueue.x-k8s.io/priority-class` WorkloadPriorityClass;
- `state`: whether the job may run (Admitted=True), waits (no pods: Kueue has not reserved
  quota, or not every admission check passed), or was evicted (preempted, deactivated, ...);
- on admission, the flavors' node labels and tolerations go into the pods (Kueue's
  `podset.FromAssignment`, pkg/podset/podset.go: nodeLabels into the node selector,
  tolerations appended; nodeTaints only decide admission);
- after an eviction, once the pods are gone, the Workload's quota reservation is released
  (QuotaReserved=False, admission cleared; Requeued=True when preempted: reconciler.go
  `UnsetQuotaReservationWithCondition`), so Kueue can admit it again;
- when the job ends, the Workload's `Finished` condition (Succeeded or Failed), which frees the
  quota.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hlat_api import labels
from hlat_api.podtemplate import PodTemplate
from hlat_api.spec import PretrainJobSpec, Toleration
from hlat_operator import builders
from hlat_operator.builders import JobRef
from hlat_operator.config import OperatorSettings
from hlat_operator.kube import Workload, WorkloadSpec

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
WORKLOAD_API = f"{GROUP}/{VERSION}"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""On the PretrainJob: the LocalQueue (in the job's namespace) it waits in."""
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""On the PretrainJob: the WorkloadPriorityClass of its Workload (Kueue's label for jobs)."""
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
TOPOLOGY_GATE = "kueue.x-k8s.io/topology"
"""The scheduling gate Kueue's topology ungater lifts, adding the pod's domain to its node
selector (pkg/controller/tas/topology_ungater.go, v0.17.0)."""
WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"
PODSET_LABEL = "kueue.x-k8s.io/podset"
TERMINATED_BY_KUEUE = "TerminatedByKueue"
"""The pod condition Kueue's TAS node controller sets on a pod it fails because it was
assigned, still unplaced, to a node Kueue found unhealthy (pkg/controller/tas/node_controller.go
`markPodsFailed`, v0.17.0): the pod never ran, and Kueue replaces the node in the Workload's
topologyAssignment (or evicts the Workload when no node can replace it)."""

SLICE_ANNOTATIONS = ("kueue.x-k8s.io/podset-slice-required-topology",
                     "kueue.x-k8s.io/podset-slice-size")
"""The pod annotations of a pod set placed in slices (apis/kueue/v1beta2/topology_types.go
53-60, v0.17.0): the slice level and size, as the pod set's topologyRequest says them."""
TOPOLOGY_ANNOTATIONS = {"required": "kueue.x-k8s.io/podset-required-topology",
                        "preferred": "kueue.x-k8s.io/podset-preferred-topology"}
"""The pod annotations by which Kueue knows a pod as placed by topology (pkg/util/tas/tas.go
`IsTAS`)."""
WORKERS, SPARES = "workers", "spares"
POLL_SECONDS = 2.0
"""How often a job re-reads what it waits for on Kueue's side that no watch event announces:
an evicted gang's next checkpoint, its own writes to the Workload taking effect. Kueue's own
writes (admission, eviction) wake the job through the Workload watch
(`handlers.on_workload`); between them the operator's resync reads the Workload again."""

State = Literal["absent", "waiting", "admitted", "evicted", "finished"]


@dataclass(frozen=True)
class WorkloadCondition:
    status: str
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class Flavor:
    """A ResourceFlavor, as much of it as the pods take."""

    name: str
    node_labels: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class ObservedWorkload:
    name: str
    conditions: Mapping[str, WorkloadCondition] = field(default_factory=dict)
    cluster_queue: str | None = None
    """From status.admission, while Kueue holds quota for it."""
    flavors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Pod set -> the ResourceFlavors its admission assigned (one per resource)."""
    placed_by_topology: bool = False
    """The admission carries a topologyAssignment for the workers (Kueue's TAS places them)."""
    active: bool = True
    """spec.active: false once deactivated (Kueue then evicts it and it waits outside the
    queue, holding no quota, until it is active again)."""

    def true(self, type_: str) -> bool:
        found = self.conditions.get(type_)
        return found is not None and found.status == "True"


@dataclass(frozen=True)
class Queueing:
    """What the operator sees of a queued job: its queue, priority and Workload."""

    queue: str
    priority_class: str | None = None
    priority: int | None = None
    """The WorkloadPriorityClass's value; None when there is no class or it is missing."""
    workload: ObservedWorkload | None = None
    flavors: Mapping[str, Flavor] = field(default_factory=dict)
    """The ResourceFlavors the admission names, by name."""


def workload_name(job: JobRef) -> str:
    return f"pretrainjob-{job.name}"


def state(q: Queueing) -> State:
    w = q.workload
    if w is None:
        return "absent"
    if w.true("Finished"):
        return "finished"
    if w.true("Evicted") and w.true("QuotaReserved"):
        return "evicted"
    if w.true("Admitted") and w.true("QuotaReserved"):
        return "admitted"
    return "waiting"


def wait_message(q: Queueing) -> str:
    """Why the job waits, for a person: the queue, and Kueue's own words when it has some."""
    where = f"LocalQueue {q.queue}"
    w = q.workload
    if w is None:
        return f"waiting in {where} for Kueue to admit its Workload (created now)"
    said = next((c.message for t in ("QuotaReserved", "Admitted")
                 if (c := w.conditions.get(t)) is not None and c.status != "True" and c.message),
                "")
    if w.true("QuotaReserved"):
        said = said or "quota reserved, waiting for its admission checks"
    return (f"waiting in {where} for Kueue to admit Workload {w.name}"
            + (f": {said}" if said else ""))


def eviction(q: Queueing) -> str:
    """What Kueue said of its eviction of the Workload."""
    w = q.workload
    assert w is not None
    evicted = w.conditions.get("Evicted") or WorkloadCondition("True")
    why = f"{evicted.reason}: {evicted.message}" if evicted.message else evicted.reason
    return f"Kueue evicted Workload {w.name} ({why})"


def eviction_message(q: Queueing) -> str:
    return (f"{eviction(q)}; the pods are stopped and the job waits in LocalQueue {q.queue} "
            f"to be admitted again, then resumes from the latest complete checkpoint (no "
            f"restart counted)")


def admitted_message(q: Queueing) -> str:
    w = q.workload
    assert w is not None
    flavors = sorted({f for names in w.flavors.values() for f in names})
    return (f"Kueue admitted Workload {w.name} through ClusterQueue {w.cluster_queue}"
            + (f" (flavors {', '.join(flavors)})" if flavors else ""))


def admitted_spec(spec: PretrainJobSpec, q: Queueing) -> PretrainJobSpec:
    """The spec with the admission's flavors applied: their node labels in the node selector,
    their tolerations added (what Kueue's podset.FromAssignment does to a job's pods)."""
    w = q.workload
    if w is None:
        return spec
    selector = dict(spec.scheduling.node_selector)
    tolerations = list(spec.scheduling.tolerations)
    for name in sorted({f for names in w.flavors.values() for f in names}):
        flavor = q.flavors.get(name)
        if flavor is None:
            continue
        selector.update(flavor.node_labels)
        for raw in flavor.tolerations:
            toleration = Toleration.model_validate(raw)
            if toleration not in tolerations:
                tolerations.append(toleration)
    update: dict[str, Any] = {"node_selector": selector, "tolerations": tolerations}
    if w.placed_by_topology:
        update["topology"] = None  # Kueue places the pods: no plan of the operator's own
    scheduling = spec.scheduling.model_copy(update=update)
    placed = spec.model_copy(update={"scheduling": scheduling})
    if w.placed_by_topology and spec.scheduling.topology is not None:
        placed = placed.model_copy(update={"template": _gated_template(spec, w.name)})
    return placed


def _gated_template(spec: PretrainJobSpec, workload: str) -> PodTemplate:
    """The pod template with what Kueue's topology ungater needs to place the worker pods: its
    scheduling gate, the Workload and pod set, and the topology request (as Kueue's own job
    integrations set them: pkg/podset/podset.go `FromAssignment`, jobframework
    reconciler.go); the ungater gives each pod its domain by its node rank (podIndexLabel)."""
    topo = spec.scheduling.topology
    assert topo is not None
    kind, level = ("required", topo.required) if topo.required else ("preferred", topo.preferred)
    base = spec.template or PodTemplate()
    body = dict(base.spec)
    gates = [g for g in body.get("schedulingGates") or [] if g.get("name") != TOPOLOGY_GATE]
    body["schedulingGates"] = [*gates, {"name": TOPOLOGY_GATE}]
    sliced = (dict(zip(SLICE_ANNOTATIONS, (str(level), str(topo.slice_size)), strict=True))
              if topo.slice_size else {})
    meta = base.metadata.model_copy(update={
        "labels": {**base.metadata.labels, PODSET_LABEL: WORKERS},
        "annotations": {**base.metadata.annotations, WORKLOAD_ANNOTATION: workload,
                        TOPOLOGY_ANNOTATIONS[kind]: str(level), **sliced}})
    return PodTemplate(metadata=meta, spec=body)


def topology_request(spec: PretrainJobSpec) -> dict[str, str | int] | None:
    """The workers' pod set's topologyRequest for spec.scheduling.topology: the level, and the
    node rank as the pod index, so the ungater gives consecutive ranks consecutive domains;
    with slices, each of `sliceSize` pods in one domain of the level
    (`podSetSliceRequiredTopology`, `podSetSliceSize`: apis/kueue/v1beta2/workload_types.go
    221-234, v0.17.0). None without a topology, or with spare nodes (spare pods hold no rank:
    the operator then places by its own plan, after admission)."""
    topo = spec.scheduling.topology
    if topo is None or spec.fault_tolerance.spare_nodes:
        return None
    kind, level = ("required", topo.required) if topo.required else ("preferred", topo.preferred)
    request: dict[str, str | int] = {kind: str(level), "podIndexLabel": labels.NODE_RANK}
    if topo.slice_size:
        request.update(podSetSliceRequiredTopology=str(level), podSetSliceSize=topo.slice_size)
    return request


def build_workload(job: JobRef, spec: PretrainJobSpec, q: Queueing,
                   settings: OperatorSettings) -> Workload:
    """The job's Workload: a pod set of its workers and one of its spare nodes, each with the
    template the operator gives those pods, in the job's LocalQueue, at its priority."""
    worker = builders.build_worker_pod(job, spec, 0, 0, settings)
    pod_sets = [_pod_set(WORKERS, spec.nodes, worker)]
    request = topology_request(spec)
    if request is not None:
        pod_sets[0]["topologyRequest"] = request
    if spec.fault_tolerance.spare_nodes:
        pod_sets.append(_pod_set(SPARES, spec.fault_tolerance.spare_nodes, worker))
    body: WorkloadSpec = {"queueName": q.queue, "podSets": pod_sets}
    if q.priority_class is not None and q.priority is not None:
        body["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass",
                                    "name": q.priority_class}
        body["priority"] = q.priority
    return {
        "apiVersion": WORKLOAD_API,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job),
            "namespace": job.namespace,
            "labels": {labels.JOB: job.name, JOB_UID_LABEL: job.uid},
            "ownerReferences": [builders.owner_reference(job)],
        },
        "spec": body,
    }


def _pod_set(name: str, count: int, pod: Mapping[str, Any]) -> dict[str, Any]:
    """A pod set whose template carries what Kueue counts and matches flavors by: the
    containers' resources (init containers' too: a sidecar's requests add up), the node
    selector, tolerations and affinity. Only labels and annotations may be in its metadata."""
    spec = pod["spec"]

    def container(c: Mapping[str, Any]) -> dict[str, Any]:
        kept = {"name": c["name"], "image": c.get("image", ""),
                "resources": c.get("resources") or {}}
        if c.get("restartPolicy"):
            kept["restartPolicy"] = c["restartPolicy"]
        return kept

    template: dict[str, Any] = {"containers": [container(c) for c in spec["containers"]]}
    if spec.get("initContainers"):
        template["initContainers"] = [container(c) for c in spec["initContainers"]]
    for key in ("nodeSelector", "tolerations", "affinity"):
        if spec.get(key):
            template[key] = spec[key]
    meta_labels = {labels.JOB: pod["metadata"]["labels"][labels.JOB]}
    return {"name": name, "count": count,
            "template": {"metadata": {"labels": meta_labels}, "spec": template}}


def released_conditions(q: Queueing) -> list[dict[str, str]]:
    """After an eviction, with the pods gone: quota no longer reserved, requeued when Kueue
    preempted it (or its nodes failed), as Kueue's jobframework writes them."""
    w = q.workload
    assert w is not None
    evicted = w.conditions.get("Evicted") or WorkloadCondition("True")
    requeue = evicted.reason in ("Preempted", "NodeFailures")
    return [
        {"type": "QuotaReserved", "status": "False", "reason": "Pending",
         "message": f"the PretrainJob's pods stopped after the eviction ({evicted.reason})"},
        {"type": "Admitted", "status": "False", "reason": "NoReservation",
         "message": "the workload has no reservation"},
        {"type": "Requeued", "status": "True" if requeue else "False",
         "reason": evicted.reason or "Evicted", "message": evicted.message or "evicted"},
    ]


def finished_conditions(phase: str, message: str) -> list[dict[str, str]]:
    return [{"type": "Finished", "status": "True",
             "reason": "Succeeded" if phase == "Succeeded" else "Failed",
             "message": message or f"the PretrainJob {phase.lower()}"}]


# --- parsing what the API server returned ---------------------------------------------------


def parse_workload(raw: Mapping[str, Any]) -> ObservedWorkload:
    status = raw.get("status") or {}
    conditions = {
        str(c.get("type")): WorkloadCondition(str(c.get("status")), str(c.get("reason") or ""),
                                              str(c.get("message") or ""))
        for c in status.get("conditions") or []
    }
    admission = status.get("admission") or {}
    flavors = {
        str(a.get("name")): tuple(sorted({str(v) for v in (a.get("flavors") or {}).values()}))
        for a in admission.get("podSetAssignments") or []
    }
    topology = any(a.get("name") == WORKERS and a.get("topologyAssignment")
                   for a in admission.get("podSetAssignments") or [])
    active = (raw.get("spec") or {}).get("active") is not False  # the CRD defaults it true
    return ObservedWorkload(str((raw.get("metadata") or {}).get("name")), conditions,
                            admission.get("clusterQueue"), flavors, topology, active)


def parse_flavor(raw: Mapping[str, Any]) -> Flavor:
    spec = raw.get("spec") or {}
    return Flavor(str((raw.get("metadata") or {}).get("name")),
                  {str(k): str(v) for k, v in (spec.get("nodeLabels") or {}).items()},
                  tuple(spec.get("tolerations") or ()))
