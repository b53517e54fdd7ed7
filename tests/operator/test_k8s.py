"""`hlat_operator.k8s` and `handlers.reconcile_once` without a cluster: what each API answer
(409, 404, 403, 422, 5xx, a dropped connection) makes the operator do.

The Kubernetes client classes are replaced by a recorder that answers as the API server would
for the calls a test scripts (the cluster tests run the same code against the real one): these
tests pin the error handling, which a healthy cluster rarely exercises.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from opfakes import JOB, SETTINGS, raw_spec
from urllib3.exceptions import ProtocolError

from hlat_api.status import PretrainJobStatus
from hlat_operator import handlers, k8s
from hlat_operator.k8s import REBASE_ATTEMPTS, Conflict, K8sError, Kube, NotFound, Rejected
from hlat_operator.metrics import OperatorMetrics
from hlat_operator.nodewatch import NodeWatch
from hlat_operator.reconcile import (
    CreateObject,
    Decision,
    DeletePod,
    EmitEvent,
    PatchPod,
    PatchState,
    PatchStatus,
)


@dataclass
class Response:
    """What the client returns with `_preload_content=False` (urllib3's response), as used."""

    data: bytes
    released: bool = False

    def drain_conn(self) -> None:
        pass

    def release_conn(self) -> None:
        self.released = True


def api_error(status: int, message: str = "") -> ApiException:
    err = ApiException(status=status, reason={404: "Not Found", 409: "Conflict",
                                              403: "Forbidden", 422: "Unprocessable Entity",
                                              500: "Internal Server Error"}.get(status, ""))
    err.body = json.dumps({"message": message})
    return err


@dataclass
class Recorder:
    """Stands for one of the client's API classes: every call is recorded; `answers` maps a
    method name to what it returns or raises (a list: one per call, in order)."""

    answers: dict[str, Any] = field(default_factory=dict)
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("__"):
            raise AttributeError(method)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((method, args, kwargs))
            answer = self.answers.get(method, Response(b"{}"))
            if isinstance(answer, list):
                answer = answer.pop(0) if answer else Response(b"{}")
            if isinstance(answer, BaseException):
                raise answer
            return answer

        return call

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def kube(**answers: dict[str, Any]) -> Kube:
    k = Kube(client.ApiClient())
    k.core, k.custom = Recorder(answers.get("core", {})), Recorder(answers.get("custom", {}))  # type: ignore[assignment]
    k.coordination = Recorder(answers.get("coordination", {}))  # type: ignore[assignment]
    k.rbac = Recorder(answers.get("rbac", {}))  # type: ignore[assignment]
    k.batch = Recorder(answers.get("batch", {}))  # type: ignore[assignment]
    return k


def decision(*actions: Any) -> Decision:
    return Decision(actions=list(actions), requeue_after=None, status=PretrainJobStatus())


POD = {"kind": "Pod", "metadata": {"name": "tiny-a0-0"}}
CONFIG = {"kind": "ConfigMap", "metadata": {"name": "tiny-config"}}


# --- execute ---------------------------------------------------------------------------------


def test_the_status_patch_carries_the_version_the_state_patch_returned() -> None:
    k = kube(custom={"patch_namespaced_custom_object":
                     Response(json.dumps({"metadata": {"resourceVersion": "8"}}).encode())})
    done = k.execute(JOB, decision(PatchState("{}"), PatchStatus({"phase": "Running"}, "7")))
    assert done == 2
    (state_call, status_call) = k.custom.calls  # type: ignore[attr-defined]
    assert state_call[1][-1]["metadata"]["resourceVersion"] == "7"  # the version read
    assert status_call[0] == "patch_namespaced_custom_object_status"
    assert status_call[1][-1]["metadata"]["resourceVersion"] == "8"  # the one it got back


def test_a_stale_view_loses_with_conflict_and_writes_nothing_after() -> None:
    k = kube(custom={"patch_namespaced_custom_object": api_error(409, "the object has been "
                                                                 "modified")})
    with pytest.raises(Conflict, match="HTTP 409"):
        k.execute(JOB, decision(PatchState("{}"), PatchStatus({}, "7"), CreateObject(POD)))
    assert k.custom.names() == ["patch_namespaced_custom_object"]  # type: ignore[attr-defined]
    assert k.core.calls == []  # type: ignore[attr-defined]


READ = {"metadata": {"resourceVersion": "7", "generation": 1,
                     "annotations": {"hlat.dev/operator-state": "{}"}},
        "spec": {"nodes": 2}, "status": {"phase": "Pending"}}


def _stored(version: str, **changes: Any) -> Response:
    body = json.loads(json.dumps(READ))
    body["metadata"]["resourceVersion"] = version
    for key, value in changes.items():
        if key == "labels":
            body["metadata"]["labels"] = value
        elif key == "state":
            body["metadata"]["annotations"]["hlat.dev/operator-state"] = value
        else:
            body[key] = value
    return Response(json.dumps(body).encode())


def _conflict() -> ApiException:
    return api_error(409, "the object has been modified")


def test_a_write_that_lost_to_another_client_s_label_is_made_again_on_the_new_version(
) -> None:
    """Someone else touched only the job's metadata: the decision still holds, so the state
    and status writes are made again on the version they lost to (no whole new pass)."""
    version_9 = Response(json.dumps({"metadata": {"resourceVersion": "9"}}).encode())
    k = kube(custom={
        "patch_namespaced_custom_object": [_conflict(), version_9],
        "patch_namespaced_custom_object_status": [_conflict(), Response(b"{}")],
        "get_namespaced_custom_object": [_stored("8", labels={"team": "a"}),
                                         _stored("10", labels={"team": "b"},
                                                 state='{"new": 1}')]})
    done = k.execute(JOB, decision(PatchState('{"new": 1}'), PatchStatus({"phase": "Running"},
                                                                         "7")), read=READ)
    assert done == 2
    versions = [c[1][-1]["metadata"]["resourceVersion"] for c in k.custom.calls  # type: ignore[attr-defined]
                if c[0].startswith("patch")]
    assert versions == ["7", "8", "9", "10"]


@pytest.mark.parametrize("change", [{"spec": {"nodes": 4}}, {"status": {"phase": "Failed"}},
                                    {"state": '{"other": 1}'}])
def test_a_write_that_lost_to_a_change_the_decision_reads_is_not_made_again(
        change: dict[str, Any]) -> None:
    k = kube(custom={"patch_namespaced_custom_object": [_conflict()],
                     "get_namespaced_custom_object": [_stored("8", **change)]})
    with pytest.raises(Conflict):
        k.execute(JOB, decision(PatchState("{}"), PatchStatus({}, "7")), read=READ)
    assert k.custom.names().count("patch_namespaced_custom_object") == 1  # type: ignore[attr-defined]


def test_rebasing_is_bounded() -> None:
    k = kube(custom={"patch_namespaced_custom_object": [_conflict()] * 10,
                     "get_namespaced_custom_object": [_stored(str(v)) for v in range(8, 18)]})
    with pytest.raises(Conflict):
        k.execute(JOB, decision(PatchState("{}"), PatchStatus({}, "7")), read=READ)
    assert k.custom.names().count("patch_namespaced_custom_object") == REBASE_ATTEMPTS  # type: ignore[attr-defined]


def test_an_object_that_exists_is_left_or_replaced_as_the_action_says() -> None:
    k = kube(core={"create_namespaced_pod": api_error(409, "already exists"),
                   "create_namespaced_config_map": api_error(409, "already exists")})
    k.execute(JOB, decision(CreateObject(POD), CreateObject(CONFIG, replace=True)))
    assert k.core.names() == ["create_namespaced_pod", "create_namespaced_config_map",  # type: ignore[attr-defined]
                              "replace_namespaced_config_map"]


@pytest.mark.parametrize(("status", "message", "kind", "rejected"), [
    (422, "spec.containers[0].image: Required value", "Pod", True),
    (400, "bad request", "Pod", True),
    (403, 'pods "x" is forbidden: violates PodSecurity "baseline:latest"', "Pod", True),
    (403, 'pods "x" is forbidden: exceeded quota: compute', "Pod", False),
    (403, "namespace x is being terminated", "Pod", False),
    (404, "the server could not find the requested resource", "PodGroup", True),
    (404, "namespaces not found", "Pod", False),
    (500, "etcdserver: request timed out", "Pod", False),
])
def test_a_create_refused_for_good_is_rejected_and_a_passing_refusal_retried(
        status: int, message: str, kind: str, rejected: bool) -> None:
    obj = {"kind": kind, "apiVersion": "scheduling.volcano.sh/v1beta1",
           "metadata": {"name": "tiny"}}
    method = ("create_namespaced_custom_object" if kind == "PodGroup"
              else "create_namespaced_pod")
    k = kube(core={method: api_error(status, message)}, custom={method: api_error(status, message)})
    with pytest.raises(K8sError) as err:
        k.execute(JOB, decision(CreateObject(obj)))
    assert isinstance(err.value, Rejected) is rejected
    assert message in str(err.value) and f"create {kind}" in str(err.value)
    if kind == "PodGroup" and status == 404:  # the job's Failed message says what to do
        assert "install Volcano, or unset spec.scheduling.schedulerName" in str(err.value)


@pytest.mark.parametrize("status, message", [
    (422, 'Job.batch "tiny-eval-10" is invalid: spec.template.spec.containers[0].image: '
          "Required value"),
    (403, 'jobs.batch "tiny-eval-10" is forbidden: exceeded quota: compute'),
    (403, 'jobs.batch is forbidden: User "system:serviceaccount:hlat:hlat-operator" cannot '
          'create resource "jobs" in API group "batch" in the namespace "team"'),
    (500, "etcdserver: request timed out"),
])
def test_an_evaluation_job_that_cannot_be_created_is_told_and_the_pass_goes_on(
        status: int, message: str) -> None:
    """An evaluation Job is something the training can do without: whatever stops its
    creation, refused for good or not, is a Warning event on the job, and neither fails the job
    (Rejected) nor stops the pass (the status patch after it is still made)."""
    obj = {"kind": "Job", "apiVersion": "batch/v1", "metadata": {"name": "tiny-eval-10"}}
    k = kube(batch={"create_namespaced_job": api_error(status, message)})
    slept: list[float] = []
    k.sleep = slept.append
    done = k.execute(JOB, decision(CreateObject(obj, refused="EvaluationFailed"),
                                   PatchStatus({"phase": "Running"})))
    assert done == 2 and k.batch.names() == ["create_namespaced_job"]  # type: ignore[attr-defined]
    assert not slept  # not even an RBAC refusal holds the pass: its next pass tries again
    events = [c for c in k.core.calls if c[0] == "create_namespaced_event"]  # type: ignore[attr-defined]
    assert len(events) == 1
    body = events[0][1][1]
    assert body["type"] == "Warning" and body["reason"] == "EvaluationFailed"
    assert message in body["message"] and "create Job" in body["message"]
    k = kube(batch={"create_namespaced_job": api_error(status, message)})
    with pytest.raises(K8sError):  # the same refusal of an object the job needs stops the pass
        k.execute(JOB, decision(CreateObject(obj)))


def test_a_job_in_a_kueue_queue_without_kueue_is_told_to_install_it_or_leave_the_queue() -> None:
    obj = {"kind": "Workload", "apiVersion": "kueue.x-k8s.io/v1beta2",
           "metadata": {"name": "pretrainjob-tiny"}}
    k = kube(custom={"create_namespaced_custom_object": api_error(
        404, "the server could not find the requested resource")})
    with pytest.raises(Rejected) as err:
        k.execute(JOB, decision(CreateObject(obj)))
    assert "create Workload" in str(err.value)
    assert "install Kueue v0.17 or later" in str(err.value)
    assert "remove the job's label kueue.x-k8s.io/queue-name" in str(err.value)


RBAC_REFUSAL = ('pods is forbidden: User "system:serviceaccount:hlat:hlat-operator" cannot '
                'create resource "pods" in API group "" in the namespace "team"')


def test_an_rbac_refusal_that_passes_creates_the_object_and_one_that_lasts_rejects() -> None:
    """Right after a restart the API server may refuse with RBAC's 403 for a moment (its
    authorizer not yet filled): that must not fail the job. A refusal that lasts does, after
    FORBIDDEN_RETRIES retries; a Pod Security refusal at once."""
    slept: list[float] = []
    k = kube(core={"create_namespaced_pod": [api_error(403, RBAC_REFUSAL)]})
    k.sleep = slept.append
    k.execute(JOB, decision(CreateObject(POD)))
    assert k.core.names() == ["create_namespaced_pod"] * 2  # type: ignore[attr-defined]
    assert slept == [k8s.FORBIDDEN_RETRY_SECONDS]

    k = kube(core={"create_namespaced_pod": [api_error(403, RBAC_REFUSAL)] * 10})
    k.sleep = slept.append
    with pytest.raises(Rejected, match="cannot create resource") as lasting:
        k.execute(JOB, decision(CreateObject(POD)))
    assert len(k.core.names()) == k8s.FORBIDDEN_RETRIES + 1  # type: ignore[attr-defined]
    # the job's Failed message says where the permission comes from and what to do
    assert "its role comes with the chart (charts/hlat/templates/rbac.yaml" in str(lasting.value)
    assert "`helm upgrade` the release" in str(lasting.value)

    k = kube(core={"create_namespaced_pod": [api_error(403, "violates PodSecurity")] * 10})
    with pytest.raises(Rejected, match="PodSecurity") as security:
        k.execute(JOB, decision(CreateObject(POD)))
    assert "helm upgrade" not in str(security.value)  # not an RBAC matter
    assert len(k.core.names()) == 1  # type: ignore[attr-defined]


def test_deleting_a_pod_that_is_gone_is_done_and_other_errors_stop_the_pass() -> None:
    k = kube(core={"delete_namespaced_pod": [api_error(404), api_error(500, "boom")]})
    with pytest.raises(K8sError, match=r"HTTP 500.*boom"):
        k.execute(JOB, decision(DeletePod("a"), DeletePod("b", grace_seconds=0), DeletePod("c")))
    calls = k.core.calls  # type: ignore[attr-defined]
    assert [c[1][0] for c in calls] == ["a", "b"]  # c never tried: the next pass decides
    assert calls[1][2]["grace_period_seconds"] == 0


def test_an_event_that_cannot_be_written_does_not_stop_the_pass() -> None:
    k = kube(core={"create_namespaced_event": api_error(403, "events is forbidden")})
    assert k.execute(JOB, decision(EmitEvent("Normal", "Created", "x"), CreateObject(POD))) == 2
    assert k.core.names() == ["create_namespaced_event", "create_namespaced_pod"]  # type: ignore[attr-defined]


def test_a_dropped_connection_is_an_error_without_a_status() -> None:
    k = kube(core={"create_namespaced_pod": ProtocolError("Connection aborted.")})
    with pytest.raises(K8sError) as err:
        k.execute(JOB, decision(CreateObject(POD)))
    assert err.value.status is None and not isinstance(err.value, Rejected)


# --- reads -----------------------------------------------------------------------------------


def test_reads_a_gone_job_as_none_and_unreadable_nodes_as_unknown() -> None:
    k = kube(custom={"get_namespaced_custom_object": api_error(404)},
             core={"list_node": api_error(403, "nodes is forbidden")})
    assert k.get_job("ns", "tiny") is None
    assert k.nodes() is None  # no node counts as lost when nodes cannot be read
    k = kube(custom={"get_namespaced_custom_object": api_error(500)})
    with pytest.raises(K8sError) as err:
        k.get_job("ns", "tiny")
    assert not isinstance(err.value, NotFound)


# --- handlers.reconcile_once -----------------------------------------------------------------


class FakeKube:
    """What reconcile_once needs of `Kube`, with the job stored as the API server would."""

    def __init__(self, fail: list[K8sError]) -> None:
        self.job: dict[str, Any] = {
            "apiVersion": "hlat.dev/v1alpha1", "kind": "PretrainJob",
            "metadata": {"name": JOB.name, "namespace": JOB.namespace, "uid": JOB.uid,
                         "resourceVersion": "1", "generation": 1},
            "spec": raw_spec(),
        }
        self.fail = fail
        self.executed: list[Decision] = []

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.job

    def job_pods(self, namespace: str, job: str, evaluations: bool = False) -> list[Any]:
        return []

    def job_leases(self, namespace: str, job: str) -> list[Any]:
        return []

    def nodes(self, wanted: Any = ()) -> list[Any] | None:
        return []

    def queueing(self, job: Any, job_labels: Any) -> None:
        return None  # in no Kueue queue

    def execute(self, job: Any, d: Decision, read: Any = None) -> int:
        self.executed.append(d)
        if self.fail:
            raise self.fail.pop(0)
        for action in d.actions:
            if isinstance(action, PatchStatus):
                self.job["status"] = action.status
        return len(d.actions)


def runtime(kube: FakeKube) -> handlers.Runtime:
    return handlers.Runtime(SETTINGS, kube, OperatorMetrics())  # type: ignore[arg-type]


def test_a_conflicting_pass_is_decided_again_soon() -> None:
    k = FakeKube([Conflict("patch status: HTTP 409", 409)])
    assert handlers.reconcile_once(runtime(k), JOB.namespace, JOB.name) == (
        SETTINGS.fast_requeue_seconds)
    assert len(k.executed) == 1 and "status" not in k.job


def test_an_object_refused_for_good_fails_the_job_with_the_server_s_message() -> None:
    k = FakeKube([Rejected('create Pod: HTTP 403 Forbidden: violates PodSecurity "baseline"',
                           403)])
    handlers.reconcile_once(runtime(k), JOB.namespace, JOB.name)
    assert len(k.executed) == 2
    status = k.job["status"]
    assert status["phase"] == "Failed"
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "Rejected" and "PodSecurity" in failed["message"]


def test_a_job_deleted_mid_pass_ends_its_loop() -> None:
    k = FakeKube([])
    k.job["metadata"]["deletionTimestamp"] = "2026-11-24T00:00:00Z"
    with pytest.raises(handlers.JobGone):
        handlers.reconcile_once(runtime(k), JOB.namespace, JOB.name)
    assert k.executed == []


@pytest.mark.parametrize(("kind", "api", "create", "replace"), [
    ("Pod", "core", "create_namespaced_pod", None),
    ("Service", "core", "create_namespaced_service", "replace_namespaced_service"),
    ("ConfigMap", "core", "create_namespaced_config_map", "replace_namespaced_config_map"),
    ("ServiceAccount", "core", "create_namespaced_service_account", None),
    ("Role", "rbac", "create_namespaced_role", "replace_namespaced_role"),
    ("RoleBinding", "rbac", "create_namespaced_role_binding", "replace_namespaced_role_binding"),
    # a Lease cannot be updated without its resourceVersion: merge-patched instead
    ("Lease", "coordination", "create_namespaced_lease", "patch_namespaced_lease"),
])
def test_each_kind_is_created_and_replaced_through_its_own_api(
        kind: str, api: str, create: str, replace: str | None) -> None:
    obj = {"kind": kind, "metadata": {"name": "tiny-x"}}
    k = kube(**{api: {create: api_error(409, "already exists")}})
    if replace is None:
        with pytest.raises(K8sError, match=f"replace {kind}: kind not supported"):
            k.execute(JOB, decision(CreateObject(obj, replace=True)))
    else:
        k.execute(JOB, decision(CreateObject(obj, replace=True)))
    recorder: Recorder = getattr(k, api)
    assert recorder.names() == [create] + ([replace] if replace else [])
    if replace:
        assert recorder.calls[1][1][:2] == ("tiny-x", JOB.namespace)


def test_a_kind_the_operator_does_not_make_is_an_error() -> None:
    with pytest.raises(K8sError, match="create Secret: kind not supported"):
        kube().execute(JOB, decision(CreateObject({"kind": "Secret", "metadata": {"name": "s"}})))


def test_a_pass_that_reaches_the_api_server_again_restarts_the_operator_s_clock() -> None:
    """After passes failed to reach the API server, the next one that does notes the moment:
    silence from before it is judged from there (faults.detect_fault, seeing_since)."""
    k = FakeKube([])
    rt = runtime(k)
    rt.api_lost, began = True, datetime.now(UTC)
    handlers.reconcile_once(rt, JOB.namespace, JOB.name)
    assert not rt.api_lost and rt.api_back_at is not None and rt.api_back_at >= began


def _node_list(*names: str, ready: bool = True) -> Response:
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return Response(json.dumps({"items": [{"metadata": {"name": n}, "status": status}
                                          for n in names]}).encode())


def test_passes_read_the_watched_nodes_and_list_only_when_the_view_cannot_be_trusted() -> None:
    """At 500 jobs a list of every node per pass was a third of the operator's work: passes read
    the node watch's view, unless a pass's pods sit on a node the view lacks (just joined: it
    must not be taken for a lost one) or shows not Ready (the watch may be behind a recovery),
    or the watch is not in sync (broken, relisting): then a fresh list decides."""
    k = kube(core={"list_node": [_node_list("a", "b"), _node_list("a", "b", "c"),
                                 _node_list("a", "b"), api_error(500), _node_list("a")]})
    watch = NodeWatch(Recorder({"list_node": _node_list("a", "b", ready=False)}))
    assert watch.snapshot() is None  # not listed yet
    k.node_watch = watch
    watch._list()
    viewed = k.nodes()
    assert _names(viewed) == ["a", "b"] and k.core.names() == []  # type: ignore[attr-defined]
    assert _names(k.nodes(wanted={"a"})) == ["a", "b"]  # "a" not Ready in the view: listed
    assert _names(k.nodes(wanted={"c"})) == ["a", "b", "c"]  # "c" not in the view: listed
    watch._items["a"] = json.loads(_node_list("a").data)["items"][0]  # the watch saw it Ready
    assert k.nodes(wanted={"a"}) == watch.snapshot()
    assert len(k.core.names()) == 2  # type: ignore[attr-defined]
    watch._synced = False  # broken: every pass lists; a failed list is None
    assert _names(k.nodes()) == ["a", "b"]
    assert k.nodes() is None
    k.node_watch = None  # the watch off (HLAT_OPERATOR_WATCH_NODES=false): each pass lists
    assert _names(k.nodes()) == ["a"]
    assert len(k.core.names()) == 5  # type: ignore[attr-defined]


def _names(items: Any) -> list[str]:
    return sorted(n["metadata"]["name"] for n in items or [])


def test_every_write_gives_its_connection_back() -> None:
    """A response the operator does not read kept its connection out of the pool: each later
    request opened a new TLS connection (15% of the operator's CPU at 200 jobs)."""
    answers: list[Response] = []

    def answer() -> Response:
        answers.append(Response(b"{}"))
        return answers[-1]

    k = kube(core={"create_namespaced_pod": [answer()], "delete_namespaced_pod": [answer()],
                   "patch_namespaced_pod": [answer()], "create_namespaced_event": [answer()]},
             custom={"patch_namespaced_custom_object_status": [answer()]})
    k.execute(JOB, decision(CreateObject(POD), PatchPod("tiny-a0-0", {"a": "b"}, {}),
                            DeletePod("tiny-a0-0"), EmitEvent("Normal", "Test", "x"),
                            PatchStatus({"phase": "Running"}, None)))
    assert len(answers) == 5 and all(a.released for a in answers)


# --- waking a job's loop -----------------------------------------------------------------


def _modified(generation: int, deleting: bool = False, type_: str = "MODIFIED") -> Any:
    meta: dict[str, Any] = {"name": JOB.name, "namespace": JOB.namespace,
                            "generation": generation}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-25T00:00:00Z"
    return {"type": type_, "object": {"metadata": meta}}


def test_only_the_echo_of_a_status_refresh_is_let_pass_without_waking_the_job() -> None:
    """At 500 jobs every status refresh's own watch event woke its job for another pass (two
    passes per refresh). A pass that only refreshed the status (same phase, only writes to the
    job and Events) lets its echo pass; a change of phase, any action on pods or Leases, a new
    generation (a user's edit of the spec), a deletion or a job without a loop still wake."""
    refresh = Decision(actions=[PatchState("{}"), PatchStatus({"progress": {}}, "7"),
                                EmitEvent("Normal", "Progress", "x")],
                       requeue_after=10, status=PretrainJobStatus(phase="Running"))
    assert handlers.quiet(refresh, PretrainJobStatus(phase="Running"))
    assert not handlers.quiet(refresh, PretrainJobStatus(phase="Pending"))  # a transition
    acting = Decision(actions=[PatchStatus({}, "7"), DeletePod("tiny-a0-0")],
                      requeue_after=1, status=PretrainJobStatus(phase="Running"))
    assert not handlers.quiet(acting, PretrainJobStatus(phase="Running"))

    rt = runtime(FakeKube([]))
    key = (JOB.namespace, JOB.name)
    assert not handlers.own_refresh(rt, *key, _modified(1))  # no quiet pass on record
    rt.quiet[key] = 1
    assert not handlers.own_refresh(rt, *key, _modified(1))  # no loop runs: it must start
    rt.tasks[key] = None  # type: ignore[assignment]
    assert handlers.own_refresh(rt, *key, _modified(1))
    assert not handlers.own_refresh(rt, *key, _modified(2))  # the spec changed
    assert not handlers.own_refresh(rt, *key, _modified(1, deleting=True))
    assert not handlers.own_refresh(rt, *key, _modified(1, type_="DELETED"))


def test_a_job_modified_during_its_pass_is_woken_after_it_unless_the_pass_was_quiet() -> None:
    """The echo of a pass's own status write usually arrives before the pass has ended: it is
    held, and dropped if the pass turned out quiet at that generation; any other pass (or a
    modification at another generation) wakes the loop once the pass is over."""
    rt = runtime(FakeKube([]))
    key = (JOB.namespace, JOB.name)
    rt.tasks[key], rt.wakes[key] = None, asyncio.Event()  # type: ignore[assignment]
    for quiet_at, seen, wakes in ((1, [1, 1], False), (None, [1], True), (1, [1, 2], True)):
        rt.wakes[key].clear()
        rt.passing.add(key)
        assert all(handlers.own_refresh(rt, *key, _modified(g)) for g in seen)  # held
        assert not rt.wakes[key].is_set()
        if quiet_at is None:
            rt.quiet.pop(key, None)
        else:
            rt.quiet[key] = quiet_at
        handlers._settle_deferred(rt, key)
        assert rt.wakes[key].is_set() == wakes, (quiet_at, seen)
        assert key not in rt.passing and key not in rt.deferred


def test_a_refreshing_pass_leaves_the_quiet_mark_one_that_acts_or_fails_forgets_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    k = FakeKube([])
    rt = runtime(k)
    key = (JOB.namespace, JOB.name)
    refresh = Decision(actions=[PatchStatus({"progress": {}}, "1")], requeue_after=10,
                       status=PretrainJobStatus())
    with monkeypatch.context() as m:  # what decide returns for a running job between events
        m.setattr(handlers, "decide", lambda *_: refresh)
        handlers.reconcile_once(rt, *key)
    assert rt.quiet[key] == 1  # the generation the pass saw
    rt.quiet[key] = 1
    handlers.reconcile_once(rt, *key)  # a new job: its pods are created
    assert any(isinstance(a, CreateObject) for a in k.executed[-1].actions)
    assert key not in rt.quiet
    rt.quiet[key] = 1
    k.fail = [Conflict("patch status: HTTP 409", 409)]
    handlers.reconcile_once(rt, *key)
    assert key not in rt.quiet


def test_an_admitted_job_s_flavors_are_read_once_per_cache_period() -> None:
    """Every pass reads the job's Workload; the flavors its admission names are read again
    only after FLAVOR_CACHE_SECONDS (they change by an administrator's edit)."""
    workload = {"metadata": {"name": "pretrainjob-tiny"}, "spec": {"active": True},
                "status": {"admission": {"clusterQueue": "cq", "podSetAssignments": [
                    {"name": "workers", "flavors": {"cpu": "trn1"}}]}}}
    flavor = {"metadata": {"name": "trn1"},
              "spec": {"nodeLabels": {"node.kubernetes.io/instance-type": "trn1.32xlarge"}}}
    k = kube(custom={"get_namespaced_custom_object": [Response(json.dumps(workload).encode())
                                                      for _ in range(3)],
                     "get_cluster_custom_object": [Response(json.dumps(flavor).encode())
                                                   for _ in range(2)]})
    now = [100.0]
    k.clock = lambda: now[0]
    labels_ = {"kueue.x-k8s.io/queue-name": "team"}
    first = k.queueing(JOB, labels_)
    now[0] += k8s.FLAVOR_CACHE_SECONDS - 1
    second = k.queueing(JOB, labels_)
    assert first is not None and second is not None and first.flavors == second.flavors
    assert first.flavors["trn1"].node_labels == {
        "node.kubernetes.io/instance-type": "trn1.32xlarge"}
    assert k.custom.names().count("get_cluster_custom_object") == 1  # type: ignore[attr-defined]
    now[0] += 2
    k.queueing(JOB, labels_)
    assert k.custom.names().count("get_cluster_custom_object") == 2  # type: ignore[attr-defined]
    assert k.custom.names().count("get_namespaced_custom_object") == 3  # type: ignore[attr-defined]
