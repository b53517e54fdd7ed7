"""The workers' device environment (Neuron compiler and runtime, EFA), computed from the spec in
one place.

`worker_environment(spec, nnodes=...)` is a pure function: the launcher (`hlat-launch`) merges
its result into the environment before it starts the workers, so every worker process, and the
neuronx-cc compiler they start, sees the same settings. It is the only source: the operator's
pods set none of these variables (one the pod does set is a deliberate override the launcher
keeps). Values and sources (docs/neuron.md, "The workers' environment", has the table):

- NEURON_CC_FLAGS: `spec.neuron.compilerFlags` (default the paper's `--model-type=transformer
  --distribution-strategy=llm-training`), then `--cache_dir=<spec.neuron.cacheDir>`. A
  `--cache_dir` among compilerFlags is dropped: cacheDir is the one place to set it. Nothing
  else is added: no `-O1` for selective recompute (NxD wraps checkpointed modules in torch-xla's
  checkpoint, which puts an optimization barrier in front of the recompute, so the compiler
  cannot merge it away; the paper's scripts ran selective checkpointing without -O1), and no
  `--enable-saturate-infinity` (not in the paper's scripts; the compiler reference says it may
  cost performance; the NxD model masks with the dtype's minimum, not -inf). Either can be put in
  compilerFlags.
- NEURON_COMPILE_CACHE_URL = cacheDir as well: `--cache_dir` wins over it when both are set
  (neuron-caching.rst:116), so naming the same node-local path in both keeps one truth for every
  tool that reads either. A shared cache is not an s3:// URL here but `neuron.sharedCacheDir`,
  copied in and out by `hlat_trainer.compile_cache`.
- NEURON_RT_EXEC_TIMEOUT: `spec.neuron.execTimeoutSeconds` (4000, the paper's scripts); the
  runtime's default (30 s in configuration-guide.rst, 600 s for trn1 in nrt-developer-guide.rst)
  times out the peers of a node still compiling a graph their collective waits on.
- XLA_DISABLE_FUNCTIONALIZATION=0: torch-neuronx defaults it to 1, under which split and offset
  views can give wrong values (pytorch/xla#8640, #7859: torch.split along dim 1 of a 2-D tensor,
  how the NxD model separates Q/K/V and gate/up); AWS's 70B NxD scripts set 0
  (neuronx-distributed examples/training/llama/tp_pp_llama_hf_pretrain/
  run_llama2_70B_tp_pp.sh:17-18).
- NEURON_FUSE_SOFTMAX, NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS: from spec.neuron (paper 3.5).
- NEURON_RT_STOCHASTIC_ROUNDING_EN: 1 for precision bf16-sr, else 0; with SR on,
  NEURON_RT_STOCHASTIC_ROUNDING_SEED = train.seed, so runs are repeatable.
- MALLOC_ARENA_MAX=64; NEURON_RT_NUM_CORES = the instance's NeuronCores (32 on trn1.32xlarge,
  64 logical cores on trn2.48xlarge), as the public EKS manifests set it.
- NEURON_LOGICAL_NC_CONFIG = 2 on trn2 (its runtime default, stated so that it and the
  `lnc_size` the NxD backend passes cannot drift apart; logical-neuroncore-config.rst).
- Multi-node on an instance with EFA (trn1, trn1n, trn2 and p5): FI_PROVIDER=efa,
  FI_EFA_USE_DEVICE_RDMA=1, FI_EFA_FORK_SAFE=1; on Neuron also CCOM_SOCKET_IFNAME=eth0. One
  node needs none of them.
- NEURON_RT_ROOT_COMM_ID (multi-node Neuron): `root_comm_id`, per attempt, not here: it needs
  node rank 0's IP, resolved when the attempt starts.

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

import re
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from hlat_api import INSTANCE_TYPES, PretrainJobSpec
from hlat_api.labels import NEURON_ROOT_COMM_PORT, NEURON_ROOT_COMM_PORTS
from hlat_api.presets import ultraserver_group_size
from hlat_trainer.backends import is_neuron, resolve_backend_name

PARALLEL_COMPILE: Final = "neuron_parallel_compile"
NEURON_SDK: Final = "2.30"
"""The Neuron SDK of the trainer image Dockerfile.trainer pins."""
NEURON_DRIVER_VERSION_FILE: Final = "/sys/module/neuron/version"
NEURON_DRIVER_FILE_ENV: Final = "HLAT_NEURON_DRIVER_FILE"
"""A pod's own choice of the driver version file (the pod sets it, not the operator: a
template may): checked whatever the backend (the local cluster's per-node stand-in for sysfs,
or sysfs mounted elsewhere)."""
MIN_NEURON_DRIVER: Final = (2, 27)
"""The SDK 2.30 runtime needs a host driver newer than 2.26 (Neuron 2.30 release notes)."""
EXTRACT_GRAPHS_ONLY: Final = "NEURON_EXTRACT_GRAPHS_ONLY"
MALLOC_ARENA_MAX: Final = "64"
EFA_ENV: Final[Mapping[str, str]] = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
}
ROOT_COMM_ID: Final = "NEURON_RT_ROOT_COMM_ID"
CACHE_URL: Final = "NEURON_COMPILE_CACHE_URL"
SHARED_CACHE_NAME: Final = ".neuron-compile-cache"
"""Default shared cache: `<checkpoint.dir>/.neuron-compile-cache`, beside the jobs' checkpoint
directories (a dot name is never a job name) and shared by the jobs there: an entry's key is
the compiler version, the graph and the flags, so jobs reuse each other's graphs safely."""
RESOLVE_SECONDS: Final = 120.0
"""How long the launcher tries to resolve node rank 0's address (its pod may have no IP yet)."""


def logical_nc_size(instance_type: str) -> int:
    """Physical NeuronCores per logical one: 2 on trn2 (its default LNC=2), 1 on trn1."""
    return 2 if instance_type.startswith("trn2") else 1


def compiler_flags(spec: PretrainJobSpec) -> list[str]:
    """NEURON_CC_FLAGS as a list: the spec's flags, then the node-local cache dir."""
    n = spec.neuron
    flags = [f for f in n.compiler_flags if not f.startswith("--cache_dir")]
    flags.append(f"--cache_dir={n.cache_dir}")
    return flags


def worker_environment(spec: PretrainJobSpec, *, nnodes: int | None = None) -> dict[str, str]:
    """Environment for the worker processes of one node; `nnodes` defaults to `spec.nodes`
    (the launcher passes the operator's HLAT_NNODES)."""
    nnodes = spec.nodes if nnodes is None else nnodes
    info, backend = INSTANCE_TYPES[spec.instance_type], resolve_backend_name(spec)
    neuron = is_neuron(backend)
    env = neuron_runtime_environment(spec) if neuron else {}
    if spec.instance_type == "cpu":
        # the rig's stand-in node: one core per rank. Torch sizes a process's thread pool by
        # the host's cores, and the rig runs several nodes on one host: with a pool each, one
        # node's compute time would depend on what the others do (a paused node speeding up
        # its neighbours), which no real node's does. torchrun sets the same with nproc > 1.
        env["OMP_NUM_THREADS"] = "1"
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
        CACHE_URL: n.cache_dir,
        "NEURON_RT_EXEC_TIMEOUT": str(n.exec_timeout_seconds),
        "XLA_DISABLE_FUNCTIONALIZATION": "0",
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


def shared_cache_dir(spec: PretrainJobSpec) -> str | None:
    """Where the shared copy of the compile cache lives, or None when it is not used (off in
    the spec, or a backend without the Neuron compiler)."""
    if not spec.neuron.share_cache or not is_neuron(resolve_backend_name(spec)):
        return None
    if spec.neuron.shared_cache_dir is not None:
        return spec.neuron.shared_cache_dir
    return f"{spec.checkpoint.dir.rstrip('/')}/{SHARED_CACHE_NAME}"


def cache_url_conflict(env: Mapping[str, str], spec: PretrainJobSpec) -> str | None:
    """What is wrong when the pod's own NEURON_COMPILE_CACHE_URL would be silently ignored:
    the launcher's NEURON_CC_FLAGS names `--cache_dir`, which the compiler's wrapper prefers
    (neuron-caching.rst:116). None when nothing conflicts (no such variable, the same path, or
    the pod also sets NEURON_CC_FLAGS itself and so decides both)."""
    url = env.get(CACHE_URL)
    if url is None or "NEURON_CC_FLAGS" in env or url.rstrip("/") == spec.neuron.cache_dir.rstrip("/"):
        return None
    return (f"${CACHE_URL}={url} is set in the pod but would be ignored: the workers' "
            f"NEURON_CC_FLAGS carry --cache_dir={spec.neuron.cache_dir} (spec.neuron.cacheDir), "
            "which the Neuron compiler prefers. Remove the variable; set spec.neuron.cacheDir "
            "for the node-local cache and spec.neuron.sharedCacheDir for a copy shared by the "
            "job's nodes")


class RootCommError(RuntimeError):
    """Node rank 0's address did not resolve to an IP in time; the message names it."""


Resolver = Callable[..., list[tuple[Any, ...]]]


def resolve_ip(host: str, *, bound: float | None = None, resolve: Resolver | None = None,
               sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> str:
    """`host`'s first address, retried (a pod's DNS record exists only once it has an IP) for
    at most `bound` seconds (RESOLVE_SECONDS); an IP is returned as it is."""
    bound = RESOLVE_SECONDS if bound is None else bound
    resolve = resolve or socket.getaddrinfo
    deadline, pause = clock() + bound, 0.5
    while True:
        try:
            return str(resolve(host, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError) as err:
            left = deadline - clock()
            if left <= 0:
                raise RootCommError(
                    f"cannot resolve node rank 0's address {host!r} ($HLAT_MASTER_ADDR) to an IP "
                    f"within {bound:.0f}s ({err}); the Neuron runtime's root communicator "
                    f"({ROOT_COMM_ID}) needs <ip>:<port>. Is the job's headless Service there "
                    "and node rank 0's pod scheduled?") from None
            sleep(min(pause, left))
            pause = min(pause * 2, 5.0)


def root_comm_port(attempt: int) -> int:
    """The root communicator's port of an attempt: one of the pod's reserved ports
    (`hlat_api.labels.NEURON_RESERVED_PORTS`), a different one for consecutive attempts."""
    return NEURON_ROOT_COMM_PORT + attempt % NEURON_ROOT_COMM_PORTS


def root_comm_id(master_addr: str, attempt: int, **resolve_kw: Any) -> str:
    """NEURON_RT_ROOT_COMM_ID for an attempt: `<ip>:<port>` of node rank 0.

    The runtime wants an IP address (nrt-developer-guide.rst:1062-1064: "<ip_address:port>",
    mandatory with collectives). Left unset, torch-xla v2.9.0 sets `MASTER_ADDR:62182`
    (torch_xla/_internal/neuron.py:16-37): our MASTER_ADDR is a DNS name (the headless Service)
    and 62182 the same port in every attempt. IPv6 gets brackets, as torch-xla writes it."""
    ip = resolve_ip(master_addr, **resolve_kw)
    host = f"[{ip}]" if ":" in ip else ip
    return f"{host}:{root_comm_port(attempt)}"


NEURON_DEVICE_SYSFS: Final = "/sys/class/neuron_device"
NEURON_DEVICE_SYSFS_ENV: Final = "HLAT_NEURON_DEVICE_SYSFS"
"""A pod's own choice of where the driver's UltraServer files are (as NEURON_DRIVER_FILE_ENV)."""
ULTRASERVER_NODE_CONFIG: Final = "NEURON_ULTRASERVER_NODE_CONFIG"
"""AWS's knob for the nodes one UltraServer group gives a job: 4, 2 or 1 (ultraserver.rst
91-93); here its default is the largest of them that divides the job's node count."""
_MODE_X4, _MODE_X2H, _MODE_X2V, _MODE_X1 = 1, 2, 3, 4
"""The driver's `neuron_ultraserver_mode` values (aws-neuron-sdk
src/libnrt/include/ndl/neuron_driver_shared.h 45-50, and k8s-ultraserver-init-script.sh's
constants)."""


class UltraServerError(ValueError):
    """This node cannot take its part in the job's UltraServer configuration."""


def ultraserver_node_config(nnodes: int, env: Mapping[str, str]) -> int:
    """The nodes per UltraServer group: NEURON_ULTRASERVER_NODE_CONFIG where the pod sets it,
    else the largest of 4, 2 and 1 that divides `nnodes` (AWS's init script requires a
    multiple, and defaults to 4)."""
    raw = env.get(ULTRASERVER_NODE_CONFIG, "").strip()
    if not raw:
        return ultraserver_group_size(nnodes)
    if raw not in ("1", "2", "4"):
        raise UltraServerError(f"{ULTRASERVER_NODE_CONFIG}={raw}: must be 1, 2 or 4")
    config = int(raw)
    if nnodes % config:
        raise UltraServerError(f"{nnodes} nodes are not a multiple of {ULTRASERVER_NODE_CONFIG}"
                               f"={config}: set nodes to one, or the config to 2 or 1")
    return config


def ultraserver_environment(node_rank: int, nnodes: int, master_addr: str,
                            env: Mapping[str, str], sysfs: Path | None = None
                            ) -> dict[str, str]:
    """The Neuron runtime's UltraServer variables for one node of an attempt, as AWS's
    k8s-ultraserver-init-script.sh writes them into each worker's /etc/environment (aws-neuron-
    sdk src/k8/, read at 3afa0fd): the node's server and node id in its N-node group from the
    driver's `server_id_N` and `node_id_N`, the mode from the modes the driver lists in
    `ultraserver_mode` (4 nodes: X4; 2: X2V, else X2H; 1: X1), the node's place in the job
    (`NEURON_GLOBAL_TOPOID`: the script's index in (server id, node id) order, here the node
    rank, which follows that order when spec.scheduling.topology's levels are the UltraServer
    labels, docs/operator.md) and node rank 0's address. Refused, naming what to fix, where the
    driver has no N-node group for this node, or its node id is not the one its rank needs
    (the gang not placed on whole groups in order: AWS's script refuses it too)."""
    root = sysfs or Path(env.get(NEURON_DEVICE_SYSFS_ENV) or NEURON_DEVICE_SYSFS)
    config = ultraserver_node_config(nnodes, env)

    def read(name: str, default: str) -> str:
        try:
            return (root / name).read_text().strip() or default
        except OSError:
            return default

    modes = {int(v) for v in re.split(r"[\s,_]+", read("ultraserver_mode", "")) if v.isdigit()}
    wanted = {4: (_MODE_X4,), 2: (_MODE_X2V, _MODE_X2H), 1: (_MODE_X1,)}[config]
    mode = next((m for m in wanted if m in modes or config == 1), None)
    if mode is None:
        raise UltraServerError(f"this node's driver does not offer the {config}-node "
                               f"UltraServer config (modes {sorted(modes) or 'none'} in "
                               f"{root / 'ultraserver_mode'}): is it a trn2u.48xlarge node?")
    server = read(f"server_id_{config}", "0000000000000000")
    node = read(f"node_id_{config}", "-1")
    if config > 1:
        if server.strip("0") == "":
            raise UltraServerError(f"this node has no {config}-node UltraServer group "
                                   f"({root / f'server_id_{config}'} missing)")
        if node != str(node_rank % config):
            raise UltraServerError(
                f"node rank {node_rank} is on node id {node} of its {config}-node UltraServer "
                f"group, not {node_rank % config}: the gang must take whole groups, ranks in "
                "(server id, node id) order (spec.scheduling.topology with levels "
                f"[neuron.amazonaws.com/ultraserver-server-id-{config}, "
                f"neuron.amazonaws.com/ultraserver-node-id-{config}])")
    return {"NEURON_GLOBAL_TOPOID": str(node_rank), "NEURON_GLOBAL_TOPOID0_HOST": master_addr,
            "NEURON_RT_ULTRASERVER_MODE": str(mode), "NEURON_RT_ULTRASERVER_SERVER_ID": server,
            "NEURON_RT_ULTRASERVER_NODE_ID": node}


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


NEURON_HW_ERRORS: Final = (
    "NRT_EXEC_HW_ERR_COLLECTIVES", "NRT_EXEC_HW_ERR_HBM_UE", "NRT_EXEC_HW_ERR_NC_UE",
    "NRT_EXEC_HW_ERR_DMA_ABORT", "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE", "NRT_HW_ERROR",
    "NEURON_HW_ERR=",
)
"""What names a Neuron device fault in an error the runtime raised: the runtime's hardware
status codes (NRT_STATUS 1200-1205: collectives hang on a hardware error, HBM or NeuronCore
uncorrectable error, DMA abort; NRT_HW_ERROR 6: the device failed to initialise;
aws-neuron/aws-neuron-sdk, neuron-runtime/nrt-api-guide.rst, the NRT_STATUS table) and the
driver's kernel line the EKS node monitoring agent matches (aws/eks-node-monitoring-agent,
monitors/neuron/monitor.go: `NEURON_HW_ERR=HBM_UNCORRECTABLE_ERROR`, `...=DMA_ERROR`)."""


def neuron_device_error(message: str) -> str | None:
    """The Neuron hardware error an exception's text names, or None: such a failure is the
    node's (`ExitCode.NODE_FAULT`), and a restart on the same device would repeat it."""
    return next((code for code in NEURON_HW_ERRORS if code in message), None)


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
