"""The one module that talks to the API server: read what a job owns, execute a Decision.

Everything else in the operator is pure; this is its I/O seam. Reads return the raw camelCase
payloads (`_preload_content=False` + JSON), exactly what `observe.observe` parses and what
kopf would hand over, so there is one representation of a Kubernetes object in the operator.

`Kube.execute` runs a Decision's actions in order and stops at the first failure (the next pass
decides again from what it then observes):
- CreateObject: create; AlreadyExists is fine (deterministic names make a replayed pass a
  no-op), or, with `replace`, the existing object is replaced (ConfigMap, Role of a new attempt);
  a refusal no retry can fix (`permanent`: 400/403/422) raises `Rejected`, which ends the job
  (an RBAC 403 only once it has lasted `FORBIDDEN_RETRIES` retries);
- DeletePod: delete (grace None: the pod's own grace period; 0: force); NotFound is fine;
- PatchPod: merge patch of a pod's labels and annotations (an in-place restart's kept pods);
- PatchLease: merge patch of a worker Lease's annotations (a checkpoint asked for); NotFound is
  fine;
- DeleteObject("Lease" | "PodDisruptionBudget"): delete; NotFound is fine;
- PatchStatus: JSON merge patch of the status subresource carrying the resourceVersion read, so
  a stale pass loses with 409 (`Conflict`: the caller simply runs the next pass);
- PatchState: merge patch of the `hlat.dev/operator-state` annotation;
- EmitEvent: a core/v1 Event on the PretrainJob (failures to emit are logged, not fatal);
- DeleteJob: delete the PretrainJob (background propagation).
Every API error is wrapped once in `K8sError` (cause chained) naming the action and object.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from functools import partial
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from hlat_api import labels
from hlat_api.manifest import API_GROUP, API_VERSION, KIND
from hlat_operator import queueing
from hlat_operator.builders import JobRef
from hlat_operator.nodewatch import NodeWatch
from hlat_operator.observe import node_ready
from hlat_operator.reconcile import (
    Action,
    CreateObject,
    Decision,
    DeleteJob,
    DeleteObject,
    DeletePod,
    EmitEvent,
    PatchLease,
    PatchPod,
    PatchState,
    PatchStatus,
    SetWorkloadActive,
    WriteWorkloadStatus,
)

PLURAL = "pretrainjobs"
COMPONENT = labels.OPERATOR_NAME
log = logging.getLogger(__name__)

Raw = dict[str, Any]
Items = list[Mapping[str, Any]]


class K8sError(RuntimeError):
    """An API call failed; the message names what was attempted. `status` is the HTTP code
    (None for a connection error)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Conflict(K8sError):
    """409 on an update carrying a resourceVersion: our view was stale; decide again."""


class NotFound(K8sError):
    """404: the object is gone."""


_PERMANENT = {400, 403, 422}
_QUOTA_HINTS = ("exceeded quota", "is being terminated")
_RBAC_REFUSAL = re.compile(r"cannot \w+ resource")
FORBIDDEN_RETRIES = 3
"""An RBAC refusal of a create is tried again this many times, `FORBIDDEN_RETRY_SECONDS` apart,
before it rejects the job: an API server that has just restarted refuses a request or two
before its authorizer has loaded the Roles (seen on the rig as one 403 among thousands of
requests across a restart), which must not fail a job. A Pod Security refusal is not retried."""
FORBIDDEN_RETRY_SECONDS = 1.0


def permanent(err: K8sError, kind: str | None = None) -> bool:
    """Whether creating an object failed in a way no retry can fix: invalid (400, 422) or
    forbidden by policy (403: RBAC, Pod Security admission). A 403 for an exhausted
    ResourceQuota is not: quota frees up when other work ends. A 404 on creating a kind whose
    API is not installed (Volcano's PodGroup without Volcano) is permanent too."""
    if err.status == 404:
        return kind in _CUSTOM_KINDS
    if err.status not in _PERMANENT:
        return False
    return not any(hint in str(err) for hint in _QUOTA_HINTS)


class Rejected(K8sError):
    """The API server refused to create an object the job needs, for good (see `permanent`)."""


def _describe(action: Action) -> str:
    """One action, short, for the debug log (the objects' kinds and names, not their bodies)."""
    if isinstance(action, CreateObject):
        meta = action.obj.get("metadata") or {}
        return f"create {action.obj.get('kind')} {meta.get('name')}"
    if isinstance(action, PatchStatus):
        status = action.status
        return (f"patch status (phase {status.get('phase')}, attempt {status.get('attempt')}, "
                f"at version {action.resource_version})")
    if isinstance(action, PatchState):
        return f"patch state {action.annotation}"
    if isinstance(action, EmitEvent):
        return f"event {action.reason}: {action.message}"
    return repr(action)


def _wrap(what: str, err: Exception) -> K8sError:
    if isinstance(err, ApiException):
        status = int(err.status) if err.status else None
        reason = err.reason or ""
        detail = ""
        try:
            body = json.loads(err.body or "{}")
            detail = str(body.get("message", ""))
        except (TypeError, ValueError):
            detail = str(err.body or "")[:200]
        message = f"{what}: HTTP {status} {reason}: {detail}".rstrip(": ")
        cls = Conflict if status == 409 else NotFound if status == 404 else K8sError
        return cls(message, status)
    return K8sError(f"{what}: {type(err).__name__}: {err}")


_API_ERRORS = (ApiException, HTTPError, OSError)

_CUSTOM_KINDS = {"PodGroup": "podgroups", "Workload": "workloads"}
"""Custom resources the operator creates (Volcano's, Kueue's), by plural: a 404 on creating one
means that API is not installed."""

_NOT_INSTALLED = {
    "PodGroup": "Volcano's PodGroup API (scheduling.volcano.sh/v1beta1) is not served: install "
                "Volcano, or unset spec.scheduling.schedulerName (volcano)",
    "Workload": "Kueue's Workload API (kueue.x-k8s.io/v1beta2) is not served: install Kueue "
                "v0.17 or later (docs/operator.md, Kueue), or remove the job's label "
                "kueue.x-k8s.io/queue-name",
}
"""What a 404 on creating a custom kind means, and the two ways out."""

FLAVOR_CACHE_SECONDS = 30.0
"""How long a ResourceFlavor read is kept: flavors change only by an administrator's edit, and
every pass of every admitted job read each of its flavors again (500 jobs, a pass every few
seconds). An edit reaches the pods created after it, within this bound."""

_RBAC_HINT = ("RBAC does not let the operator's service account do this: its role comes with the "
              "chart (charts/hlat/templates/rbac.yaml, which grants every kind the operator "
              "creates, Kueue's Workloads and Volcano's PodGroups included); `helm upgrade` the "
              "release to this operator's chart, or add the permission to the role you manage")
"""What an RBAC refusal that outlasted the retries means, and the way out."""

_KINDS: dict[str, tuple[str, str, bool]] = {
    "Pod": ("core", "pod", False),
    "Service": ("core", "service", True),
    "ConfigMap": ("core", "config_map", True),
    "ServiceAccount": ("core", "service_account", False),
    "Role": ("rbac", "role", True),
    "RoleBinding": ("rbac", "role_binding", True),
    "Lease": ("coordination", "lease", True),
    "PodDisruptionBudget": ("policy", "pod_disruption_budget", False),
    "Job": ("batch", "job", False),
}
"""The kinds the operator creates: which client (a `Kube` attribute), the method suffix
(`create_namespaced_<suffix>`, `replace_namespaced_<suffix>`), and whether it may replace one
that exists."""


REBASE_ATTEMPTS = 5


def unchanged_for_decision(read: Mapping[str, Any], fresh: Mapping[str, Any],
                           written_state: str | None) -> bool:
    """Whether `fresh` differs from the `read` a decision was made on only where the decision
    does not look: same spec and generation, same status, not being deleted, and the state
    annotation as read (or as this pass wrote it)."""
    old, new = read.get("metadata") or {}, fresh.get("metadata") or {}
    if new.get("deletionTimestamp") or old.get("generation") != new.get("generation"):
        return False
    if read.get("spec") != fresh.get("spec") or read.get("status") != fresh.get("status"):
        return False
    want = written_state if written_state is not None else (
        (old.get("annotations") or {}).get(labels.STATE_ANNOTATION))
    return (new.get("annotations") or {}).get(labels.STATE_ANNOTATION) == want


def _json(response: Any) -> Raw:
    data: Raw = json.loads(response.data)
    return data


def _discard(response: Any) -> None:
    """Read the rest of a response the operator does not need and give its connection back to
    the pool. A response left unread keeps its connection out of the pool for good, so every
    later request opened a new TLS connection: at 200 jobs 15% of the operator's CPU went to
    handshakes (and the API server's share beside it)."""
    response.drain_conn()
    response.release_conn()


class Kube:
    """API access for the operator, with one ApiClient (thread-safe for our use: one pass at
    a time per job, passes of different jobs may run concurrently in threads)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.coordination = client.CoordinationV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.policy = client.PolicyV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.sleep: Callable[[float], None] = time.sleep
        self.clock: Callable[[], float] = time.monotonic
        self._flavors: dict[str, tuple[float, Raw | None]] = {}  # name: (read at, flavor)
        self.node_watch: NodeWatch | None = None
        """Every node, kept current by a watch (`start_node_watch`); None: each pass lists."""

    def start_node_watch(self) -> NodeWatch:
        self.node_watch = NodeWatch(self.core).start()
        return self.node_watch

    # --- reads -----------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> Raw | None:
        """The PretrainJob as stored now; None when it is gone."""
        try:
            return _json(
                self.custom.get_namespaced_custom_object(
                    API_GROUP, API_VERSION, namespace, PLURAL, name, _preload_content=False
                )
            )
        except _API_ERRORS as err:
            wrapped = _wrap(f"get {KIND} {namespace}/{name}", err)
            if isinstance(wrapped, NotFound):
                return None
            raise wrapped from err

    def list_jobs(self, namespace: str | None) -> Items:
        try:
            if namespace:
                resp = self.custom.list_namespaced_custom_object(
                    API_GROUP, API_VERSION, namespace, PLURAL, _preload_content=False
                )
            else:
                resp = self.custom.list_cluster_custom_object(
                    API_GROUP, API_VERSION, PLURAL, _preload_content=False
                )
        except _API_ERRORS as err:
            raise _wrap(f"list {PLURAL}", err) from err
        items: Items = _json(resp).get("items") or []
        return items

    def _get_custom(self, plural: str, name: str, namespace: str | None = None) -> Raw | None:
        """A Kueue object as stored; None when it (or Kueue's API) is not there."""
        where = f"{namespace}/{name}" if namespace else name
        try:
            if namespace:
                resp = self.custom.get_namespaced_custom_object(
                    queueing.GROUP, queueing.VERSION, namespace, plural, name,
                    _preload_content=False)
            else:
                resp = self.custom.get_cluster_custom_object(
                    queueing.GROUP, queueing.VERSION, plural, name, _preload_content=False)
            return _json(resp)
        except _API_ERRORS as err:
            wrapped = _wrap(f"get {plural} {where}", err)
            if isinstance(wrapped, NotFound):
                return None
            raise wrapped from err

    def queueing(self, job: JobRef, job_labels: Mapping[str, str]) -> queueing.Queueing | None:
        """A job in a Kueue queue (the queue-name label): its Workload, the flavors its
        admission names, and (until the Workload exists) its priority class's value."""
        queue = job_labels.get(queueing.QUEUE_LABEL)
        if not queue:
            return None
        raw = self._get_custom("workloads", queueing.workload_name(job), job.namespace)
        workload = queueing.parse_workload(raw) if raw is not None else None
        priority_class = job_labels.get(queueing.PRIORITY_LABEL) or None
        priority = None
        if workload is None and priority_class:
            found = self._get_custom("workloadpriorityclasses", priority_class)
            priority = int(found.get("value") or 0) if found is not None else None
        flavors = {}
        if workload is not None:
            for name in sorted({f for names in workload.flavors.values() for f in names}):
                flavor = self._flavor(name)
                if flavor is not None:
                    flavors[name] = queueing.parse_flavor(flavor)
        return queueing.Queueing(queue, priority_class, priority, workload, flavors)

    def _flavor(self, name: str) -> Raw | None:
        """A ResourceFlavor, read at most once per FLAVOR_CACHE_SECONDS (None: not found)."""
        now, kept = self.clock(), self._flavors.get(name)
        if kept is not None and now - kept[0] < FLAVOR_CACHE_SECONDS:
            return kept[1]
        flavor = self._get_custom("resourceflavors", name)
        self._flavors[name] = (now, flavor)
        return flavor

    def job_pods(self, namespace: str, job: str, evaluations: bool = False) -> Items:
        """The job's worker pods; with `evaluations`, its evaluation Jobs' pods too, in the
        same list call (tell them apart by their component label)."""
        components = (labels.WORKER, labels.EVALUATION) if evaluations else (labels.WORKER,)
        selector = f"{labels.JOB}={job},{labels.COMPONENT} in ({','.join(components)})"
        try:
            resp = self.core.list_namespaced_pod(
                namespace, label_selector=selector, _preload_content=False
            )
        except _API_ERRORS as err:
            raise _wrap(f"list pods of {namespace}/{job}", err) from err
        items: Items = _json(resp).get("items") or []
        return items

    def evaluation_jobs(self, namespace: str, job: str) -> Items:
        """The job's evaluation Jobs (spec.evaluation); their pods come with `job_pods`."""
        selector = f"{labels.JOB}={job},{labels.COMPONENT}={labels.EVALUATION}"
        try:
            jobs = self.batch.list_namespaced_job(
                namespace, label_selector=selector, _preload_content=False)
        except _API_ERRORS as err:
            raise _wrap(f"list evaluation jobs of {namespace}/{job}", err) from err
        items: Items = _json(jobs).get("items") or []
        return items

    def job_leases(self, namespace: str, job: str) -> Items:
        try:
            resp = self.coordination.list_namespaced_lease(
                namespace, label_selector=f"{labels.JOB}={job}", _preload_content=False
            )
        except _API_ERRORS as err:
            raise _wrap(f"list leases of {namespace}/{job}", err) from err
        items: Items = _json(resp).get("items") or []
        return items

    def nodes(self, wanted: Iterable[str] = ()) -> Items | None:
        """All nodes; None when they cannot be read (then no node counts as lost). The node
        watch's view when it is in sync and every `wanted` node (those the pass's pods sit on)
        is on it and Ready; otherwise a fresh list: no watch, a broken one, or a node it lacks
        or shows not Ready (just joined, or the watch behind a recovery) is judged only on
        what the API server says now."""
        if self.node_watch is not None:
            items = self.node_watch.snapshot()
            if items is not None:
                ready = {(n.get("metadata") or {}).get("name") for n in items if node_ready(n)}
                if all(w in ready for w in wanted):
                    return items
        try:
            resp = self.core.list_node(_preload_content=False)
        except _API_ERRORS as err:
            log.warning("%s", _wrap("list nodes", err))
            return None
        listed: Items = _json(resp).get("items") or []
        return listed

    # --- executing a decision ----------------------------------------------------------------
    def execute(self, job: JobRef, decision: Decision, read: Raw | None = None) -> int:
        """Run the actions in order; raise at the first failure. Returns how many ran.
        `read`: the job as the pass read it, to rebase a conditional write that lost to a
        change the decision does not depend on (see `_conditional`)."""
        expected = next(
            (a.resource_version for a in decision.actions if isinstance(a, PatchStatus)), None
        )
        written: str | None = None
        done = 0
        for action in decision.actions:
            if log.isEnabledFor(logging.DEBUG):  # not formatted on every pass otherwise
                log.debug("%s/%s: %s", job.namespace, job.name, _describe(action))
            if isinstance(action, PatchState):
                # the annotation patch bumps the resourceVersion the status patch carries:
                # it is made with the version read (a stale pass loses here) and the status
                # patch then carries the version it returned
                annotation = action.annotation
                expected = self._conditional(
                    job, partial(self._patch_state, job, annotation), expected, read, written)
                written = annotation
            elif isinstance(action, PatchStatus):
                if action.resource_version and expected:
                    status = action.status
                    self._conditional(
                        job, partial(self._patch_status_at, job, status), expected, read,
                        written)
                else:
                    self._patch_status(job, action)
            else:
                self.run(job, action)
            done += 1
        return done

    def _conditional(self, job: JobRef, write: Callable[[str | None], str | None],
                     version: str | None, read: Raw | None, written: str | None) -> str | None:
        """`write(version)`; on 409, when the job changed only where the decision does not
        look (another client's label or annotation: see `unchanged_for_decision`), again with
        the new version, up to REBASE_ATTEMPTS times. Without this a client that touches the
        job's metadata faster than a pass takes (one read of the job, pods, leases, nodes,
        then the write) starves every status write for as long as it keeps at it."""
        for attempt in range(1, REBASE_ATTEMPTS + 1):
            try:
                return write(version)
            except Conflict:
                if read is None or attempt == REBASE_ATTEMPTS or not version:
                    raise
                fresh = self.get_job(job.namespace, job.name)
                if fresh is None or not unchanged_for_decision(read, fresh, written):
                    raise
                version = str((fresh.get("metadata") or {}).get("resourceVersion") or "")
                log.debug("%s/%s: rebased a write on version %s", job.namespace, job.name,
                          version)
        return None  # pragma: no cover - the loop returns or raises

    def run(self, job: JobRef, action: Action) -> None:
        if isinstance(action, CreateObject) and action.refused is not None:
            try:  # an object the job can do without: a failure is told, never fatal
                self._create(job, action)
            except K8sError as err:
                log.warning("%s/%s: %s", job.namespace, job.name, err)
                self.emit_event(job, "Warning", action.refused, str(err))
        elif isinstance(action, CreateObject):
            self._create(job, action)
        elif isinstance(action, DeletePod):
            self._delete_pod(job, action)
        elif isinstance(action, PatchPod):
            self._patch_pod(job, action)
        elif isinstance(action, PatchLease):
            self._patch_lease(job, action)
        elif isinstance(action, DeleteObject) and action.kind == "PodDisruptionBudget":
            self._delete_budget(job, action.name)
        elif isinstance(action, DeleteObject):
            self._delete_lease(job, action.name)
        elif isinstance(action, PatchStatus):
            self._patch_status(job, action)
        elif isinstance(action, PatchState):
            self._patch_state(job, action.annotation)
        elif isinstance(action, EmitEvent):
            self.emit_event(job, action.type, action.reason, action.message)
        elif isinstance(action, DeleteJob):
            self._delete_job(job)
        elif isinstance(action, WriteWorkloadStatus):
            self._write_workload_status(job, action)
        elif isinstance(action, SetWorkloadActive):
            self._set_workload_active(job, action.active)
        else:  # pragma: no cover - exhaustive over Action
            raise TypeError(f"unknown action {action!r}")

    def _create(self, job: JobRef, action: CreateObject) -> None:
        obj: Mapping[str, Any] = action.obj
        kind, name = str(obj["kind"]), str(obj["metadata"]["name"])
        what = f"create {kind} {job.namespace}/{name}"
        # an object the job can do without is not worth holding the pass: its next pass tries
        # again, and its refusal is told (CreateObject.refused)
        retries = 0 if action.refused is not None else FORBIDDEN_RETRIES
        for retry in range(retries + 1):
            try:
                self._create_call(kind, job.namespace, obj)
                log.debug("%s", what)
                return
            except _API_ERRORS as err:
                wrapped = _wrap(what, err)
                if (permanent(wrapped, kind) and retry < retries
                        and _RBAC_REFUSAL.search(str(wrapped))):
                    log.warning("%s refused (%s): trying again in %.0fs", what, wrapped,
                                FORBIDDEN_RETRY_SECONDS)
                    self.sleep(FORBIDDEN_RETRY_SECONDS)
                    continue
                if permanent(wrapped, kind):
                    hint = (_NOT_INSTALLED.get(kind) if wrapped.status == 404
                            else _RBAC_HINT if _RBAC_REFUSAL.search(str(wrapped)) else None)
                    raise Rejected(f"{wrapped}: {hint}" if hint else str(wrapped),
                                   wrapped.status) from err
                if wrapped.status != 409:
                    raise wrapped from err
                break
        if not action.replace:
            return
        what = f"replace {kind} {job.namespace}/{name}"
        try:
            self._replace_call(kind, job.namespace, name, obj)
        except _API_ERRORS as err:
            raise _wrap(what, err) from err

    def _create_call(self, kind: str, ns: str, obj: Mapping[str, Any]) -> None:
        body: Any = obj
        if kind in _CUSTOM_KINDS:  # Volcano's, Kueue's: through the custom objects API
            group, version = str(obj["apiVersion"]).split("/")
            _discard(self.custom.create_namespaced_custom_object(
                group, version, ns, _CUSTOM_KINDS[kind], body, _preload_content=False))
            return
        if kind not in _KINDS:
            raise K8sError(f"create {kind}: kind not supported by the operator")
        api, suffix, _ = _KINDS[kind]
        _discard(getattr(getattr(self, api), f"create_namespaced_{suffix}")(
            ns, body, _preload_content=False))

    def _replace_call(self, kind: str, ns: str, name: str, obj: Mapping[str, Any]) -> None:
        body: Any = obj
        if kind == "PodGroup":  # Volcano writes its status: merge-patch the spec alone
            group, version = str(obj["apiVersion"]).split("/")
            _discard(self.custom.patch_namespaced_custom_object(
                group, version, ns, _CUSTOM_KINDS[kind], name, {"spec": obj["spec"]},
                _preload_content=False))
            return
        if kind not in _KINDS or not _KINDS[kind][2]:
            raise K8sError(f"replace {kind}: kind not supported by the operator")
        api, suffix, _ = _KINDS[kind]
        # a Lease may not be updated without the resourceVersion it was read at: merge-patch
        # the fields instead (the operator owns every field it writes there)
        verb = "patch" if kind == "Lease" else "replace"
        _discard(getattr(getattr(self, api), f"{verb}_namespaced_{suffix}")(
            name, ns, body, _preload_content=False))

    def _set_workload_active(self, job: JobRef, active: bool) -> None:
        """Merge-patch the Workload's spec.active; a Workload that is gone needs nothing."""
        name = queueing.workload_name(job)
        try:
            _discard(self.custom.patch_namespaced_custom_object(
                queueing.GROUP, queueing.VERSION, job.namespace, "workloads", name,
                {"spec": {"active": active}}, _preload_content=False))
        except _API_ERRORS as err:
            wrapped = _wrap(f"set spec.active={str(active).lower()} on Workload "
                            f"{job.namespace}/{name}", err)
            if not isinstance(wrapped, NotFound):
                raise wrapped from err

    def _write_workload_status(self, job: JobRef, action: WriteWorkloadStatus) -> None:
        """Set the action's conditions on the job's Workload (a condition's transition time
        moves only when its status does), clearing its admission if asked, as one update at
        the version read: a 409 (Kueue wrote meanwhile) is a Conflict, and the pass reruns."""
        name = queueing.workload_name(job)
        what = f"update status of Workload {job.namespace}/{name}"
        raw = self._get_custom("workloads", name, job.namespace)
        if raw is None:
            return  # gone (the job is being deleted): nothing to release
        status = dict(raw.get("status") or {})
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        generation = (raw.get("metadata") or {}).get("generation")
        conditions = [dict(c) for c in status.get("conditions") or []]
        for new in action.conditions:
            old = next((c for c in conditions if c.get("type") == new["type"]), None)
            moved = old is None or old.get("status") != new["status"]
            merged = {**new, "lastTransitionTime": now if moved or old is None
                      else old.get("lastTransitionTime", now)}
            if generation is not None:
                merged["observedGeneration"] = generation
            if old is None:
                conditions.append(merged)
            else:
                conditions[conditions.index(old)] = merged
        status["conditions"] = conditions
        if action.clear_admission:
            status.pop("admission", None)
        body = {"apiVersion": raw.get("apiVersion"), "kind": raw.get("kind"),
                "metadata": raw.get("metadata"), "status": status}
        try:
            _discard(self.custom.replace_namespaced_custom_object_status(
                queueing.GROUP, queueing.VERSION, job.namespace, "workloads", name, body,
                _preload_content=False))
        except _API_ERRORS as err:
            raise _wrap(what, err) from err

    def _delete_pod(self, job: JobRef, action: DeletePod) -> None:
        what = f"delete pod {job.namespace}/{action.name}"
        if action.grace_seconds is not None:
            what += f" (grace {action.grace_seconds}s)"
        try:
            _discard(self.core.delete_namespaced_pod(
                action.name,
                job.namespace,
                grace_period_seconds=action.grace_seconds,
                _preload_content=False,
            ))
        except _API_ERRORS as err:
            wrapped = _wrap(what, err)
            if not isinstance(wrapped, NotFound):
                raise wrapped from err

    def _patch_pod(self, job: JobRef, action: PatchPod) -> None:
        body = {"metadata": {"labels": action.labels, "annotations": action.annotations}}
        try:
            _discard(self.core.patch_namespaced_pod(action.name, job.namespace, body,
                                                    _preload_content=False))
        except _API_ERRORS as err:
            raise _wrap(f"patch pod {job.namespace}/{action.name}", err) from err

    def _patch_lease(self, job: JobRef, action: PatchLease) -> None:
        """Merge-patch the annotations alone: the worker's heartbeat owns the rest (a patch
        that changes nothing is not a write: no watch event, no new resourceVersion)."""
        body = {"metadata": {"annotations": action.annotations}}
        try:
            _discard(self.coordination.patch_namespaced_lease(action.name, job.namespace, body,
                                                              _preload_content=False))
        except _API_ERRORS as err:
            wrapped = _wrap(f"patch lease {job.namespace}/{action.name}", err)
            if not isinstance(wrapped, NotFound):
                raise wrapped from err

    def _delete_lease(self, job: JobRef, name: str) -> None:
        try:
            _discard(self.coordination.delete_namespaced_lease(
                name, job.namespace, _preload_content=False
            ))
        except _API_ERRORS as err:
            wrapped = _wrap(f"delete lease {job.namespace}/{name}", err)
            if not isinstance(wrapped, NotFound):
                raise wrapped from err

    def _delete_budget(self, job: JobRef, name: str) -> None:
        try:
            _discard(self.policy.delete_namespaced_pod_disruption_budget(
                name, job.namespace, _preload_content=False))
        except _API_ERRORS as err:
            wrapped = _wrap(f"delete poddisruptionbudget {job.namespace}/{name}", err)
            if not isinstance(wrapped, NotFound):
                raise wrapped from err

    def _patch_status(self, job: JobRef, action: PatchStatus) -> None:
        body: Raw = {"status": action.status}
        if action.resource_version:
            body["metadata"] = {"resourceVersion": action.resource_version}
        try:
            _discard(self.custom.patch_namespaced_custom_object_status(
                API_GROUP,
                API_VERSION,
                job.namespace,
                PLURAL,
                job.name,
                body,
                _preload_content=False,
            ))
        except _API_ERRORS as err:
            raise _wrap(f"patch status of {KIND} {job.namespace}/{job.name}", err) from err

    def _patch_status_at(self, job: JobRef, status: Raw, version: str | None) -> None:
        self._patch_status(job, PatchStatus(status, version))

    def _patch_state(
        self, job: JobRef, annotation: str, resource_version: str | None = None
    ) -> str | None:
        """Merge-patch the state annotation; returns the job's new resourceVersion."""
        meta: Raw = {"annotations": {labels.STATE_ANNOTATION: annotation}}
        if resource_version:
            meta["resourceVersion"] = resource_version
        try:
            resp = self.custom.patch_namespaced_custom_object(
                API_GROUP, API_VERSION, job.namespace, PLURAL, job.name, {"metadata": meta},
                _preload_content=False,
            )
        except _API_ERRORS as err:
            raise _wrap(f"patch state of {KIND} {job.namespace}/{job.name}", err) from err
        version = (_json(resp).get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None

    def _delete_job(self, job: JobRef) -> None:
        try:
            _discard(self.custom.delete_namespaced_custom_object(
                API_GROUP, API_VERSION, job.namespace, PLURAL, job.name,
                propagation_policy="Background", _preload_content=False,
            ))
        except _API_ERRORS as err:
            wrapped = _wrap(f"delete {KIND} {job.namespace}/{job.name}", err)
            if not isinstance(wrapped, NotFound):
                raise wrapped from err

    def emit_event(self, job: JobRef, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the PretrainJob; a failure is logged, never fatal."""
        now = datetime.now(UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        body: Any = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{job.name}.{uuid.uuid4().hex[:12]}", "namespace": job.namespace},
            "involvedObject": {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": job.name,
                "namespace": job.namespace,
                "uid": job.uid,
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            _discard(self.core.create_namespaced_event(job.namespace, body,
                                                       _preload_content=False))
        except _API_ERRORS as err:
            log.warning("%s", _wrap(f"emit event {reason} on {job.namespace}/{job.name}", err))
