"""Voluntary disruption and the checkpoint volume, without a cluster: the workers' Karpenter
annotation, the job's PodDisruptionBudget (its shape, when it is made and when it goes), how
the API calls are routed, and the refusal of a checkpoint directory on no volume."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from opfakes import JOB, SETTINGS, World, raw_spec

from hlat_api import labels
from hlat_api.labels import Reason
from hlat_api.manifest import parse_spec
from hlat_api.status import PretrainJobStatus
from hlat_operator import builders
from hlat_operator.k8s import Kube
from hlat_operator.reconcile import CreateObject, Decision, DeleteObject

PDB = ("PodDisruptionBudget", "tiny")


def _selects(selector: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    """Kubernetes' label selector semantics, for the parts the budget uses."""
    if any(pod_labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "DoesNotExist"
        if expr["key"] in pod_labels:
            return False
    return True


# --- the objects ---------------------------------------------------------------------------


def test_workers_and_spares_carry_karpenter_s_do_not_disrupt() -> None:
    spec = parse_spec(raw_spec(**{"faultTolerance.spareNodes": 1,
                                  "faultTolerance.restartStrategy": "InPlace"}))
    pods = builders.build_worker_pods(JOB, spec, 0, SETTINGS)
    spare = builders.build_spare_pod(JOB, spec, 0, 0, SETTINGS)
    for pod in [*pods, spare]:
        assert pod["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"


def test_the_budget_keeps_every_rank_holding_worker_and_lets_spares_go() -> None:
    spec = parse_spec(raw_spec(nodes=3, **{"train.globalBatch": 12, "faultTolerance.spareNodes": 1,
                                  "faultTolerance.restartStrategy": "InPlace"}))
    pdb = builders.build_pod_disruption_budget(JOB, spec)
    assert pdb["apiVersion"] == "policy/v1"
    # an integer minAvailable: the only form Kubernetes computes for pods whose owner has no
    # scale subresource
    assert pdb["spec"]["minAvailable"] == 3 and "maxUnavailable" not in pdb["spec"]
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == JOB.uid  # gone with the job
    selector = pdb["spec"]["selector"]
    workers = builders.build_worker_pods(JOB, spec, 4, SETTINGS)
    spare = builders.build_spare_pod(JOB, spec, 0, 4, SETTINGS)
    assert all(_selects(selector, p["metadata"]["labels"]) for p in workers)
    assert not _selects(selector, spare["metadata"]["labels"])
    promoted = {k: v for k, v in spare["metadata"]["labels"].items() if k != labels.SPARE}
    assert _selects(selector, promoted)  # a spare that took a rank is kept like the rest
    other = builders.build_worker_pods(builders.JobRef("other", JOB.namespace, "u2"), spec, 0,
                                       SETTINGS)
    assert not _selects(selector, other[0]["metadata"]["labels"])


# --- when it exists ------------------------------------------------------------------------


def test_the_budget_exists_while_the_job_runs_and_goes_when_it_succeeds() -> None:
    w = World()
    w.until("Running")
    assert PDB in w.objects
    w.succeed_all()
    w.step()
    assert w.status.phase == "Succeeded" and PDB not in w.objects


def test_the_budget_goes_when_the_job_fails() -> None:
    w = World(raw_spec(**{"faultTolerance.maxRestarts": 0}))
    w.until("Running")
    w.fail(1, exit_code=1)
    w.run(10)
    assert w.status.phase == "Failed" and PDB not in w.objects


def test_the_budget_goes_while_suspended_and_returns_on_resume() -> None:
    w = World()
    w.until("Running")
    w.spec["suspend"] = True
    w.step()
    assert w.status.phase == "Suspended" and PDB not in w.objects
    w.run(20)
    assert PDB not in w.objects
    w.spec["suspend"] = False
    w.step()
    assert PDB in w.objects and w.objects[PDB]["spec"]["minAvailable"] == 2


def test_a_restarted_gang_keeps_its_budget() -> None:
    w = World()
    w.until("Running")
    w.fail(0)
    w.step()
    w.until("Pending")
    w.until("Running")
    assert w.status.attempt == 1 and PDB in w.objects


# --- the API calls ---------------------------------------------------------------------------


class _Policy:
    def __init__(self, fail: ApiException | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __getattr__(self, method: str) -> Any:
        def call(*_args: Any, **_kwargs: Any) -> Any:
            self.calls.append(method)
            if self.fail is not None:
                raise self.fail
            return _Response()
        return call


class _Response:
    data = b"{}"

    def drain_conn(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def _decision(*actions: Any) -> Decision:
    return Decision(actions=list(actions), requeue_after=None, status=PretrainJobStatus())


def test_the_budget_is_created_and_deleted_through_the_policy_api() -> None:
    k = Kube(client.ApiClient())
    k.policy = _Policy()  # type: ignore[assignment]
    pdb = builders.build_pod_disruption_budget(JOB, parse_spec(raw_spec()))
    k.execute(JOB, _decision(CreateObject(pdb), DeleteObject("PodDisruptionBudget", "tiny")))
    assert k.policy.calls == ["create_namespaced_pod_disruption_budget",  # type: ignore[attr-defined]
                              "delete_namespaced_pod_disruption_budget"]


def test_deleting_a_budget_that_is_gone_is_fine() -> None:
    k = Kube(client.ApiClient())
    gone = ApiException(status=404, reason="Not Found")
    gone.body = json.dumps({"message": "not found"})
    k.policy = _Policy(gone)  # type: ignore[assignment]
    assert k.execute(JOB, _decision(DeleteObject("PodDisruptionBudget", "tiny"))) == 1


# --- the checkpoint directory ----------------------------------------------------------------


def _failed_with(w: World) -> str:
    w.step()
    assert w.status.phase == "Failed" and not w.pods
    (cond,) = [c for c in w.status.conditions if c.type == "Failed"]
    assert cond.reason == Reason.INVALID_SPEC
    return cond.message


def test_a_job_with_no_storage_is_refused_naming_checkpoint_dir_and_the_fix() -> None:
    message = _failed_with(World(raw_spec(storage=None)))
    assert "spec.checkpoint.dir: /fsx/checkpoints is on no volume" in message
    assert "spec.storage.claimName" in message


def test_a_checkpoint_dir_outside_the_claim_is_refused() -> None:
    message = _failed_with(World(raw_spec(**{"checkpoint.dir": "/tmp/ckpt"})))
    assert "/tmp/ckpt" in message and "under spec.storage.mountPath (/fsx)" in message


def test_a_prefix_that_is_not_a_directory_boundary_is_not_on_the_volume() -> None:
    message = _failed_with(World(raw_spec(**{"checkpoint.dir": "/fsxother/ckpt"})))
    assert "/fsxother/ckpt" in message


def _template(volume: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {
        "volumes": [{"name": "ckpt", **volume}],
        "containers": [{"name": "trainer",
                        "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}]}}


@pytest.mark.parametrize(("volume", "ok"), [
    ({"persistentVolumeClaim": {"claimName": "other"}}, True),
    ({"hostPath": {"path": "/mnt/ckpt"}}, True),
    ({"emptyDir": {}}, False),  # dies with the pod
])
def test_a_template_volume_mounted_at_the_checkpoint_dir_counts(volume: dict[str, Any],
                                                                 ok: bool) -> None:
    spec = parse_spec(raw_spec(**{"checkpoint.dir": "/ckpt/run", "template": _template(volume)}))
    problem = builders.checkpoint_volume_problem(spec)
    assert (problem is None) is ok, problem


@pytest.mark.parametrize("path", ["examples/pretrainjob-tiny.yaml"])
def test_the_example_job_passes(path: str) -> None:
    import yaml
    with open(path) as f:
        spec = parse_spec(yaml.safe_load(f)["spec"])
    assert builders.checkpoint_volume_problem(spec) is None
