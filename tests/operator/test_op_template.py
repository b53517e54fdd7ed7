"""The pod template: what a user's PodTemplateSpec adds to the workers, what the operator keeps,
QoS, names valid for any job name, gang admission objects, and how API errors are classed."""

from __future__ import annotations

import re
from typing import Any

import pytest
from opfakes import JOB, SETTINGS, raw_spec

from hlat_api import labels
from hlat_api.env import Env
from hlat_api.manifest import InvalidSpecError, parse_spec
from hlat_api.presets import INSTANCE_TYPES
from hlat_api.spec import PretrainJobSpec
from hlat_operator import builders
from hlat_operator.config import OperatorSettings
from hlat_operator.handlers import MAX_ERROR_RETRY_SECONDS, error_backoff
from hlat_operator.k8s import K8sError, permanent

TRN1 = {"instanceType": "trn1.32xlarge", "processesPerNode": 32, "model.preset": "tiny",
        "train.globalBatch": 256, "train.microBatch": 1}


def spec_with(template: dict[str, Any] | None, **overrides: Any) -> PretrainJobSpec:
    raw = raw_spec(**overrides)
    if template is not None:
        raw["template"] = template
    return parse_spec(raw)


def pod_for(spec: PretrainJobSpec, avoid: list[str] | None = None,
            settings: OperatorSettings = SETTINGS) -> dict[str, Any]:
    pod: dict[str, Any] = builders.build_worker_pod(JOB, spec, 0, 1, settings, avoid)  # type: ignore[assignment]
    return pod


def trainer_of(pod: dict[str, Any]) -> dict[str, Any]:
    (trainer,) = [c for c in pod["spec"]["containers"] if c["name"] == "trainer"]
    return trainer


FULL: dict[str, Any] = {
    "metadata": {"labels": {"team": "nlp", labels.JOB: "not-mine"},
                 "annotations": {"owner": "ml"}},
    "spec": {
        "serviceAccountName": "trainer-s3",
        "imagePullSecrets": [{"name": "ecr"}],
        "priorityClassName": "high",
        "tolerations": [{"key": "spot", "operator": "Exists"}],
        "nodeSelector": {"pool": "a"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}},
        "securityContext": {"fsGroup": 2000},
        "volumes": [{"name": "creds", "secret": {"secretName": "s3"}}],
        "initContainers": [{"name": "warm", "image": "busybox"}],
        "containers": [
            {"name": "trainer", "env": [{"name": "TEAM", "value": "nlp"},
                                        {"name": "POD_NAME", "value": "mine"}],
             "envFrom": [{"secretRef": {"name": "wandb"}}],
             "volumeMounts": [{"name": "creds", "mountPath": "/creds"}],
             "imagePullPolicy": "Always"},
            {"name": "logs", "image": "fluent-bit"},
        ],
    },
}


def test_the_template_reaches_the_pod_and_the_gang_fields_stay_the_operator_s() -> None:
    pod = pod_for(spec_with(FULL), avoid=["node-x"])
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "nlp" and meta["labels"][labels.JOB] == JOB.name
    assert meta["annotations"]["owner"] == "ml"
    assert spec["serviceAccountName"] == "trainer-s3"
    assert spec["imagePullSecrets"] == [{"name": "ecr"}] and spec["priorityClassName"] == "high"
    assert {"key": "spot", "operator": "Exists"} in spec["tolerations"]
    assert spec["nodeSelector"]["pool"] == "a" and spec["securityContext"]["fsGroup"] == 2000
    assert spec["hostname"] == labels.worker_hostname(JOB.name, 1)
    assert spec["restartPolicy"] == "Never"
    assert {"creds", "shm", "config", "data"} <= {v["name"] for v in spec["volumes"]}
    assert [c["name"] for c in spec["initContainers"]] == ["warm"]
    assert [c["name"] for c in spec["containers"]] == ["trainer", "logs"]
    trainer = trainer_of(pod)
    assert trainer["command"] == list(SETTINGS.trainer_command)
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["TEAM"] == "nlp" and env[Env.JOB_NAME] == JOB.name
    assert trainer["envFrom"] == [{"secretRef": {"name": "wandb"}}]
    assert "/creds" in {m["mountPath"] for m in trainer["volumeMounts"]}
    assert trainer["imagePullPolicy"] == "Always"
    # the avoid rule holds in every OR-ed term of the user's node affinity
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert len(terms) == 2
    for term in terms:
        assert term["matchFields"] == [
            {"key": "metadata.name", "operator": "NotIn", "values": ["node-x"]}]
        assert term["matchExpressions"][0]["key"] == "zone"


def test_no_template_no_change() -> None:
    spec = parse_spec(raw_spec())
    assert pod_for(spec) == pod_for(spec.model_copy(update={"template": None}))


@pytest.mark.parametrize(("template", "field"), [
    ({"spec": {"containers": [{"name": "trainer", "command": ["bash"]}]}},
     "template.spec.containers[0].command"),
    ({"spec": {"containers": [{"name": "trainer", "args": ["x"]}]}},
     "template.spec.containers[0].args"),
    ({"spec": {"containers": [{"name": "trainer", "env": [{"name": "HLAT_NNODES", "value": "9"}]}]}},
     "template.spec.containers[0].env[0].name"),
    ({"spec": {"restartPolicy": "Always"}}, "template.spec.restartPolicy"),
    ({"spec": {"hostname": "x"}}, "template.spec.hostname"),
    ({"spec": {"nodeName": "node-a"}}, "template.spec.nodeName"),
    ({"spec": {"volumes": [{"name": "shm", "emptyDir": {}}]}}, "template.spec.volumes[0].name"),
    ({"spec": {"containers": [{"image": "x"}]}}, "template.spec.containers[0].name"),
    ({"spec": {"containers": [{"name": "a"}, {"name": "a"}]}}, "template.spec.containers[1].name"),
    ({"spec": {"initContainers": [{"name": "neuron-cache-owner"}]}},
     "template.spec.initContainers"),
    ({"spec": {"containers": [{"name": "trainer", "image": "other:1"}]}},
     "template.spec.containers"),
    ({"metadata": {"name": "x"}}, "template.metadata.name"),
])
def test_a_template_that_sets_what_the_operator_owns_is_refused_naming_the_field(
        template: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as err:
        spec_with(template)
    assert f"spec.{field}" in [path for path, _ in err.value.problems], err.value.problems


def test_only_the_variables_the_operator_sets_are_reserved() -> None:
    fault = {"name": "HLAT_FAULT_CHECKPOINT_WRITE_DELAY_SECONDS", "value": "8"}
    spec = spec_with({"spec": {"containers": [{"name": "trainer", "env": [fault]}]}})
    env = {e["name"]: e.get("value") for e in trainer_of(pod_for(spec))["env"]}
    assert env[fault["name"]] == "8" and env[Env.NNODES] == str(spec.nodes)


def test_the_template_s_trainer_image_is_used_when_spec_image_is_unset() -> None:
    spec = spec_with({"spec": {"containers": [{"name": "trainer", "image": "ecr/hlat:2"}]}},
                     image=None)
    assert trainer_of(pod_for(spec))["image"] == "ecr/hlat:2"


def test_trainium_workers_are_guaranteed_qos_by_default() -> None:
    """Guaranteed: every container, init containers included, has cpu and memory requests equal
    to its limits (the kubelet evicts these last)."""
    pod = pod_for(parse_spec(raw_spec(**TRN1)))
    info = INSTANCE_TYPES["trn1.32xlarge"]
    for container in [*pod["spec"]["containers"], *pod["spec"]["initContainers"]]:
        res = container["resources"]
        assert res["requests"] == res["limits"], container["name"]
        assert {"cpu", "memory"} <= set(res["requests"]), container["name"]
    trainer = trainer_of(pod)["resources"]["requests"]
    assert trainer["cpu"] == info.cpu and trainer["memory"] == info.memory
    assert trainer[labels.NEURON_RESOURCE] == "16" and trainer[labels.EFA_RESOURCE] == "8"


def test_the_template_sizes_cpu_and_memory_but_not_the_accelerators() -> None:
    size = {"cpu": "64", labels.NEURON_RESOURCE: "1"}
    spec = spec_with({"spec": {"containers": [{"name": "trainer", "resources": {
        "requests": size, "limits": {"memory": "100Gi"}}}]}}, **TRN1)
    res = trainer_of(pod_for(spec))["resources"]
    assert res["requests"]["cpu"] == "64" and "memory" not in res["requests"]
    assert res["limits"]["memory"] == "100Gi" and "cpu" not in res["limits"]
    assert res["requests"][labels.NEURON_RESOURCE] == "16"  # the whole node, always


def test_the_compile_cache_goes_to_the_template_s_user_and_can_be_replaced() -> None:
    spec = spec_with({"spec": {"securityContext": {"runAsUser": 4242},
                               "volumes": [{"name": "neuron-cache", "emptyDir": {}}]}}, **TRN1)
    pod = pod_for(spec)
    (init,) = pod["spec"]["initContainers"]
    assert init["command"][:2] == ["chown", "4242:4242"]
    (cache,) = [v for v in pod["spec"]["volumes"] if v["name"] == "neuron-cache"]
    assert cache == {"name": "neuron-cache", "emptyDir": {}}  # no hostPath left
    assert "hostPath" not in str(pod["spec"]["volumes"])


def test_the_template_s_service_account_gets_the_heartbeat_role_too() -> None:
    spec = spec_with({"spec": {"serviceAccountName": "trainer-s3"}})
    binding = builders.build_role_binding(JOB, spec)
    names = [s["name"] for s in binding["subjects"]]
    assert names == [labels.service_account_name(JOB.name), "trainer-s3"]
    alone = builders.build_role_binding(JOB, parse_spec(raw_spec()))
    assert [s["name"] for s in alone["subjects"]] == [labels.service_account_name(JOB.name)]


@pytest.mark.parametrize("name", [
    "tiny", "llama-3.1-8b", "7b-run", "a.b", "a-b", "1.2.3", "x" * labels.MAX_JOB_NAME,
    "9" * labels.MAX_JOB_NAME, ("a." * 26)[:labels.MAX_JOB_NAME].rstrip("."),
])
def test_every_derived_name_is_valid_for_any_name_the_crd_admits(name: str) -> None:
    label_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    label_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    service = labels.service_name(name)
    assert label_1035.match(service) and len(service) <= 63, service
    host = labels.worker_hostname(name, 9999)
    assert label_1123.match(host) and len(host) <= 63, host
    assert labels.master_addr(name) == f"{labels.worker_hostname(name, 0)}.{service}"


def test_names_differing_only_in_what_is_replaced_get_different_services() -> None:
    assert labels.service_name("a.b") != labels.service_name("a-b")
    assert labels.service_name("7b") != labels.service_name("j7b")
    assert labels.service_name("a.b-c") != labels.service_name("a-b.c")  # both made labels


def test_volcano_gets_a_pod_group_and_the_pods_join_it() -> None:
    spec = spec_with(None, **{"scheduling.schedulerName": "volcano",
                              "scheduling.queue": "research"})
    group = builders.build_pod_group(JOB, spec)
    assert group["spec"] == {"minMember": spec.nodes, "queue": "research"}
    assert group["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    pod = pod_for(spec)
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"][builders.VOLCANO_GROUP_ANNOTATION] == JOB.name
    default = OperatorSettings(scheduler_name="volcano")
    assert builders.uses_volcano(parse_spec(raw_spec()), default)
    assert pod_for(parse_spec(raw_spec()), settings=default)["spec"]["schedulerName"] == "volcano"
    assert "schedulerName" not in pod_for(parse_spec(raw_spec()))["spec"]


@pytest.mark.parametrize(("status", "message", "kind", "expected"), [
    (422, "Pod is invalid", "Pod", True),
    (400, "bad request", "Pod", True),
    (403, 'violates PodSecurity "baseline:latest"', "Pod", True),
    (403, "exceeded quota: compute", "Pod", False),
    (403, "unable to create new content in namespace x because it is being terminated", "Pod",
     False),
    (404, "the server could not find the requested resource", "PodGroup", True),
    (404, "namespaces not found", "Pod", False),
    (409, "conflict", "Pod", False),
    (429, "too many requests", "Pod", False),
    (500, "etcd timeout", "Pod", False),
    (None, "connection refused", "Pod", False),
])
def test_only_refusals_no_retry_can_fix_end_a_job(status: int | None, message: str, kind: str,
                                                   expected: bool) -> None:
    assert permanent(K8sError(f"create {kind} x: {message}", status), kind) is expected


def test_transient_api_errors_back_off_exponentially_to_a_bound() -> None:
    delays = [error_backoff(n) for n in range(1, 10)]
    assert delays[:3] == [2.0, 4.0, 8.0]
    assert max(delays) == MAX_ERROR_RETRY_SECONDS and delays == sorted(delays)
