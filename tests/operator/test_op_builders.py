"""The objects a job gets: what a worker pod needs to run, and nothing that lets it do more."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from opfakes import JOB, SETTINGS, raw_spec

from hlat_api import labels
from hlat_api.env import Env
from hlat_api.manifest import parse_spec
from hlat_api.spec import PretrainJobSpec
from hlat_operator import builders
from hlat_operator.kube import Pod


def spec_for(instance: str, **overrides: Any) -> PretrainJobSpec:
    per_node = {
        "cpu": 1,
        "trn1.32xlarge": 32,
        "trn1n.32xlarge": 32,
        "trn2.48xlarge": 64,
        "trn1.2xlarge": 2,
        "p5.48xlarge": 8,
    }[instance]
    return parse_spec(raw_spec(instanceType=instance, processesPerNode=per_node, **overrides))


def env_of(pod: Pod) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]
    }


def test_every_object_is_owned_by_the_job_and_labelled() -> None:
    spec = spec_for("cpu")
    objs: list[Any] = [
        builders.build_service(JOB, SETTINGS),
        builders.build_config_map(JOB, spec),
        builders.build_service_account(JOB),
        builders.build_role(JOB, spec, 0),
        builders.build_role_binding(JOB, spec),
        *builders.build_leases(JOB, spec, 0, SETTINGS),
        *builders.build_worker_pods(JOB, spec, 0, SETTINGS),
    ]
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "default" and meta["labels"][labels.JOB] == "tiny"
        (owner,) = meta["ownerReferences"]
        assert owner["kind"] == "PretrainJob" and owner["uid"] == JOB.uid and owner["controller"]


def test_headless_service_gives_stable_dns_for_rendezvous() -> None:
    svc = builders.build_service(JOB, SETTINGS)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    pods = builders.build_worker_pods(JOB, spec_for("cpu"), 3, SETTINGS)
    for rank, pod in enumerate(pods):
        assert pod["metadata"]["name"] == f"tiny-a3-{rank}"
        assert pod["spec"]["hostname"] == f"tiny-{rank}"
        assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
        assert all(pod["metadata"]["labels"][k] == v for k, v in svc["spec"]["selector"].items())
        env = env_of(pod)
        assert env[Env.MASTER_ADDR] == f"tiny-0.{svc['metadata']['name']}"
        assert env[Env.MASTER_PORT] == str(svc["spec"]["ports"][0]["port"])


def test_config_map_holds_the_spec_as_the_trainer_reads_it() -> None:
    spec = spec_for("cpu")
    cm = builders.build_config_map(JOB, spec)
    assert PretrainJobSpec.model_validate(json.loads(cm["data"][labels.CONFIG_FILE])) == spec


def test_workers_may_touch_only_their_own_attempts_leases() -> None:
    spec = spec_for("cpu", nodes=3, **{"train.globalBatch": 12})
    rule, record = builders.build_role(JOB, spec, 2)["rules"]
    assert rule["resources"] == ["leases"] and rule["apiGroups"] == ["coordination.k8s.io"]
    assert rule["resourceNames"] == ["tiny-a2-0", "tiny-a2-1", "tiny-a2-2"]
    # no create/list/delete; watch (by name): a checkpoint request is seen when written
    assert set(rule["verbs"]) == {"get", "update", "patch", "watch"}
    # the in-place restart record: read, never written, by workers
    assert record["resourceNames"] == ["tiny-gang"] and record["verbs"] == ["get", "watch"]
    binding = builders.build_role_binding(JOB, spec)
    sa = builders.build_service_account(JOB)
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]
    leases = builders.build_leases(JOB, spec, 2, SETTINGS)
    assert [x["metadata"]["name"] for x in leases] == rule["resourceNames"]
    assert all("renewTime" not in x["spec"] for x in leases)  # the first renewal is the first beat
    pods = builders.build_worker_pods(JOB, spec, 2, SETTINGS)
    assert [env_of(p)[Env.HEARTBEAT_LEASE] for p in pods] == rule["resourceNames"]
    assert all(p["spec"]["serviceAccountName"] == sa["metadata"]["name"] for p in pods)


def test_worker_env_tells_the_launcher_everything() -> None:
    spec = spec_for("cpu", nodes=2)
    pod = builders.build_worker_pod(JOB, spec, 1, 1, SETTINGS)
    env = env_of(pod)
    assert env[Env.JOB_NAME] == "tiny" and env[Env.NAMESPACE] == "default"
    assert env[Env.ATTEMPT] == "1" and env[Env.NODE_RANK] == "1" and env[Env.NNODES] == "2"
    assert env[Env.NPROC_PER_NODE] == "1"
    assert env[Env.CONFIG] == f"{labels.CONFIG_DIR}/{labels.CONFIG_FILE}"
    assert env[Env.POD_NAME] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env[Env.NODE_NAME] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env[Env.HEARTBEAT_PERIOD] == "2" and env[Env.METRICS_PORT] == "9400"
    assert not any(k.startswith(("NEURON_", "FI_")) for k in env)  # no accelerator on cpu
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["hlat-launch"] and c["image"] == "hlat-trainer:dev"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["terminationGracePeriodSeconds"] == SETTINGS.termination_grace_seconds


def test_the_trainer_command_is_a_setting() -> None:
    settings = SETTINGS.model_copy(update={"trainer_command": ["/opt/rig/bin/hlat-launch", "-v"]})
    pod = builders.build_worker_pod(JOB, spec_for("cpu"), 0, 0, settings)
    assert pod["spec"]["containers"][0]["command"] == ["/opt/rig/bin/hlat-launch", "-v"]


@pytest.mark.parametrize(
    ("instance", "neuron", "efa", "gpu"),
    [
        ("trn1.32xlarge", "16", "8", None),
        ("trn1n.32xlarge", "16", "16", None),
        ("trn2.48xlarge", "16", "16", None),
        ("trn1.2xlarge", "1", None, None),
        ("p5.48xlarge", None, "32", "8"),
        ("cpu", None, None, None),
    ],
)
def test_resources_per_instance_type(
    instance: str, neuron: str | None, efa: str | None, gpu: str | None
) -> None:
    kw = {"model.preset": "tiny", "train.globalBatch": 256, "train.microBatch": 1}
    pod = builders.build_worker_pod(JOB, spec_for(instance, **kw), 0, 0, SETTINGS)
    resources = pod["spec"]["containers"][0].get("resources", {})
    limits = resources.get("limits", {})
    assert limits.get(labels.NEURON_RESOURCE) == neuron
    assert limits.get(labels.EFA_RESOURCE) == efa
    assert limits.get(labels.GPU_RESOURCE) == gpu
    assert resources.get("requests", {}) == limits
    selector = pod["spec"].get("nodeSelector", {})
    assert selector.get(labels.INSTANCE_TYPE_LABEL) == (None if instance == "cpu" else instance)
    tolerated = {t["key"] for t in pod["spec"].get("tolerations", [])}
    assert (labels.NEURON_TAINT in tolerated) == (neuron is not None)
    assert not [k for k in env_of(pod) if k.startswith("FI_")]  # the launcher sets EFA's


def test_trainium_pods_get_a_node_local_compile_cache_their_user_can_write() -> None:
    spec = spec_for(
        "trn1.32xlarge",
        **{
            "model.preset": "tiny",
            "train.globalBatch": 256,
            "train.microBatch": 1,
            "precision": "bf16-sr",
        },
    )
    pod = builders.build_worker_pod(JOB, spec, 0, 0, SETTINGS)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    cache = vols[builders.CACHE_VOLUME]["hostPath"]
    assert cache["path"] == spec.neuron.cache_dir
    assert not cache["path"].startswith(spec.storage.mount_path)  # never on the shared volume
    # the kubelet creates the hostPath root-owned 0755; the image runs as its own user
    dockerfile = (Path(__file__).parents[2] / "Dockerfile.trainer").read_text()
    image_uid = int(re.search(r"^ARG USER_UID=(\d+)$", dockerfile, re.M)[1])  # type: ignore[index]
    assert image_uid == labels.TRAINER_UID
    (init,) = pod["spec"]["initContainers"]
    assert init["command"] == ["chown", f"{image_uid}:{image_uid}", spec.neuron.cache_dir]
    assert {m["mountPath"] for m in init["volumeMounts"]} == {spec.neuron.cache_dir}
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    sysctls = {s["name"]: s["value"] for s in pod["spec"]["securityContext"]["sysctls"]}
    assert sysctls == {"net.ipv4.ip_local_reserved_ports": labels.NEURON_RESERVED_PORTS}


def test_the_neuron_environment_has_one_source_the_launcher() -> None:
    """The pod sets no NEURON_*/FI_* variable: the launcher would keep it over its own."""
    spec = spec_for("trn1.32xlarge", **{"model.preset": "tiny", "train.globalBatch": 256,
                                        "train.microBatch": 1, "nodes": 2})
    env = env_of(builders.build_worker_pod(JOB, spec, 0, 0, SETTINGS))
    assert not [k for k in env if k.startswith(("NEURON_", "FI_", "CCOM_", "MALLOC_"))]


def test_volumes_shm_shared_claim_and_config() -> None:
    pod = builders.build_worker_pod(JOB, spec_for("cpu"), 0, 0, SETTINGS)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert vols["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"] == "/dev/shm"
    assert vols["data"]["persistentVolumeClaim"]["claimName"] == "hlat-shared"
    assert mounts["data"] == "/fsx"
    assert vols["config"]["configMap"]["name"] == labels.config_map_name("tiny")
    assert builders.CACHE_VOLUME not in vols  # cpu: no Neuron cache
    local = builders.build_worker_pod(JOB, parse_spec(raw_spec(storage={})), 0, 0, SETTINGS)
    assert "data" not in {v["name"] for v in local["spec"]["volumes"]}


def test_failed_nodes_are_excluded_by_required_node_affinity() -> None:
    pod = builders.build_worker_pod(JOB, spec_for("cpu"), 1, 0, SETTINGS, ["node-b", "node-a"])
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    (term,) = terms["nodeSelectorTerms"]
    # one value per expression: the API server refuses a node-field NotIn with two (422)
    assert term["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["node-b"]},
        {"key": "metadata.name", "operator": "NotIn", "values": ["node-a"]},
    ]
    assert "affinity" not in builders.build_worker_pod(JOB, spec_for("cpu"), 1, 0, SETTINGS)["spec"]


def test_scheduling_extras_pass_through() -> None:
    spec = spec_for(
        "trn1.32xlarge",
        **{
            "model.preset": "tiny",
            "train.globalBatch": 256,
            "train.microBatch": 1,
            "scheduling": {
                "nodeSelector": {"pool": "training"},
                "priorityClassName": "high",
                "schedulerName": "volcano",
                "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            },
        },
    )
    pod = builders.build_worker_pod(JOB, spec, 0, 0, SETTINGS)["spec"]
    assert pod["nodeSelector"] == {"pool": "training", labels.INSTANCE_TYPE_LABEL: "trn1.32xlarge"}
    assert pod["priorityClassName"] == "high" and pod["schedulerName"] == "volcano"
    assert {"key": "dedicated", "operator": "Exists"} in pod["tolerations"]
    assert any(t["key"] == labels.NEURON_TAINT for t in pod["tolerations"])


def test_longest_job_name_gives_valid_dns_labels() -> None:
    job = builders.JobRef("j" * labels.MAX_JOB_NAME, "ns", "u")
    pod = builders.build_worker_pod(job, spec_for("cpu"), 999, 0, SETTINGS)
    assert len(pod["spec"]["hostname"]) <= 63 and len(pod["metadata"]["name"]) <= 63
    assert len(labels.service_name(job.name)) <= 63
    assert len(labels.service_account_name(job.name)) <= 63
