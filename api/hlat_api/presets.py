"""Model presets and instance types: the facts validation needs, as plain data.

Kept apart from the spec models so the operator, the trainer and the docs read one table.
Model dimensions follow the published LLaMA family (7b is LLaMA-2-7B, 70b is LLaMA-2-70B with
grouped-query attention); `tiny` exists for tests and the CPU demo.
Instance facts come from ../shared/reference/neuron-eks.md: a "rank" is one trainer process
(one NeuronCore on Trainium, one GPU on p5, one process on `cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

ModelPreset = Literal["tiny", "125m", "1b", "7b", "70b"]
InstanceType = Literal[
    "trn1.2xlarge", "trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge", "trn2u.48xlarge",
    "p5.48xlarge", "cpu"
]


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a LLaMA-style decoder."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    def param_count(self) -> int:
        """Parameters of the decoder (untied embedding and output head, no biases)."""
        h, kv_dim = self.hidden_size, self.kv_heads * self.head_dim
        attn = h * (h + 2 * kv_dim) + h * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        return self.layers * per_layer + 2 * self.vocab_size * h + h

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params + attention scores (PaLM appendix B)."""
        non_embedding = self.param_count() - self.vocab_size * self.hidden_size
        return 6.0 * non_embedding + 12.0 * self.layers * self.hidden_size * seq_len


MODEL_PRESETS: Final[dict[str, ModelDims]] = {
    "tiny": ModelDims(128, 4, 4, 2, 384, 4096, 1024),
    "125m": ModelDims(768, 12, 12, 12, 2048, 32000, 2048),
    "1b": ModelDims(2048, 16, 32, 8, 8192, 32000, 4096, rope_theta=500000.0),
    "7b": ModelDims(4096, 32, 32, 32, 11008, 32000, 4096),
    "70b": ModelDims(8192, 80, 64, 8, 28672, 32000, 4096),
}


PAPER_TENSOR_PARALLEL: Final[dict[str, int]] = {"7b": 8, "70b": 32}
"""The tensor-parallel degree of the HLAT paper's runs on trn1.32xlarge (section 3.5 and
awslabs/HLAT's scripts): the default `parallelism.tensor` for these presets. On Neuron
instance types these presets also default to the scripts' sequence parallelism and selective
activation checkpointing (7b/ and 70b/tp_zero1_llama2_*_hf_pretrain.sh pass
--sequence_parallel_enabled and --selective_checkpoint_enabled), and the 70B scripts' pipeline
degree of 8 (70b/tp_zero1_llama2_70b_hf_pretrain.sh, PP_DEGREE=8) is the one part of their
layout that `parallelism.pipeline` cannot take yet."""

PAPER_PRECISION: Final[dict[str, str]] = {"7b": "bf16-sr", "70b": "mixed"}
"""The precision each preset ran in (awslabs/HLAT): 7b/tp_zero1_llama2_7b_hf_pretrain.sh is
pure BF16 with stochastic rounding (XLA_USE_BF16=1, NEURON_RT_STOCHASTIC_ROUNDING_EN=1, no
ZeRO-1); 70b/tp_zero1_llama2_70b_hf_pretrain.sh is ZeRO-1 with fp32 master weights and
autocast, SR off (NEURON_RT_STOCHASTIC_ROUNDING_EN=0, XLA_DOWNCAST_BF16=1, USE_ZERO_1=1,
USE_MASTER_WEIGHTS_ZERO_1=1, USE_GRAD_ACC_HOOK=1, AMP_ENABLED=1): our `mixed`. The default
`precision` of these presets; every other preset defaults to bf16-sr."""


@dataclass(frozen=True)
class InstanceInfo:
    """What one node of an instance type offers a PretrainJob."""

    ranks_per_node: int  # trainer processes per node (torchrun --nproc-per-node)
    device_memory_gib: float | None  # accelerator memory per rank; None: not checked
    neuron_devices: int  # aws.amazon.com/neuron requested per pod
    efa_interfaces: int  # vpc.amazonaws.com/efa requested per pod
    gpus: int = 0  # nvidia.com/gpu requested per pod
    peak_tflops_per_rank: float | None = None  # dense BF16, for MFU
    cpu: str | None = None  # cpu request = limit of the trainer container (Guaranteed QoS)
    memory: str | None = None  # memory request = limit of the trainer container


# cpu/memory: what fits one worker on a node of the type whoever provisioned it, with requests =
# limits (Guaranteed QoS, the last class the kubelet evicts). The binding figure is Karpenter's
# (also EKS Auto Mode's): it launches a node only for pods that fit its model of the type,
# karpenter-provider-aws website/content/en/docs/reference/instance-types.md (1d92708):
# trn1(n).32xlarge 127610m / 481894Mi, trn2.48xlarge and p5.48xlarge 191450m / 1938410Mi,
# trn1.2xlarge 7910m / 29317Mi; managed node groups (EKS AMI) and HyperPod offer more. The margin
# left is far above the DaemonSets a real trn1 pool ran (280m, 376Mi: aws/karpenter-provider-aws
# #6509): trn1(n).32xlarge 7.6 cores / 30.6Gi, trn2 and p5 7.4 cores / 43Gi, trn1.2xlarge 1.9 cores
# / 2.6Gi. AWS's own trn1 manifests ask for 440Gi (awsome-distributed-training). The model and
# the table per provisioner: hlat_testbed.eksnodes, docs/operator.md "Worker requests".
INSTANCE_TYPES: Final[dict[str, InstanceInfo]] = {
    # trn1: 16 Trainium chips = 32 NeuronCores of 16 GiB HBM, 95 TFLOPS BF16 each (paper, section 2)
    # trn1.2xlarge: 8 vCPU, 32 GiB; trn1(n).32xlarge: 128 vCPU, 512 GiB
    "trn1.2xlarge": InstanceInfo(2, 16.0, 1, 0, peak_tflops_per_rank=95.0,
                                 cpu="6", memory="26Gi"),
    "trn1.32xlarge": InstanceInfo(32, 16.0, 16, 8, peak_tflops_per_rank=95.0,
                                  cpu="120", memory="440Gi"),
    "trn1n.32xlarge": InstanceInfo(32, 16.0, 16, 16, peak_tflops_per_rank=95.0,
                                   cpu="120", memory="440Gi"),
    # trn2: 16 Trainium2 chips, 96 GiB each, 4 logical NeuronCores per chip (LNC=2);
    # 192 vCPU, 2 TiB
    "trn2.48xlarge": InstanceInfo(64, 24.0, 16, 16, peak_tflops_per_rank=167.0,
                                  cpu="184", memory="1850Gi"),
    # trn2u.48xlarge: a trn2.48xlarge in an UltraServer of 4 joined by NeuronLink (Neuron's
    # trn2-arch.rst lists both in one column; EC2: 192 vCPU, 2048 GiB). Karpenter lists no
    # trn2u, so its allocatable is taken as trn2.48xlarge's (an inference:
    # docs/ultraserver-notes.md); the launcher adds the runtime's UltraServer variables
    # (neuron_env.ultraserver_environment)
    "trn2u.48xlarge": InstanceInfo(64, 24.0, 16, 16, peak_tflops_per_rank=167.0,
                                   cpu="184", memory="1850Gi"),
    # p5.48xlarge: 192 vCPU, 2 TiB
    "p5.48xlarge": InstanceInfo(8, 80.0, 0, 32, gpus=8, peak_tflops_per_rank=989.0,
                                cpu="184", memory="1850Gi"),
    # the local rig and CI: no requests (BestEffort) unless the template sets them
    "cpu": InstanceInfo(1, None, 0, 0),
}

ULTRASERVER_INSTANCE_TYPES: Final = frozenset({"trn2u.48xlarge"})
"""Instance types that come in UltraServers: 4 nodes whose chips NeuronLink joins."""


def ultraserver_group_size(nodes: int) -> int:
    """The nodes per UltraServer group a job of `nodes` runs in by default: the largest of 4,
    2 and 1 that divides it (AWS's init script requires a multiple)."""
    return next(n for n in (4, 2, 1) if nodes % n == 0)


HYPERPOD_PREFIX: Final = "ml."
"""SageMaker HyperPod names instance types `ml.<type>` and labels its EKS nodes so
(`node.kubernetes.io/instance-type: ml.trn1.32xlarge`): `instanceType` takes either name."""
HYPERPOD_INSTANCE_TYPES: Final[tuple[str, ...]] = tuple(
    HYPERPOD_PREFIX + name for name in INSTANCE_TYPES if name != "cpu")


def canonical_instance_type(name: str) -> str:
    """`ml.trn1.32xlarge` -> `trn1.32xlarge`; any other name unchanged."""
    if name in HYPERPOD_INSTANCE_TYPES:
        return name.removeprefix(HYPERPOD_PREFIX)
    return name
