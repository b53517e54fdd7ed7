"""Invalid PretrainJobs against the real API server and the real operator process.

Each one is either rejected by the API server (the CRD's OpenAPI schema or CEL rules: HTTP 422
naming the field), or accepted and then marked Failed with reason InvalidSpec by the operator
(checks only the operator can make: memory per device, exactly one of steps/tokens, ...),
naming the field. None may crash the operator or start a pod. Jobs are created with
`fieldValidation=Strict`, as `kubectl apply` does by default.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_api import labels
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import GROUP, PLURAL, VERSION, OperatorProcess, install_crd

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BASE: dict[str, Any] = tiny_spec(steps=8)

DROP = object()


def _set(spec: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = spec
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if value is DROP:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


SEVENTY_B_ON_TRN1 = {"model": {"preset": "70b"}, "instanceType": "trn1.32xlarge",
                     "processesPerNode": None, "precision": "bf16",
                     "train": {"globalBatch": 128, "microBatch": 2, "steps": 8}}

# (id, {dotted path: value or DROP}, the field the error must name)
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("nodes-not-an-integer", {"nodes": "two"}, "nodes"),
    ("nodes-zero", {"nodes": 0}, "nodes"),
    ("nodes-negative", {"nodes": -1}, "nodes"),
    ("unknown-instance-type", {"instanceType": "m5.large"}, "instanceType"),
    ("unknown-precision", {"precision": "fp8"}, "precision"),
    ("unknown-model-preset", {"model": {"preset": "13b"}}, "preset"),
    ("unknown-backend", {"backend": "tpu"}, "backend"),
    ("missing-data", {"data": DROP}, "data"),
    ("missing-data-path", {"data.path": DROP}, "path"),
    ("missing-tokenizer", {"data.tokenizer": DROP}, "tokenizer"),
    ("seq-len-zero", {"data.seqLen": 0}, "seqLen"),
    ("seq-len-above-model-max", {"data.seqLen": 4096}, "seqLen"),
    ("tensor-does-not-divide-heads", {"parallelism.tensor": 3, "processesPerNode": 4},
     "tensor"),
    ("tensor-above-processes-per-node", {"parallelism.tensor": 2}, "tensor"),
    ("pipeline-parallelism", {"parallelism.pipeline": 2}, "pipeline"),
    ("hidden-not-divisible-by-heads", {"model.hiddenSize": 66}, "hiddenSize"),
    ("heads-not-multiple-of-kv-heads", {"model.kvHeads": 3}, "kvHeads"),
    ("processes-per-node-zero", {"processesPerNode": 0}, "processesPerNode"),
    ("lr-zero", {"optimizer.lr": 0}, "lr"),
    ("lr-not-a-number", {"optimizer.lr": "fast"}, "lr"),
    ("min-lr-above-lr", {"optimizer.minLr": 1.0}, "minLr"),
    ("warmup-longer-than-run", {"optimizer.warmupSteps": 100}, "warmupSteps"),
    ("global-batch-not-divisible", {"train.globalBatch": 5}, "globalBatch"),  # by microBatch 2
    # one micro-batch of 2 for 2 data-parallel ranks (6, three on two, is valid: uneven)
    ("global-batch-below-a-micro-batch-a-rank", {"train.globalBatch": 2}, "globalBatch"),
    ("micro-batch-zero", {"train.microBatch": 0}, "microBatch"),
    ("steps-and-tokens", {"train.tokens": 1e6}, "train"),
    ("checkpoint-interval-zero", {"checkpoint.interval": 0}, "interval"),
    ("max-restarts-negative", {"faultTolerance.maxRestarts": -1}, "maxRestarts"),
    ("backoff-initial-above-max", {"faultTolerance.backoff.initialSeconds": 10}, "initialSeconds"),
    ("heartbeat-timeout-not-a-number", {"faultTolerance.heartbeat": {"timeoutSeconds": "soon"}},
     "timeoutSeconds"),
    ("safety-factor-below-one", {"faultTolerance.heartbeat": {"safetyFactor": 0.5}},
     "safetyFactor"),
    ("active-deadline-zero", {"activeDeadlineSeconds": 0}, "activeDeadlineSeconds"),
    ("mount-path-not-a-string", {"storage.mountPath": 5}, "mountPath"),
    ("unknown-field", {"nodez": 2}, "nodez"),
    ("no-progress-restarts-zero", {"faultTolerance.noProgressRestarts": 0}, "noProgressRestarts"),
    ("too-little-memory-per-device", SEVENTY_B_ON_TRN1, "tensor"),
    ("name-too-long", {}, "name"),
    ("empty-data-path", {"data.path": ""}, "path"),
    ("empty-image", {"image": ""}, "image"),
    ("oversized-tokenizer", {"data.tokenizer": "t" * 5000}, "tokenizer"),
    ("relative-mount-path", {"storage.mountPath": "fsx"}, "mountPath"),
    ("backend-the-instance-cannot-run", {"backend": "cuda"}, "backend"),
    ("more-processes-than-neuron-cores", {"instanceType": "trn1.2xlarge", "processesPerNode": 4},
     "processesPerNode"),
    ("huge-node-count", {"nodes": 100000}, "nodes"),
    ("fractional-heartbeat-timeout", {"faultTolerance.heartbeat": {"timeoutSeconds": 2.5}},
     "timeoutSeconds"),
    ("omitted-optimizer-keeps-the-default-warmup", {"optimizer": DROP}, "warmupSteps"),
    ("omitted-train", {"train": DROP}, "train"),
]


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    install_crd(cluster.admin_api())
    log: Path = tmp_path_factory.mktemp("operator") / "operator.log"
    op = OperatorProcess(cluster, log, ["test-*"]).start()
    yield op
    op.stop()
    print(f"operator log: {log}")


def _failed_condition(status: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == "Failed"), None)


@pytest.mark.parametrize(("changes", "field"), [pytest.param(c, f, id=i) for i, c, f in CASES])
def test_an_invalid_pretrainjob_is_rejected_naming_the_field(
    changes: dict[str, Any], field: str, cluster: Cluster, namespace: str,
    operator: OperatorProcess, request: pytest.FixtureRequest,
) -> None:
    spec = copy.deepcopy(BASE)
    for path, value in changes.items():
        if isinstance(value, dict) and isinstance(spec.get(path), dict) and path != "model":
            spec[path].update(value)
        elif value is None:
            spec.pop(path, None)
        else:
            _set(spec, path, value)
    name = "x" * 53 if request.node.callspec.id == "name-too-long" else "bad"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
            "metadata": {"name": name}, "spec": spec}
    custom = client.CustomObjectsApi(cluster.admin_api())
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body,
                                               field_validation="Strict")
    except ApiException as err:
        assert err.status in (400, 422), err.body  # 400: strict decoding (unknown field)
        message = json.loads(err.body)["message"]
        assert field in message, message
        return
    # accepted by the API server: the operator must fail it with InvalidSpec, naming the field
    deadline = time.monotonic() + 30
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job: Any = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        status = job.get("status") or {}
        if status.get("phase") == "Failed":
            break
        time.sleep(0.25)
    failed = _failed_condition(status)
    assert failed is not None, f"not rejected and not Failed: {status}"
    assert failed["reason"] == "InvalidSpec"
    assert field in failed["message"], failed["message"]
    core = client.CoreV1Api(cluster.admin_api())
    assert not core.list_namespaced_pod(namespace).items
    assert operator.alive()


def test_omitted_sections_are_defaulted_by_the_api_server(
        cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    """Sections left out get the schema's defaults on the server (so their CEL rules apply,
    and `kubectl get -o yaml` shows what will run), the same values the operator assumes."""
    spec = copy.deepcopy(BASE)
    for section in ("faultTolerance", "checkpoint", "parallelism", "scheduling"):
        spec.pop(section, None)
    spec["suspend"] = True  # admission is the point: no pods
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
            "metadata": {"name": "defaults"}, "spec": spec}
    custom = client.CustomObjectsApi(cluster.admin_api())
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body,
                                           field_validation="Strict")
    stored: Any = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                      "defaults")
    s = stored["spec"]
    assert s["faultTolerance"]["backoff"] == {"initialSeconds": 30, "maxSeconds": 600}
    assert s["faultTolerance"]["heartbeat"]["timeoutSeconds"] == "auto"
    assert s["checkpoint"]["interval"] == 1000 and s["checkpoint"]["async"] is True
    assert s["parallelism"]["pipeline"] == 1 and "tensor" not in s["parallelism"]
    assert s["scheduling"] == {"nodeSelector": {}, "tolerations": []} or s["scheduling"] == {}
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "defaults")


EDGES = [
    ("longest-name", {}),
    ("whole-second-timeouts", {"faultTolerance.heartbeat": {
        "timeoutSeconds": 1, "startupTimeoutSeconds": 1}}),
    ("seq-len-at-the-model-s-maximum", {"data.seqLen": 128, "model.maxSeqLen": 128}),
]


@pytest.mark.parametrize("changes", [pytest.param(c, id=i) for i, c in EDGES])
def test_valid_values_at_the_edge_of_a_rule_are_admitted(
    changes: dict[str, Any], cluster: Cluster, namespace: str, operator: OperatorProcess,
    request: pytest.FixtureRequest,
) -> None:
    """The other side of each rule: a name of exactly the longest length, 1-second timeouts,
    seqLen equal to maxSeqLen are admitted by the API server (an inverted rule refuses them)."""
    spec = copy.deepcopy(BASE)
    for path, value in changes.items():
        if isinstance(value, dict) and isinstance(spec.get(path), dict):
            spec[path] = {**spec[path], **value}
        else:
            _set(spec, path, value)
    spec["suspend"] = True  # admission is the point: no pods
    longest = request.node.callspec.id == "longest-name"
    name = "x" * labels.MAX_JOB_NAME if longest else "edge"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
            "metadata": {"name": name}, "spec": spec}
    custom = client.CustomObjectsApi(cluster.admin_api())
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body,
                                           field_validation="Strict")
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
