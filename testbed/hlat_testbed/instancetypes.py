"""What a node of each supported instance type advertises to the scheduler.

The operator requests a node's full Neuron devices and EFA interfaces, so the rig's nodes must
carry the same extended resources, labels and sizes as EKS nodes with the Neuron and EFA device
plugins installed. Numbers are AWS's published shapes; ``pods`` is EKS's max-pods for the type.
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
    memory_gi: int
    pods: int
    extended: dict[str, int] = field(default_factory=dict)

    def capacity(self) -> dict[str, str]:
        """Node ``status.capacity`` (allocatable is the same: nothing is reserved here)."""
        cap = {"cpu": str(self.cpu), "memory": f"{self.memory_gi}Gi", "pods": str(self.pods),
               "ephemeral-storage": "1000Gi", "hugepages-1Gi": "0", "hugepages-2Mi": "0"}
        cap.update({k: str(v) for k, v in self.extended.items()})
        return cap


INSTANCE_TYPES = {
    t.name: t
    for t in (
        InstanceType("trn1.32xlarge", 128, 512, 247, {NEURON: 16, NEURONCORE: 32, EFA: 8}),
        InstanceType("trn1n.32xlarge", 128, 512, 247, {NEURON: 16, NEURONCORE: 32, EFA: 16}),
        InstanceType("trn1.2xlarge", 8, 32, 58, {NEURON: 1, NEURONCORE: 2}),
        InstanceType("trn2.48xlarge", 192, 2048, 737, {NEURON: 16, NEURONCORE: 64, EFA: 16}),
        InstanceType("p4d.24xlarge", 96, 1152, 737, {NVIDIA_GPU: 8, EFA: 4}),
        InstanceType("m5.large", 2, 8, 29),
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
