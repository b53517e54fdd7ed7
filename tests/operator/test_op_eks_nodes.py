"""The workers a PretrainJob gets land on EKS nodes as AWS labels and taints them: HyperPod's
`ml.` instance-type label, Karpenter's Neuron taint; requests = limits (Guaranteed QoS)."""

from __future__ import annotations

from opfakes import JOB, SETTINGS, raw_spec

from hlat_api import labels
from hlat_api.manifest import parse_spec
from hlat_operator import builders
from hlat_testbed import eksnodes
from hlat_testbed.instancetypes import instance_type


def _pod(instance: str) -> dict:  # type: ignore[type-arg]
    spec = parse_spec(raw_spec(instanceType=instance, processesPerNode=32,
                               **{"model.preset": "tiny", "train.globalBatch": 256,
                                  "train.microBatch": 1}))
    return builders.build_worker_pod(JOB, spec, 0, 0, SETTINGS)  # type: ignore[return-value]


def _schedulable(pod: dict, node_labels: dict[str, str],  # type: ignore[type-arg]
                 taints: list[dict[str, str]]) -> bool:
    """The scheduler's nodeSelector and taint checks, as far as these pods use them."""
    selected = all(node_labels.get(k) == v for k, v in pod["spec"].get("nodeSelector", {}).items())
    tolerated = {t["key"] for t in pod["spec"].get("tolerations", [])
                 if t.get("operator") == "Exists"}
    return selected and all(t["key"] in tolerated for t in taints)


def test_an_ml_job_selects_hyperpod_nodes_and_only_those() -> None:
    pod = _pod("ml.trn1.32xlarge")
    assert pod["spec"]["nodeSelector"][labels.INSTANCE_TYPE_LABEL] == "ml.trn1.32xlarge"
    trn1 = instance_type("trn1.32xlarge")
    hyperpod = eksnodes.node_labels("hp-0", trn1, "hyperpod")
    assert _schedulable(pod, hyperpod, eksnodes.node_taints(trn1, "hyperpod"))
    assert not _schedulable(pod, eksnodes.node_labels("n-0", trn1, "managed"), [])
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"]


def test_a_plain_trn1_job_tolerates_karpenter_s_neuron_taint() -> None:
    pod = _pod("trn1.32xlarge")
    trn1 = instance_type("trn1.32xlarge")
    taints = eksnodes.node_taints(trn1, "karpenter")
    assert taints and _schedulable(pod, eksnodes.node_labels("k-0", trn1, "karpenter"), taints)
    assert not _schedulable(pod, eksnodes.node_labels("hp-0", trn1, "hyperpod"), [])


def test_the_crd_s_rules_take_the_ml_names() -> None:
    """The CRD's CEL rules look instance types up in maps: a name missing there would fail the
    whole object at the API server (evaluated here with test_op_crd's evaluator)."""
    from test_op_crd import _violations

    ok = raw_spec(instanceType="ml.trn1.32xlarge", processesPerNode=32, backend="neuron-xla",
                  **{"model.preset": "tiny", "train.globalBatch": 256, "train.microBatch": 1})
    assert _violations(ok) == []
    too_many = {**ok, "processesPerNode": 64}
    assert any("processesPerNode" in v for v in _violations(too_many))
