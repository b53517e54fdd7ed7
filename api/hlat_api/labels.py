"""Names the operator puts on Kubernetes objects, and the reasons it writes in status.

Everything that reads a PretrainJob's objects from outside the operator (the testbed's fault
injection, the integration tests, the benchmarks, a user's `kubectl get pods -l ...`) needs
the same label keys, object names and reason strings; keeping them here means the operator
never scatters literals and nobody else has to guess them.

Object names are short on purpose: a worker's hostname `<job>-<rank>` must be a DNS label
(63 characters), so the CRD limits job names to `MAX_JOB_NAME` characters. A job name that is
not itself a DNS label (dots, a leading digit) is turned into one for the Service and the
hostnames (`dns_label`); every other derived name is a DNS subdomain, as the job's is.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum
from typing import Final

# --- label keys ------------------------------------------------------------------------------

JOB: Final = "hlat.dev/job"
"""Name of the PretrainJob that owns the object (every object the operator creates)."""
ATTEMPT: Final = "hlat.dev/attempt"
"""Restart attempt of a worker pod or Lease, from 0."""
NODE_RANK: Final = "hlat.dev/node-rank"
"""Node rank of a worker pod (torchrun's --node-rank), from 0."""
COMPONENT: Final = "app.kubernetes.io/component"
NAME: Final = "app.kubernetes.io/name"
MANAGED_BY: Final = "app.kubernetes.io/managed-by"
APP_NAME: Final = "hlat"
OPERATOR_NAME: Final = "hlat-operator"
WORKER: Final = "worker"
EVALUATION: Final = "evaluation"
"""The component of an evaluation Job and its pods (spec.evaluation): never listed as workers."""
STEP: Final = "hlat.dev/step"
"""The checkpoint step an evaluation Job reads."""


def evaluation_job_name(job: str, step: int) -> str:
    """`<job>-eval-<step>`, at most 63 characters (the Job controller labels its pods with the
    Job's name): a long job name is cut and told apart by a hash of it."""
    import hashlib

    suffix = f"-eval-{step}"
    if len(job) + len(suffix) <= 63:
        return job + suffix
    digest = hashlib.sha256(job.encode()).hexdigest()[:8]
    return f"{job[:63 - len(suffix) - 9].rstrip('-.')}-{digest}{suffix}"

SPARE: Final = "hlat.dev/spare"
"""Label of a spare worker pod (faultTolerance.spareNodes): outside the gang, no attempt or
node rank until the operator promotes it to a lost node's rank (label patch)."""
TRAINER_EXITED: Final = "hlat.dev/trainer-exited"
"""Label a worker's launcher puts on its Lease when the trainer of that attempt exited and the
pod stays for an in-place restart (value: the exit code). The operator watches only Leases
carrying it (a server-side selector), so a crash is seen at once, not at the next resync."""
REPORTED: Final = "hlat.dev/reported"
"""Label a worker's launcher puts on its Lease with a report the operator must act on at once:
`exit` (its trainer exited, `TRAINER_EXITED` set too) or `peers` (it cannot reach a peer
node's launcher: `Heartbeat.unreachable_ranks`). The operator watches only Leases carrying
it (a server-side selector), so neither waits for the next resync."""
ATTEMPT_STARTED: Final = "hlat.dev/attempt-started"
"""Annotation on a worker pod kept for an in-place restart: when the operator moved it to its
current attempt (the startup clock of that attempt runs from then, not from the container's
start)."""

STATE_ANNOTATION: Final = "hlat.dev/operator-state"
"""The operator's own bookkeeping on a PretrainJob (JSON): what the status does not hold,
e.g. nodes to avoid and the no-progress streak. Written only by the operator."""

# --- the worker pod's container and node settings ------------------------------------------

TRAINER_UID: Final = 10001
"""The user Dockerfile.trainer runs as (its USER_UID build argument; a test keeps them equal).
The node-local compile cache is handed to this user before the trainer starts."""
NEURON_ROOT_COMM_PORT: Final = 48620
"""First port of the Neuron runtime's root communicator (NEURON_RT_ROOT_COMM_ID=<ip>:<port>,
listened on at node rank 0). 48620 is AWS's own choice: aws-neuron-sdk
archive/nxd-training/training-troubleshooting.rst:318-335 (reserve it, then set
NEURON_RT_ROOT_COMM_ID to it), and NxD's launch scripts reserve 44000,48620 (44000 is their
torchrun --master_port, e.g. examples/training/llama/tp_zero1_llama_hf_pretrain/
tp_zero1_llama2_7B_hf_pretrain.sh:55,64; ours is the operator's masterPort, 29500 + attempt %
16, below Linux's ephemeral range 32768-60999, so it needs no reservation)."""
NEURON_ROOT_COMM_PORTS: Final = 16
"""Attempt N uses NEURON_ROOT_COMM_PORT + N % 16 (as the agent's rendezvous ports rotate), so a
straggler of the previous in-place attempt in the same pod never reaches the new root."""
NEURON_RESERVED_PORTS_SYSCTL: Final = "net.ipv4.ip_local_reserved_ports"
NEURON_RESERVED_PORTS: Final = (
    f"{NEURON_ROOT_COMM_PORT}-{NEURON_ROOT_COMM_PORT + NEURON_ROOT_COMM_PORTS - 1}")
"""The root communicator's ports, inside the ephemeral range and so kept out of it: an outgoing
connection cannot take one first (a pod sets it as a namespaced "safe" sysctl, allowed since
Kubernetes 1.27)."""

# --- well-known keys of other systems --------------------------------------------------------

INSTANCE_TYPE_LABEL: Final = "node.kubernetes.io/instance-type"
NETWORK_LAYERS: Final = tuple(f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3))
"""EC2's instance-topology labels EKS puts on trn1, trn2 and p5 nodes, top layer first (the
bottom one, layer 3, is the most selective); spec.scheduling.topology's default levels."""
NODE_HEALTH_LABEL: Final = "sagemaker.amazonaws.com/node-health-status"
"""SageMaker HyperPod's node health; any value but `NODE_HEALTHY` keeps new pods away."""
NODE_HEALTHY: Final = "Schedulable"
NEURON_RESOURCE: Final = "aws.amazon.com/neuron"
EFA_RESOURCE: Final = "vpc.amazonaws.com/efa"
GPU_RESOURCE: Final = "nvidia.com/gpu"
NEURON_TAINT: Final = "aws.amazon.com/neuron"
GPU_TAINT: Final = "nvidia.com/gpu"

# --- object names ----------------------------------------------------------------------------

MAX_JOB_NAME: Final = 52
"""Longest PretrainJob name: leaves room for `-a<attempt>-<rank>` within a 63-char label."""
CONFIG_FILE: Final = "config.json"
"""Key of the trainer config in the job's ConfigMap (and the file name it is mounted as)."""
CONFIG_DIR: Final = "/etc/hlat"


_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def dns_label(job: str) -> str:
    """The job's name as a DNS-1035 label, the base of its Service and worker hostnames.

    A PretrainJob's name is a DNS subdomain: it may hold dots (`llama-3.1-8b`) and start with a
    digit (`7b-run`), which a Service name and a hostname may not. Such a name is made a label
    (dots to dashes, a leading `j` before a digit) plus 5 hex digits of its SHA-256, so two jobs
    whose names differ only in what was replaced (`a.b`, `a-b`) never share a Service. A name
    that already is a label is used as it is.
    """
    if _DNS_1035.fullmatch(job):
        return job
    safe = re.sub(r"[^a-z0-9-]", "-", job.lower())
    if not safe[:1].isalpha():
        safe = "j" + safe
    digest = hashlib.sha256(job.encode()).hexdigest()[:5]
    return f"{safe[:MAX_JOB_NAME - 6].rstrip('-')}-{digest}"


def service_name(job: str) -> str:
    """The headless Service whose DNS the workers rendezvous through."""
    return dns_label(job)


def config_map_name(job: str) -> str:
    return f"{job}-config"


def service_account_name(job: str) -> str:
    """Also the name of the Role and RoleBinding that let workers renew their Leases."""
    return f"{job}-worker"


def worker_pod_name(job: str, attempt: int, index: int) -> str:
    """Per attempt, so the next gang never collides with a pod that is still terminating.
    `index`: the node rank, but for a pod whose rank's host name another pod of the job keeps
    (`pod_hostname` reads the host name back from the name; the restart record and the node
    rank label say which rank the pod holds)."""
    return f"{job}-a{attempt}-{index}"


def worker_lease_name(job: str, attempt: int, rank: int) -> str:
    """The heartbeat Lease of node rank `rank` in `attempt`: per attempt and rank, not per pod,
    since a pod kept by an in-place restart serves several attempts (and the Role names only
    the current attempt's Leases, so a trainer of an older one cannot renew)."""
    return worker_pod_name(job, attempt, rank)


def gang_lease_name(job: str) -> str:
    """The job's restart record: a Lease the operator writes and every worker's launcher reads
    (get only) to learn the current attempt of an in-place restart."""
    return f"{job}-gang"


def spare_pod_name(job: str, serial: int) -> str:
    """Spare pods are numbered for the job's life (a promoted spare keeps its name)."""
    return f"{job}-s{serial}"


def spare_hostname(job: str, serial: int) -> str:
    return f"{dns_label(job)}-s{serial}"


def worker_hostname(job: str, rank: int) -> str:
    """Stable across attempts: `<job>-0.<service>` is always the rendezvous master."""
    return f"{dns_label(job)}-{rank}"


def pod_hostname(job: str, pod: str) -> str | None:
    """The hostname a worker or spare pod of `job` was created with, from its name (None: not
    one of the job's pod names)."""
    for prefix, host in ((f"{job}-s", "s"), (f"{job}-a", "")):
        tail = pod[len(prefix):] if pod.startswith(prefix) else ""
        if host == "s" and tail.isdigit():
            return spare_hostname(job, int(tail))
        attempt, _, rank = tail.partition("-")
        if not host and attempt.isdigit() and rank.isdigit():
            return worker_hostname(job, int(rank))
    return None


def master_addr(job: str) -> str:
    return f"{worker_hostname(job, 0)}.{service_name(job)}"


# --- reasons (status conditions, lastFailure, Events) ----------------------------------------


class Reason(StrEnum):
    """CamelCase reasons in conditions, `status.lastFailure.reason` and Events."""

    # lifecycle
    CREATED = "Created"
    """The gang of an attempt was created; waiting for every pod to run."""
    RUNNING = "Running"
    """Every worker pod of the attempt is running."""
    TRAINING = "Training"
    """Every worker reports a training heartbeat (the Ready condition)."""
    COMPLETED = "Completed"
    """Every worker pod exited 0: the trainer finished its steps."""
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    BACKOFF = "BackingOff"
    """The old gang is gone; waiting out the restart backoff."""
    STRAGGLER = "Straggler"
    """A node computes slower than the rest of its gang (spec.faultTolerance.stragglers)."""
    NO_STRAGGLER = "NoStraggler"
    """Every node computes within the threshold of its gang again."""
    SHRUNK = "Shrunk"
    """An elastic job restarted on fewer nodes: some were missing for elastic.waitSeconds (a
    planned restart: no restart budget; condition Degraded while below spec.nodes)."""
    GROWN = "Grown"
    """An elastic job restarted on more nodes at a checkpoint after they returned."""
    FORCE_DELETED = "ForceDeleted"
    """A pod stuck terminating on a dead node was deleted without waiting for its kubelet."""
    # faults that end an attempt (retryable unless noted)
    POD_FAILED = "PodFailed"
    """A worker exited non-zero (not a config error, not a signal)."""
    KILLED = "Killed"
    """A worker was killed by a signal (exit code 128+n)."""
    OOM_KILLED = "OOMKilled"
    CONFIG_ERROR = "ConfigError"
    """A worker exited with ExitCode.CONFIG_ERROR: permanent, the job is Failed."""
    EVICTED = "Evicted"
    PREEMPTED = "Preempted"
    POD_DELETED = "PodDeleted"
    """A running worker pod was deleted (or began terminating) without the operator asking."""
    NODE_LOST = "NodeLost"
    """The node of a worker is NotReady, unreachable, or gone."""
    NODE_UNHEALTHY = "NodeUnhealthy"
    """The node of a worker carries a HyperPod health label other than Schedulable."""
    STARTUP_TIMEOUT = "StartupTimeout"
    """No first heartbeat within faultTolerance.heartbeat.startupTimeoutSeconds."""
    HEARTBEAT_TIMEOUT = "HeartbeatTimeout"
    """A training worker stopped renewing its Lease for longer than the steady timeout."""
    # terminal
    INVALID_SPEC = "InvalidSpec"
    BUDGET_EXHAUSTED = "BudgetExhausted"
    """More counted restarts than faultTolerance.maxRestarts."""
    NO_PROGRESS = "NoProgress"
    """faultTolerance.noProgressRestarts restarts in a row without a new complete checkpoint."""
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    REJECTED = "Rejected"
    """The API server refused an object the job needs (invalid, or forbidden by policy such as
    Pod Security admission): retrying cannot help, the job is Failed with its message."""
    # placement (the Schedulable condition)
    UNSCHEDULABLE = "Unschedulable"
    """Worker pods the scheduler cannot place, for longer than the operator's bound."""
    SCHEDULED = "Scheduled"
    """Every worker pod of the attempt is placed on a node."""
    TOPOLOGY_UNAVAILABLE = "TopologyUnavailable"
    """No domain of spec.scheduling.topology.required has enough usable nodes: no pods yet."""
    PLACED = "Placed"
    """The nodes and rank order chosen by spec.scheduling.topology (an Event)."""
    # Kueue (the job labelled kueue.x-k8s.io/queue-name; phase Suspended while it waits)
    QUEUED = "Queued"
    """Waiting in a Kueue LocalQueue for its Workload's admission: no pods (quota, priority or
    admission checks; the message has Kueue's words)."""
    ADMITTED = "Admitted"
    """Kueue admitted the job's Workload: the gang starts (or resumes from its checkpoint)."""
    EVICTED_BY_KUEUE = "EvictedByKueue"
    """Kueue evicted the job's Workload (preempted by a higher priority, deactivated, ...): the
    pods are stopped, no restart counted, and the job waits to be admitted again."""
    REPLACED_BY_KUEUE = "NodeReplacedByKueue"
    """Kueue failed a worker pod before it ran (placed by topology on a node Kueue found
    unhealthy, and replaced in the Workload's assignment): the pod is made again, no fault."""
    # evaluation jobs (spec.evaluation): they never change the training's phase
    EVALUATING = "Evaluating"
    """An evaluation Job started on a durable checkpoint."""
    EVALUATED = "Evaluated"
    """An evaluation Job finished; its results are in status.evaluations and the metrics."""
    EVALUATION_FAILED = "EvaluationFailed"
    """An evaluation Job failed after its retries, ran past its deadline, or wrote no result
    that reads: reported, and the training goes on."""
    API_ERROR = "ApiError"
    """A request to the API server failed in a way a retry can fix; retried with backoff."""


INFRA_REASONS: Final = frozenset(
    {Reason.EVICTED, Reason.PREEMPTED, Reason.POD_DELETED, Reason.NODE_LOST, Reason.NODE_UNHEALTHY}
)
"""Infrastructure faults: they use restart budget only when faultTolerance.infraFaultsCount."""

NODE_REASONS: Final = frozenset({Reason.NODE_LOST, Reason.NODE_UNHEALTHY, Reason.HEARTBEAT_TIMEOUT,
                                 Reason.STRAGGLER})
"""Faults that implicate the node: with avoidFailedNodes its name is kept out of later attempts.
A startup timeout does not: the whole gang usually waits on the one pod that is slow, and
blaming every node would leave nowhere to run."""
