"""The facts of each supported EC2 instance type that an EKS node's figures are computed from.

The operator requests a node's full Neuron devices and EFA interfaces, so the rig's nodes carry
the same extended resources as EKS nodes with the Neuron and EFA device plugins installed. What a
node advertises for cpu, memory and pods depends also on who provisioned it (managed node group,
Karpenter / EKS Auto Mode, SageMaker HyperPod): that model is eksnodes.py; this module holds
only what EC2 publishes per type.

Sources (cited once here, per figure below):
- vCPUs and memory: karpenter-provider-aws 1d92708, website/content/en/docs/reference/
  instance-types.md, labels `karpenter.k8s.aws/instance-cpu` and `instance-memory` (MiB, from
  EC2 DescribeInstanceTypes), e.g. trn1.32xlarge 128 / 524288 (lines 36708-36743).
- max pods: amazon-eks-ami 81fec2e, nodeadm/internal/kubelet/eni_max_pods.go:75
  (ENIs x (IPv4 per ENI - 1) + 2) over nodeadm/internal/kubelet/instance-info.jsonl
  (trn1.32xlarge 5 ENIs x 50 -> 247; trn2.48xlarge and p5.48xlarge 2 x 50 -> 100); the same
  figures as Karpenter's `pods` column.
- Neuron devices / cores, GPUs, EFA: the `Resources` rows of the same Karpenter page
  (trn2.48xlarge: 16 devices, 128 `aws.amazon.com/neuroncore`, 16 EFA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NEURON = "aws.amazon.com/neuron"
NEURONCORE = "aws.amazon.com/neuroncore"
EFA = "vpc.amazonaws.com/efa"
NVIDIA_GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class InstanceType:
    name: str
    cpu: int
    """vCPUs (karpenter.k8s.aws/instance-cpu)."""
    memory_mib: int
    """EC2's memory size in MiB (karpenter.k8s.aws/instance-memory); the kernel sees less."""
    pods: int
    """EKS max pods for the type (nodeadm's ENI formula)."""
    extended: dict[str, int] = field(default_factory=dict)

    @property
    def memory_gi(self) -> int:
        return self.memory_mib // 1024

    def capacity(self) -> dict[str, str]:
        """The type's devices and pods with its nominal cpu and memory (no provisioner's
        model applied: see eksnodes.node_resources for what a node really advertises)."""
        cap = {"cpu": str(self.cpu), "memory": f"{self.memory_mib}Mi", "pods": str(self.pods),
               "ephemeral-storage": "1000Gi", "hugepages-1Gi": "0", "hugepages-2Mi": "0"}
        cap.update({k: str(v) for k, v in self.extended.items()})
        return cap


INSTANCE_TYPES = {
    t.name: t
    for t in (
        InstanceType("trn1.32xlarge", 128, 524288, 247, {NEURON: 16, NEURONCORE: 32, EFA: 8}),
        InstanceType("trn1n.32xlarge", 128, 524288, 247, {NEURON: 16, NEURONCORE: 32, EFA: 16}),
        InstanceType("trn1.2xlarge", 8, 32768, 58, {NEURON: 1, NEURONCORE: 2}),
        InstanceType("trn2.48xlarge", 192, 2097152, 100,
                     {NEURON: 16, NEURONCORE: 128, EFA: 16}),
        # trn2u.48xlarge (in UltraServers) is on neither Karpenter's page nor nodeadm's list:
        # EC2's spec page gives the same 192 vCPU and 2048 GiB as trn2.48xlarge and 16 network
        # cards (https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html); its devices
        # and max pods are taken as trn2.48xlarge's (inferred: docs/ultraserver-notes.md)
        InstanceType("trn2u.48xlarge", 192, 2097152, 100,
                     {NEURON: 16, NEURONCORE: 128, EFA: 16}),
        InstanceType("p5.48xlarge", 192, 2097152, 100, {NVIDIA_GPU: 8, EFA: 32}),
        InstanceType("p4d.24xlarge", 96, 1179648, 737, {NVIDIA_GPU: 8, EFA: 4}),
        InstanceType("m5.large", 2, 8192, 29),
    )
}
DEFAULT_INSTANCE_TYPE = "trn1.32xlarge"
REGION = "us-west-2"
ZONE = "us-west-2d"


def instance_type(name: str) -> InstanceType:
    try:
        return INSTANCE_TYPES[name]
    except KeyError:
        known = ", ".join(sorted(INSTANCE_TYPES))
        raise ValueError(f"unknown instance type {name!r}; known: {known}") from None
