"""The workers' device environment (Neuron compiler and runtime, EFA), computed from the spec in
one place.

`worker_environment(spec, nnodes=...)` is a pure function: the launcher (`hlat-launch`) merges
its result into the environment before it execs torchrun, so every worker process, and the
neuronx-cc compiler they start, sees the same settings. It is the only source: the operator's
pods set none of these variables (one the pod does set is a deliberate override the launcher
keeps). Values and sources
(/shared/reference/neuron-eks.md, "Environment and flags used for LLaMA pretraining on trn1"):

- NEURON_CC_FLAGS: `spec.neuron.compilerFlags`, then `--enable-saturate-infinity` on trn1 only
  (trn1/trn1n; the flag is documented for trn1), `-O1` when activation checkpointing is
  selective and no `-O` level was given (recompute must survive the compiler's optimisations),
  and last `--cache_dir=<spec.neuron.cacheDir>`, a node-local path (never the shared volume: the
  paper saw timeouts there). A `--cache_dir` among compilerFlags is dropped: cacheDir is the one
  place to set it.
- NEURON_FUSE_SOFTMAX, NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS: from spec.neuron (paper 3.5).
- NEURON_RT_STOCHASTIC_ROUNDING_EN: 1 for precision bf16-sr, else 0; with SR on,
  NEURON_RT_STOCHASTIC_ROUNDING_SEED = train.seed, so runs are repeatable.
- MALLOC_ARENA_MAX=64; NEURON_RT_NUM_CORES = the instance's NeuronCores (32 on trn1.32xlarge,
  64 logical cores on trn2.48xlarge), as the public EKS manifests set it.
- NEURON_LOGICAL_NC_CONFIG = 2 on trn2 (its runtime default, stated so that it and the
  `lnc_size` the NxD backend passes cannot drift apart; logical-neuroncore-config.rst).
- NEURON_COMPILE_CACHE_URL = spec.neuron.cacheDir (the runtime's cache lookups, as --cache_dir
  is the compiler's).
- Multi-node on an instance with EFA (trn1, trn1n, trn2 and p5): FI_PROVIDER=efa,
  FI_EFA_USE_DEVICE_RDMA=1, FI_EFA_FORK_SAFE=1; on Neuron also CCOM_SOCKET_IFNAME=eth0. One
  node needs none of them.

CPU gets an empty mapping, CUDA only the EFA variables (NCCL over aws-ofi-nccl).

Compile-only (`spec.neuron.compileOnly`): `compile_command_prefix` returns
`["neuron_parallel_compile"]`, which the launcher puts in front of the torchrun line. That tool
runs the command once with graph extraction on (it sets NEURON_EXTRACT_GRAPHS_ONLY=1: tensors
hold dummy values, nothing executes on the device), then compiles every graph it saw in parallel
into the cache dir and exits. Run it with the same node count and parallel layout as the real
job (the graphs depend on both) and a handful of steps; the real run then finds every graph in
the cache (reference: pytorch-neuron-parallel-compile.rst).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from hlat_api import INSTANCE_TYPES, PretrainJobSpec
from hlat_trainer.backends import is_neuron, resolve_backend_name

PARALLEL_COMPILE: Final = "neuron_parallel_compile"
NEURON_SDK: Final = "2.30"
"""The Neuron SDK of the trainer image Dockerfile.trainer pins."""
NEURON_DRIVER_VERSION_FILE: Final = "/sys/module/neuron/version"
MIN_NEURON_DRIVER: Final = (2, 27)
"""The SDK 2.30 runtime needs a host driver newer than 2.26 (Neuron 2.30 release notes)."""
EXTRACT_GRAPHS_ONLY: Final = "NEURON_EXTRACT_GRAPHS_ONLY"
MALLOC_ARENA_MAX: Final = "64"
EFA_ENV: Final[Mapping[str, str]] = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
}


def logical_nc_size(instance_type: str) -> int:
    """Physical NeuronCores per logical one: 2 on trn2 (its default LNC=2), 1 on trn1."""
    return 2 if instance_type.startswith("trn2") else 1


def compiler_flags(spec: PretrainJobSpec) -> list[str]:
    """NEURON_CC_FLAGS as a list, in the order described in the module docstring."""
    n = spec.neuron
    flags = [f for f in n.compiler_flags if not f.startswith("--cache_dir")]
    if spec.instance_type.startswith("trn1") and "--enable-saturate-infinity" not in flags:
        flags.append("--enable-saturate-infinity")
    selective = spec.parallelism.activation_checkpointing == "selective"
    if selective and not any(f.startswith("-O") for f in flags):
        flags.append("-O1")
    flags.append(f"--cache_dir={n.cache_dir}")
    return flags


def worker_environment(spec: PretrainJobSpec, *, nnodes: int | None = None) -> dict[str, str]:
    """Environment for the worker processes of one node; `nnodes` defaults to `spec.nodes`
    (the launcher passes the operator's HLAT_NNODES)."""
    nnodes = spec.nodes if nnodes is None else nnodes
    info, backend = INSTANCE_TYPES[spec.instance_type], resolve_backend_name(spec)
    neuron = is_neuron(backend)
    env = neuron_runtime_environment(spec) if neuron else {}
    if nnodes > 1 and info.efa_interfaces > 0 and backend != "cpu":  # gloo uses TCP
        env.update(EFA_ENV)
        if neuron:
            env["CCOM_SOCKET_IFNAME"] = "eth0"
    return env


def neuron_runtime_environment(spec: PretrainJobSpec) -> dict[str, str]:
    """The Neuron compiler and runtime variables (any node count)."""
    n, info = spec.neuron, INSTANCE_TYPES[spec.instance_type]
    sr = spec.precision == "bf16-sr"
    env = {
        "NEURON_CC_FLAGS": " ".join(compiler_flags(spec)),
        "NEURON_COMPILE_CACHE_URL": n.cache_dir,
        "NEURON_FUSE_SOFTMAX": "1" if n.fuse_softmax else "0",
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": str(n.async_exec_max_inflight_requests),
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if sr else "0",
        "MALLOC_ARENA_MAX": MALLOC_ARENA_MAX,
        "NEURON_RT_NUM_CORES": str(info.ranks_per_node),
    }
    if sr:
        env["NEURON_RT_STOCHASTIC_ROUNDING_SEED"] = str(spec.train.seed)
    if spec.instance_type.startswith("trn2"):  # said explicitly: NxD's lnc_size must match it
        env["NEURON_LOGICAL_NC_CONFIG"] = str(logical_nc_size(spec.instance_type))
    return env


def check_neuron_driver(version: str | None) -> str | None:
    """What is wrong with the node's Neuron driver for the pinned image, or None.

    `version` is the kernel module's version (NEURON_DRIVER_VERSION_FILE, e.g. "2.26.5.0"),
    None when it cannot be read (then nothing is claimed: the runtime reports its own error).
    """
    if version is None:
        return None
    try:
        found = tuple(int(part) for part in version.strip().split(".")[:2])
    except ValueError:
        return f"cannot parse the Neuron driver version {version.strip()!r}"
    if found < MIN_NEURON_DRIVER:
        need = ".".join(map(str, MIN_NEURON_DRIVER))
        return (f"the node's Neuron driver is {version.strip()}, older than {need}, the oldest "
                f"the trainer image's Neuron SDK {NEURON_SDK} runtime supports: upgrade the "
                "aws-neuronx-dkms package on the nodes (or use a current EKS Neuron AMI)")
    return None


def compile_command_prefix(spec: PretrainJobSpec) -> list[str]:
    """`["neuron_parallel_compile"]` in compile-only mode, else `[]`.

    Raises ValueError when compile-only is asked of a backend that has no Neuron compiler.
    """
    if not spec.neuron.compile_only:
        return []
    backend = resolve_backend_name(spec)
    if backend != "neuron-xla":
        raise ValueError(
            f"spec.neuron.compileOnly needs backend neuron-xla (neuron_parallel_compile traces "
            f"torch-xla graphs), but the backend is {backend}: unset compileOnly"
        )
    return [PARALLEL_COMPILE]


def extracting_graphs_only(environ: Mapping[str, str]) -> bool:
    """True inside neuron_parallel_compile's extraction run: the trainer should skip
    checkpoint saves and anything that reads tensor values (they are dummies)."""
    return environ.get(EXTRACT_GRAPHS_ONLY, "") not in ("", "0")
