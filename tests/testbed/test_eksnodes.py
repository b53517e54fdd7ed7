"""The rig's EKS node model against AWS's published figures, and the workers' requests against
the model: what decides whether a job is placed (Karpenter launches a node only for pods that
fit its figures) or stays Pending for good."""

from __future__ import annotations

from decimal import Decimal

import pytest
from kubernetes.utils import parse_quantity

from hlat_api.presets import INSTANCE_TYPES as WORKERS
from hlat_testbed import eksnodes
from hlat_testbed.instancetypes import INSTANCE_TYPES, NEURON, instance_type

# karpenter-provider-aws 1d92708, website/content/en/docs/reference/instance-types.md, the
# `Resources` table of each type: cpu, memory, pods
KARPENTER_PUBLISHED = {
    "trn1.32xlarge": ("127610m", "481894Mi", "247"),
    "trn1n.32xlarge": ("127610m", "481894Mi", "247"),
    "trn1.2xlarge": ("7910m", "29317Mi", "58"),
    "trn2.48xlarge": ("191450m", "1938410Mi", "100"),
    "p5.48xlarge": ("191450m", "1938410Mi", "100"),
    "p4d.24xlarge": ("95690m", "1082712Mi", "737"),
    "m5.large": ("1930m", "6903Mi", "29"),
}
ACCELERATED = [name for name in WORKERS if name != "cpu"]


@pytest.mark.parametrize("name", sorted(KARPENTER_PUBLISHED))
@pytest.mark.parametrize("provisioner", ["karpenter", "auto"])
def test_karpenter_nodes_offer_exactly_what_karpenter_publishes(name: str,
                                                                provisioner: str) -> None:
    alloc = eksnodes.node_resources(instance_type(name),
                                    eksnodes.provisioner(provisioner)).allocatable
    assert (alloc["cpu"], alloc["memory"], alloc["pods"]) == KARPENTER_PUBLISHED[name]


def test_the_eks_ami_reserves_by_its_formula() -> None:
    """nodeadm: 11 MiB per pod + 255 MiB; cpu 60 + 10 + 10 m, then 2.5 m per core."""
    assert eksnodes.kube_reserved_memory_mib(247) == 2972
    assert eksnodes.kube_reserved_cpu_m(128) == 390
    assert eksnodes.kube_reserved_cpu_m(2) == 70
    managed = eksnodes.node_resources(instance_type("trn1.32xlarge"), "managed")
    cap, alloc = (parse_quantity(managed.capacity["memory"]),
                  parse_quantity(managed.allocatable["memory"]))
    assert cap - alloc == (2972 + 100) * 2**20  # kube-reserved + eviction-hard
    assert managed.capacity["cpu"] == "128" and managed.allocatable["cpu"] == "127610m"


def _fits(name: str, provisioner: str, cpu: str, memory: str) -> tuple[bool, Decimal, Decimal]:
    """Whether one worker plus a real pool's DaemonSets fit the node; the margin left."""
    alloc = eksnodes.node_resources(instance_type(name),
                                    eksnodes.provisioner(provisioner)).allocatable
    ds = eksnodes.DAEMONSET_OVERHEAD
    cpu_left = parse_quantity(alloc["cpu"]) - parse_quantity(cpu) - Decimal(ds["cpu_m"]) / 1000
    mem_left = (parse_quantity(alloc["memory"]) - parse_quantity(memory)
                - Decimal(ds["memory_mib"]) * 2**20)
    return cpu_left >= 0 and mem_left >= 0, cpu_left, mem_left


@pytest.mark.parametrize(("name", "old_memory"), [
    ("trn1.32xlarge", "480Gi"), ("trn1n.32xlarge", "480Gi"),
    ("trn2.48xlarge", "1900Gi"), ("p5.48xlarge", "1900Gi")])
def test_the_old_requests_never_get_a_karpenter_node(name: str, old_memory: str) -> None:
    """480Gi is 491,520Mi against Karpenter's 481,894Mi (aws/karpenter-provider-aws#6509): the
    worker stays Pending. A managed node group would have placed it: only Karpenter's model
    shows the fault."""
    assert not _fits(name, "karpenter", WORKERS[name].cpu or "0", old_memory)[0]
    assert not _fits(name, "auto", WORKERS[name].cpu or "0", old_memory)[0]
    assert _fits(name, "managed", WORKERS[name].cpu or "0", old_memory)[0]


@pytest.mark.parametrize("name", ACCELERATED)
@pytest.mark.parametrize("provisioner", eksnodes.PROVISIONERS)
def test_worker_requests_fit_every_provisioner_with_the_daemonsets(name: str,
                                                                   provisioner: str) -> None:
    info = WORKERS[name]
    assert info.cpu and info.memory  # Guaranteed QoS needs both (requests = limits)
    fits, cpu_left, mem_left = _fits(name, provisioner, info.cpu, info.memory)
    assert fits, f"{name} on {provisioner}: {cpu_left} cpu, {mem_left / 2**30:.1f}Gi left"
    # the margin docs/operator.md states: at least 1.5 cores and 2Gi beyond the DaemonSets
    assert cpu_left >= Decimal("1.5") and mem_left >= 2 * 2**30


def test_every_worker_instance_type_is_modelled() -> None:
    assert set(ACCELERATED) <= set(INSTANCE_TYPES)


def test_hyperpod_nodes_carry_the_ml_name_and_health_labels() -> None:
    labels = eksnodes.node_labels("hp-0", instance_type("trn1.32xlarge"), "hyperpod", "workers")
    assert labels["node.kubernetes.io/instance-type"] == "ml.trn1.32xlarge"
    assert labels[eksnodes.HYPERPOD_HEALTH_LABEL] == "Schedulable"
    assert "karpenter.sh/nodepool" not in labels
    assert eksnodes.node_taints(instance_type("trn1.32xlarge"), "hyperpod") == []


def test_karpenter_nodes_carry_their_nodepool_topology_and_the_neuron_taint() -> None:
    trn1 = instance_type("trn1.32xlarge")
    labels = eksnodes.node_labels("k-0", trn1, "karpenter", "trainium")
    assert labels["karpenter.sh/nodepool"] == "trainium"
    assert labels["node.kubernetes.io/instance-type"] == "trn1.32xlarge"
    assert all(labels[key] for key in eksnodes.TOPOLOGY_LAYERS)
    assert eksnodes.node_taints(trn1, "karpenter") == [
        {"key": NEURON, "value": "true", "effect": "NoSchedule"}]
    # a managed node group taints nothing unless its author says so
    assert eksnodes.node_taints(trn1, "managed") == []
    assert eksnodes.node_taints(trn1, "managed", taint=True)[0]["key"] == NEURON


def test_auto_mode_nodes_name_their_attributes_as_auto_mode_does() -> None:
    """A NodePool or selector written for Auto Mode uses eks.amazonaws.com/ labels, one for
    community Karpenter karpenter.k8s.aws/: each pool carries only its own."""
    trn1 = instance_type("trn1.32xlarge")
    auto = eksnodes.node_labels("a-0", trn1, "auto", "trainium")
    karpenter = eksnodes.node_labels("k-0", trn1, "karpenter", "trainium")
    assert auto["eks.amazonaws.com/compute-type"] == "auto"
    assert auto["eks.amazonaws.com/instance-family"] == "trn1"
    assert "karpenter.k8s.aws/instance-family" not in auto
    assert karpenter["karpenter.k8s.aws/instance-family"] == "trn1"
    assert "eks.amazonaws.com/compute-type" not in karpenter


def test_an_unknown_provisioner_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="karpenter"):
        eksnodes.provisioner("fargate")


def test_docs_operator_md_tables_match_the_model_and_the_presets() -> None:
    """docs/operator.md's "Worker requests per provisioner" table is the model's figures."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "operator.md").read_text()
    rows = [line.split("|")[1:-1] for line in doc.splitlines()
            if line.startswith("| trn") or line.startswith("| p5")]
    table = {tuple(c.strip() for c in row[0].split(",")): [c.strip() for c in row[1:]]
             for row in rows if len(row) == 6}
    assert table, "the per-provisioner table is missing from docs/operator.md"
    for names, (managed, karpenter, _hyperpod, request, _left) in table.items():
        for name in names:
            itype = instance_type(name)
            for provisioner, cell in (("managed", managed), ("karpenter", karpenter)):
                alloc = eksnodes.node_resources(itype, provisioner).allocatable
                assert cell == f"{alloc['cpu']} / {alloc['memory']}", (name, provisioner)
            assert request == f"{WORKERS[name].cpu} / {WORKERS[name].memory}", name
