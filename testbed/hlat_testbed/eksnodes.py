"""EKS nodes as AWS provisions them: figures, labels and taints per instance type and provisioner.

Our rig's nodes once advertised allocatable = capacity (512Gi on a trn1.32xlarge), so a worker
asking for 480Gi was placed; on EKS the same worker is not placed everywhere. What a node offers
the scheduler depends on who made it, so each rig node is modelled for one provisioner:

- ``managed``: an EKS managed node group on the EKS-optimized AMI (AL2023, nodeadm). The kubelet
  reports the kernel's MemTotal as capacity and reserves, by amazon-eks-ami 81fec2e
  nodeadm/internal/kubelet/config.go: kube-reserved memory ``11 MiB x max-pods + 255 MiB``
  (:442), kube-reserved cpu 6% of the first core, 1% of the second, 0.5% of cores 3-4, 0.25% of
  the rest (:410-439), eviction-hard ``memory.available: 100Mi`` (:111); no system-reserved.
  MemTotal is not published per type: we take EC2's memory less 3.2%, what
  aws/karpenter-provider-aws#6509 reports for a real trn1.32xlarge (allocatable about 22Gi above
  Karpenter's 481,894Mi), inside the 1.7-5.3% pytorch/ci-infra#910 measured across a fleet. An
  estimate: no figure of ours depends on it, because Karpenter's is smaller.
- ``karpenter`` and ``auto`` (EKS Auto Mode runs Karpenter): Karpenter decides whether a pending
  pod gets a node from its own model, before any instance exists: memory less
  ``vmMemoryOverheadPercent`` (default 0.075), then the same kube-reserved and eviction figures.
  Its published table (karpenter-provider-aws 1d92708, website/content/en/docs/reference/
  instance-types.md) is reproduced exactly: trn1.32xlarge 127610m / 481894Mi / 247 pods,
  trn2.48xlarge and p5.48xlarge 191450m / 1938410Mi / 100 pods (tests/testbed/test_eksnodes.py).
  The rig's Karpenter nodes advertise that model: a pod that does not fit it never gets a node.
- ``hyperpod``: SageMaker HyperPod's EKS nodes. HyperPod publishes no reservation figures; we use
  the EKS AMI's (unverified). Its nodes are labelled ``node.kubernetes.io/instance-type:
  ml.<type>`` and ``sagemaker.amazonaws.com/node-health-status`` / ``deep-health-check-status``
  (docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-eks-resiliency-node-labels.html).

Taints: a managed node group and HyperPod taint nothing by default; AWS's Karpenter NodePools for
Neuron (and the EKS blueprints' Neuron node group) taint ``aws.amazon.com/neuron=true:NoSchedule``
and GPU pools ``nvidia.com/gpu``, so the rig's Karpenter/Auto pools do (``taint`` overrides).
``topology.k8s.aws/network-node-layer-1..3`` are EC2's instance-topology labels EKS sets on
trn1/trn2/p4d/p5 nodes: nodes of one pool share layers 1-2 here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from hlat_testbed.instancetypes import NEURON, NVIDIA_GPU, REGION, ZONE, InstanceType

Provisioner = Literal["managed", "karpenter", "auto", "hyperpod"]
PROVISIONERS: Final[tuple[Provisioner, ...]] = ("managed", "karpenter", "auto", "hyperpod")
DEFAULT_PROVISIONER: Final[Provisioner] = "managed"

KARPENTER_VM_OVERHEAD: Final = 0.075
"""Karpenter's default vmMemoryOverheadPercent (karpenter.sh/docs/reference/settings)."""
KERNEL_OVERHEAD: Final = 0.032
"""EC2 memory the kernel does not report as MemTotal (an estimate: see the module docstring)."""
EVICTION_HARD_MIB: Final = 100
"""nodeadm's evictionHard memory.available (config.go:111); Karpenter assumes the same."""
HYPERPOD_PREFIX: Final = "ml."
HYPERPOD_HEALTH_LABEL: Final = "sagemaker.amazonaws.com/node-health-status"
HYPERPOD_DEEP_HEALTH_LABEL: Final = "sagemaker.amazonaws.com/deep-health-check-status"
TOPOLOGY_LAYERS: Final = tuple(f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3))

DAEMONSET_OVERHEAD: Final = {"cpu_m": 280, "memory_mib": 376, "pods": 7}
"""What the DaemonSets of a real trn1.32xlarge Karpenter pool requested (VPC CNI, kube-proxy, the
Neuron and EFA device plugins, ...): the "daemonset overhead" Karpenter logged in
aws/karpenter-provider-aws#6509. A worker's requests must leave at least this."""


def kube_reserved_cpu_m(cpus: int) -> int:
    """nodeadm's getCPUMillicoresToReserve (config.go:410): 6%, 1%, 0.5%, 0.25% by range."""
    total, reserved = cpus * 1000, 0
    for start, end, basis_points in ((0, 1000, 600), (1000, 2000, 100), (2000, 4000, 50),
                                     (4000, total, 25)):
        if total > start:
            reserved += (min(total, end) - start) * basis_points // 10000
    return reserved


def kube_reserved_memory_mib(max_pods: int) -> int:
    """nodeadm's getMemoryMebibytesToReserve (config.go:442)."""
    return 11 * max_pods + 255


def memory_capacity_mib(itype: InstanceType, provisioner: Provisioner) -> int:
    """The memory capacity a node of this provisioner advertises (the kernel's, or for
    Karpenter the figure it schedules with before the instance exists)."""
    overhead = KARPENTER_VM_OVERHEAD if provisioner in ("karpenter", "auto") else KERNEL_OVERHEAD
    return int(itype.memory_mib * (1 - overhead))


@dataclass(frozen=True)
class NodeResources:
    """A node's ``status.capacity`` and ``status.allocatable``."""

    capacity: dict[str, str]
    allocatable: dict[str, str]


def node_resources(itype: InstanceType, provisioner: Provisioner) -> NodeResources:
    cap_mib = memory_capacity_mib(itype, provisioner)
    alloc_mib = cap_mib - kube_reserved_memory_mib(itype.pods) - EVICTION_HARD_MIB
    alloc_cpu_m = itype.cpu * 1000 - kube_reserved_cpu_m(itype.cpu)
    common = {"pods": str(itype.pods), "hugepages-1Gi": "0", "hugepages-2Mi": "0",
              **{k: str(v) for k, v in itype.extended.items()}}
    # nodeadm: kube-reserved ephemeral-storage 1Gi, eviction nodefs.available 10%
    capacity = {**common, "cpu": str(itype.cpu), "memory": f"{cap_mib}Mi",
                "ephemeral-storage": "1000Gi"}
    allocatable = {**common, "cpu": f"{alloc_cpu_m}m", "memory": f"{alloc_mib}Mi",
                   "ephemeral-storage": "899Gi"}
    return NodeResources(capacity, allocatable)


def instance_type_label(itype: InstanceType, provisioner: Provisioner) -> str:
    """The ``node.kubernetes.io/instance-type`` value: ``ml.<type>`` on HyperPod."""
    return HYPERPOD_PREFIX + itype.name if provisioner == "hyperpod" else itype.name


def node_labels(name: str, itype: InstanceType, provisioner: Provisioner,
                pool: str = "default") -> dict[str, str]:
    shown = instance_type_label(itype, provisioner)
    labels = {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": shown,
        "beta.kubernetes.io/instance-type": shown,
        "topology.kubernetes.io/region": REGION, "topology.kubernetes.io/zone": ZONE,
        "topology.k8s.aws/zone-id": "usw2-az4",
        TOPOLOGY_LAYERS[0]: f"nn-{pool[:8]}-l1", TOPOLOGY_LAYERS[1]: f"nn-{pool[:8]}-l2",
        TOPOLOGY_LAYERS[2]: f"nn-{name[-12:]}",
    }
    if provisioner == "managed":
        labels.update({"eks.amazonaws.com/nodegroup": pool,
                       "eks.amazonaws.com/capacityType": "ON_DEMAND"})
    elif provisioner in ("karpenter", "auto"):
        labels.update({"karpenter.sh/nodepool": pool, "karpenter.sh/capacity-type": "on-demand",
                       "karpenter.sh/registered": "true", "karpenter.sh/initialized": "true"})
        # Auto Mode names the instance attributes under eks.amazonaws.com/, community Karpenter
        # under karpenter.k8s.aws/ (docs.aws.amazon.com/eks/latest/userguide/
        # create-node-pool.html, "EKS Auto Mode Supported Labels"); only Auto Mode sets
        # eks.amazonaws.com/compute-type=auto (associate-workload.html)
        family = itype.name.split(".")[0]
        if provisioner == "auto":
            labels.update({"eks.amazonaws.com/compute-type": "auto",
                           "eks.amazonaws.com/instance-family": family})
        else:
            labels["karpenter.k8s.aws/instance-family"] = family
    else:
        labels.update({HYPERPOD_HEALTH_LABEL: "Schedulable",
                       HYPERPOD_DEEP_HEALTH_LABEL: "Passed"})
    return labels


def node_taints(itype: InstanceType, provisioner: Provisioner,
                taint: bool | None = None) -> list[dict[str, str]]:
    """The accelerator taints of the pool (``taint`` None: the provisioner's usual choice)."""
    if taint is None:
        taint = provisioner in ("karpenter", "auto")
    if not taint:
        return []
    if NEURON in itype.extended:
        return [{"key": NEURON, "value": "true", "effect": "NoSchedule"}]
    if NVIDIA_GPU in itype.extended:
        return [{"key": NVIDIA_GPU, "value": "true", "effect": "NoSchedule"}]
    return []


def provisioner(name: str) -> Provisioner:
    """`name` checked against the known provisioners (an error lists them)."""
    for known in PROVISIONERS:
        if name == known:
            return known
    raise ValueError(f"unknown provisioner {name!r}; known: {', '.join(PROVISIONERS)}")
