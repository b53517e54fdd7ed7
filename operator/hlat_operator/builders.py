"""Pure `build_*` functions: the objects a PretrainJob needs, as dicts, from its spec.

No I/O and no Kubernetes client: reconcile decides *when* to create them, the k8s module sends
them. Every object carries the job label and an ownerReference to the PretrainJob, so deleting
the job lets the garbage collector remove everything.

Design choices:
- Worker pods are named per attempt (`<job>-a<attempt>-<rank>`) but keep a stable hostname
  (`<job>-<rank>`) under the headless Service, so `MASTER_ADDR=<job>-0.<job>` never changes
  while a new gang can be named before the old one's names are free.
- The headless Service publishes not-ready addresses: rendezvous happens before any probe
  could pass.
- Workers may get/update/patch only their own attempt's Leases (RBAC resourceNames). `create`
  cannot be restricted by name, so the operator creates the Leases itself.
- Resources come from hlat_api.presets.INSTANCE_TYPES: the whole node's Neuron devices and EFA
  interfaces (requests = limits, as extended resources require), none on `cpu`.
- The Neuron compile cache is a node-local hostPath: the paper saw timeouts with it on the
  shared volume, and a node that compiled once should not compile again after a restart. The
  kubelet creates it root-owned (0755) while the trainer image runs as `labels.TRAINER_UID`, so
  a small init container (root, CHOWN capability only) hands the directory to that user.
- The Neuron compiler and runtime environment (NEURON_*, EFA's FI_*) is not set here: the
  worker's entrypoint, `hlat-launch`, computes it from the same spec (hlat_trainer.neuron_env),
  one source. A variable the pod does set is a deliberate override the launcher keeps.
- Voluntary disruption: every worker carries Karpenter's `karpenter.sh/do-not-disrupt`
  annotation and the job has a PodDisruptionBudget over its rank-holding workers (see
  `build_pod_disruption_budget`): a gang loses a whole attempt's progress since the last
  checkpoint when one worker goes, which consolidation, drift or expiry must not cost.
- Trainium pods reserve the Neuron runtime's ports (`labels.NEURON_RESERVED_PORTS`) with the
  namespaced sysctl net.ipv4.ip_local_reserved_ports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hlat_api import labels
from hlat_api.env import Env
from hlat_api.gang import GangRecord
from hlat_api.manifest import API_GROUP, API_VERSION, KIND
from hlat_api.podtemplate import (
    CACHE_OWNER_CONTAINER,
    CACHE_VOLUME,
    CONFIG_VOLUME,
    DATA_VOLUME,
    SHM_VOLUME,
    TRAINER_CONTAINER,
)
from hlat_api.presets import INSTANCE_TYPES
from hlat_api.spec import PretrainJobSpec
from hlat_operator.config import OperatorSettings
from hlat_operator.evaluations import EVALUATOR, RESULT_PATH
from hlat_operator.kube import (
    BatchJob,
    ConfigMap,
    Container,
    EnvVar,
    Lease,
    ObjectMeta,
    OwnerReference,
    Pod,
    PodDisruptionBudget,
    PodGroup,
    PodSpec,
    Role,
    RoleBinding,
    Service,
    ServiceAccount,
    Volume,
    VolumeMount,
)
from hlat_operator.podmerge import merge_pod

CONTAINER = TRAINER_CONTAINER
VOLCANO = "volcano"
"""schedulerName of Volcano's scheduler: the gang gets a PodGroup."""
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
"""The pod annotation naming its Volcano PodGroup."""
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
AVOIDED_ANNOTATION = "hlat.dev/avoided-nodes"
"""Comma-separated nodes a worker pod was created to avoid (its node affinity), so the operator
can tell when a pending pod's placement rule is out of date and create it again."""
DO_NOT_DISRUPT_ANNOTATION = "karpenter.sh/do-not-disrupt"
"""Karpenter (and EKS Auto Mode, built on it) does not consolidate a node running a pod with
this annotation set to "true", nor replace it for drift unless the NodeClaim has a
terminationGracePeriod (aws/karpenter-provider-aws, website/content/en/docs/concepts/
disruption.md, "Pod-Level Controls"). Expiration is forceful in Karpenter v1: it waits on the
annotation and the budget only up to that terminationGracePeriod. Involuntary disruption (spot
interruption, node failure, repair) and a manual drain are not affected (the budget is)."""
PDB_API = "policy/v1"
CACHE_OWNER_RESOURCES = {"cpu": "100m", "memory": "64Mi"}
"""The init container's requests = limits (Guaranteed QoS counts init containers too)."""


@dataclass(frozen=True)
class JobRef:
    """Identity of a PretrainJob: what every owned object points back to."""

    name: str
    namespace: str
    uid: str


def owner_reference(job: JobRef) -> OwnerReference:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_labels(job: JobRef) -> dict[str, str]:
    return {
        labels.NAME: labels.APP_NAME,
        labels.MANAGED_BY: labels.OPERATOR_NAME,
        labels.JOB: job.name,
    }


def worker_selector(job: JobRef) -> dict[str, str]:
    """Selects the job's worker pods of every attempt (only one attempt is ever alive)."""
    return {labels.JOB: job.name, labels.COMPONENT: labels.WORKER}


def _meta(job: JobRef, name: str, extra_labels: dict[str, str] | None = None) -> ObjectMeta:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": {**job_labels(job), **(extra_labels or {})},
        "ownerReferences": [owner_reference(job)],
    }


def resolve_image(spec: PretrainJobSpec, settings: OperatorSettings) -> str | None:
    """spec.image, else the template's trainer image, else the operator's default."""
    theirs = spec.template.trainer().get("image") if spec.template else None
    return spec.image or theirs or settings.default_image


def scheduler_name(spec: PretrainJobSpec, settings: OperatorSettings) -> str | None:
    """The worker pods' scheduler: the template's, spec.scheduling's, the operator's default."""
    theirs = spec.template.spec.get("schedulerName") if spec.template else None
    return theirs or spec.scheduling.scheduler_name or settings.scheduler_name


def uses_volcano(spec: PretrainJobSpec, settings: OperatorSettings) -> bool:
    return scheduler_name(spec, settings) == VOLCANO


def user_service_account(spec: PretrainJobSpec) -> str | None:
    """The template's serviceAccountName, when it names one."""
    name = spec.template.spec.get("serviceAccountName") if spec.template else None
    return name if isinstance(name, str) and name else None


# --- per-job objects -------------------------------------------------------------------------


def build_service(job: JobRef, settings: OperatorSettings) -> Service:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, labels.service_name(job.name)),
        "spec": {
            "clusterIP": "None",
            "selector": worker_selector(job),
            "publishNotReadyAddresses": True,
            "ports": [
                {
                    "name": "rendezvous",
                    "port": settings.master_port,
                    "targetPort": settings.master_port,
                }
            ],
        },
    }


def build_config_map(job: JobRef, spec: PretrainJobSpec) -> ConfigMap:
    """The trainer config: the spec itself, as the JSON `hlat-train --config` reads."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, labels.config_map_name(job.name)),
        "data": {labels.CONFIG_FILE: spec.model_dump_json(by_alias=True)},
    }


def build_service_account(job: JobRef) -> ServiceAccount:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(job, labels.service_account_name(job.name)),
    }


def lease_names(job: JobRef, spec: PretrainJobSpec, attempt: int) -> list[str]:
    return [
        labels.worker_lease_name(job.name, attempt, rank) for rank in range(spec.nodes)
    ]


def build_role(job: JobRef, spec: PretrainJobSpec, attempt: int) -> Role:
    """Only the current attempt's Leases: a worker of an old gang that is somehow still alive
    cannot pose as a live member of the new one."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(job, labels.service_account_name(job.name)),
        "rules": [
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": lease_names(job, spec, attempt),
                # watch: a worker sees a checkpoint request when it is written, not at its
                # next renewal (hlat_trainer.leasewatch: by name, as resourceNames allow)
                "verbs": ["get", "update", "patch", "watch"],
            },
            {   # the restart record of an in-place restart: read (and watched) only; a watch
                # with a metadata.name field selector is authorized by resourceNames
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [labels.gang_lease_name(job.name)],
                "verbs": ["get", "watch"],
            },
        ],
    }


def build_role_binding(job: JobRef, spec: PretrainJobSpec) -> RoleBinding:
    """Binds the heartbeat Role to the per-job account and to the template's own account
    (IRSA / Pod Identity), so heartbeats work whichever the pods run as."""
    name = labels.service_account_name(job.name)
    accounts = [name]
    theirs = user_service_account(spec)
    if theirs and theirs != name:
        accounts.append(theirs)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(job, name),
        "subjects": [{"kind": "ServiceAccount", "name": a, "namespace": job.namespace}
                     for a in accounts],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
    }


def build_pod_group(job: JobRef, spec: PretrainJobSpec) -> PodGroup:
    """Volcano's PodGroup: the gang is bound only when all `nodes` pods can be (minMember; an
    elastic job's attempt at a smaller size has the smaller spec.nodes: `elastic.effective`)."""
    return {
        "apiVersion": VOLCANO_API,
        "kind": "PodGroup",
        "metadata": _meta(job, job.name),
        "spec": {"minMember": spec.nodes, "queue": spec.scheduling.queue or "default"},
    }


def pod_disruption_budget_name(job: JobRef) -> str:
    return labels.service_name(job.name)


def build_pod_disruption_budget(job: JobRef, spec: PretrainJobSpec) -> PodDisruptionBudget:
    """A budget that refuses every eviction of a rank-holding worker while the job runs, so
    `kubectl drain` and any eviction-based autoscaler wait until the job ends or is suspended.

    minAvailable = nodes, an integer: the workers are owned by a PretrainJob, which has no
    scale subresource, and for such pods Kubernetes supports only an integer minAvailable
    (maxUnavailable or a percentage needs the owner's scale: kubernetes/website,
    content/en/docs/tasks/run-application/configure-pdb.md, "Arbitrary workloads and
    arbitrary selectors"). Spares are left out (`hlat.dev/spare` DoesNotExist): evicting one
    costs no training time and the operator makes another; a promoted spare loses the label
    and so is counted."""
    selector = {
        "matchLabels": worker_selector(job),
        "matchExpressions": [{"key": labels.SPARE, "operator": "DoesNotExist"}],
    }
    return {
        "apiVersion": PDB_API,
        "kind": "PodDisruptionBudget",
        "metadata": _meta(job, pod_disruption_budget_name(job)),
        "spec": {"minAvailable": spec.nodes, "selector": selector},
    }


def checkpoint_volume_problem(spec: PretrainJobSpec) -> str | None:
    """Why `checkpoint.dir` is not on a volume that outlives the pod, or None. A directory
    outside every mount is the container's own filesystem: each worker would write its
    checkpoints there and a restarted gang would find none. Accepted: under the claim's
    mountPath, or under a mount of the template's trainer container whose volume is not an
    emptyDir (which dies with the pod too)."""
    where = spec.checkpoint.dir
    mounts: list[str] = [spec.storage.mount_path] if spec.storage.claim_name else []
    if spec.template is not None:
        ephemeral = {str(v.get("name")) for v in spec.template.spec.get("volumes") or []
                     if isinstance(v, dict) and "emptyDir" in v}
        mounts += [str(m.get("mountPath", "")) for m in
                   spec.template.trainer().get("volumeMounts") or []
                   if isinstance(m, dict) and str(m.get("name")) not in ephemeral]
    if any(m and (where == m or where.startswith(m.rstrip("/") + "/")) for m in mounts):
        return None
    fix = (f"put it under spec.storage.mountPath ({spec.storage.mount_path})"
           if spec.storage.claim_name else
           "set spec.storage.claimName to a ReadWriteMany PersistentVolumeClaim (FSx for "
           "Lustre on EKS) and put it under spec.storage.mountPath")
    return (f"spec.checkpoint.dir: {where} is on no volume of the worker pods, so each "
            f"container would write its checkpoints into its own filesystem and a restart "
            f"would find none: {fix}, or mount a volume there with the template's trainer "
            f"volumeMounts")


def build_leases(
    job: JobRef, spec: PretrainJobSpec, attempt: int, settings: OperatorSettings
) -> list[Lease]:
    """Empty Leases (no renewTime): the first renewal is the worker's first heartbeat."""
    duration = max(1, round(settings.heartbeat_period_seconds * 3))
    out: list[Lease] = []
    for rank, name in enumerate(lease_names(job, spec, attempt)):
        extra = {labels.ATTEMPT: str(attempt), labels.NODE_RANK: str(rank)}
        lease: Lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": _meta(job, name, extra),
            "spec": {
                "holderIdentity": labels.worker_pod_name(job.name, attempt, rank),
                "leaseDurationSeconds": duration,
            },
        }
        out.append(lease)
    return out


def build_gang_lease(job: JobRef, attempt: int, steps_done: int,
                     ranks: dict[str, int] | None = None, master_addr: str | None = None,
                     nodes: int | None = None) -> Lease:
    """The restart record (`hlat_api.gang`): the attempt every launcher must run now, the node
    rank of each pod, node rank 0's address when a spare took it over, and the attempt's
    size."""
    meta = _meta(job, labels.gang_lease_name(job.name))
    meta["annotations"] = GangRecord(attempt=attempt, steps_done=steps_done, ranks=ranks or {},
                                     master_addr=master_addr, nodes=nodes).to_annotations()
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": labels.OPERATOR_NAME}}


def in_place(spec: PretrainJobSpec) -> bool:
    return spec.fault_tolerance.restart_strategy == "InPlace"


# --- worker pods -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank's pod must and should go (spec.scheduling.topology; topology.py)."""

    node: str | None = None
    """The planned node (preferred node affinity)."""
    required: tuple[str, str] | None = None
    """(level, value) every pod of the gang shares (required node affinity)."""
    near: tuple[str, str] | None = None
    """(bottom level, value) of the planned node: preferred next, when the node is taken."""


def build_worker_pods(
    job: JobRef,
    spec: PretrainJobSpec,
    attempt: int,
    settings: OperatorSettings,
    avoid_nodes: Iterable[str] = (),
    steps_done: int = 0,
    placement: Mapping[int, RankPlacement] | None = None,
    master_addr: str | None = None,
    hosts: Mapping[int, int] | None = None,
) -> list[Pod]:
    """`placement`: each rank's topology placement (none: the scheduler's choice);
    `master_addr`: node rank 0's address where it is not rank 0's own host name (a promoted
    spare holds rank 0: the restart record says so, and a pod made for the same attempt starts
    its trainers before it reads any record); `hosts`: a rank's host index where it is not the
    rank itself (as in `build_worker_pod`)."""
    avoid = sorted(set(avoid_nodes))
    return [
        build_worker_pod(job, spec, attempt, rank, settings, avoid, steps_done,
                         (placement or {}).get(rank), master_addr, (hosts or {}).get(rank))
        for rank in range(spec.nodes)
    ]


def build_worker_pod(
    job: JobRef,
    spec: PretrainJobSpec,
    attempt: int,
    rank: int,
    settings: OperatorSettings,
    avoid_nodes: list[str] | None = None,
    steps_done: int = 0,
    place: RankPlacement | None = None,
    master_addr: str | None = None,
    host: int | None = None,
) -> Pod:
    """`steps_done`: the highest step an earlier attempt finished (the trainer counts steps up
    to it as recomputed work); `master_addr`: as in `build_worker_pods`; `host`: the index in
    the pod's name and host name (`<job>-a<attempt>-<host>`, `<job>-<host>`), the rank unless
    that host name is taken (a pod that moved down a rank at a shrink keeps its own: a pod
    made for its old rank when the job grows back in place gets a free one)."""
    host = rank if host is None else host
    name = labels.worker_pod_name(job.name, attempt, host)
    extra = {
        labels.COMPONENT: labels.WORKER,
        labels.ATTEMPT: str(attempt),
        labels.NODE_RANK: str(rank),
    }
    pod_spec: PodSpec = {
        "hostname": labels.worker_hostname(job.name, host),
        "subdomain": labels.service_name(job.name),
        "restartPolicy": "Never",
        "serviceAccountName": labels.service_account_name(job.name),
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "enableServiceLinks": False,
        "containers": [_container(job, spec, attempt, rank, name, settings, steps_done,
                                  master_addr)],
        "volumes": _volumes(job, spec, settings),
    }
    if _is_trainium(spec):
        pod_spec["initContainers"] = [_cache_owner(spec, settings)]
        pod_spec["securityContext"] = {"sysctls": [
            {"name": labels.NEURON_RESERVED_PORTS_SYSCTL, "value": labels.NEURON_RESERVED_PORTS}]}
    _apply_scheduling(pod_spec, spec, avoid_nodes or [], settings, place)
    meta = _meta(job, name, extra)
    meta["annotations"] = {AVOIDED_ANNOTATION: ",".join(avoid_nodes or []),
                           DO_NOT_DISRUPT_ANNOTATION: "true"}
    if uses_volcano(spec, settings):
        meta["annotations"][VOLCANO_GROUP_ANNOTATION] = job.name
    ours: Pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    merged: Pod = merge_pod(dict(ours), spec.template)  # type: ignore[assignment]
    return merged


def build_spare_pod(job: JobRef, spec: PretrainJobSpec, serial: int, attempt: int,
                    settings: OperatorSettings, avoid_nodes: list[str] | None = None,
                    place: RankPlacement | None = None) -> Pod:
    """A spare worker: the worker pod of rank 0 (so its launcher has a complete environment)
    with its own name and hostname, labelled spare instead of with an attempt and node rank,
    and HLAT_SPARE=1: its launcher waits with warm standby trainers until the restart record
    gives it a rank."""
    pod = build_worker_pod(job, spec, attempt, 0, settings, avoid_nodes, place=place)
    name = labels.spare_pod_name(job.name, serial)
    meta = pod["metadata"]
    meta["name"] = name
    meta["labels"] = {k: v for k, v in meta["labels"].items()
                      if k not in (labels.ATTEMPT, labels.NODE_RANK)} | {labels.SPARE: "true"}
    pod["spec"]["hostname"] = labels.spare_hostname(job.name, serial)
    for container in pod["spec"]["containers"]:
        if container["name"] == TRAINER_CONTAINER:
            container["env"].append({"name": Env.SPARE, "value": "1"})
    return pod


def _container(
    job: JobRef,
    spec: PretrainJobSpec,
    attempt: int,
    rank: int,
    pod: str,
    settings: OperatorSettings,
    steps_done: int = 0,
    master_addr: str | None = None,
) -> Container:
    c: Container = {
        "name": CONTAINER,
        "image": resolve_image(spec, settings) or "",
        "command": list(settings.trainer_command),
        "env": build_env(job, spec, attempt, rank, pod, settings, steps_done, master_addr),
        "volumeMounts": _mounts(spec),
        "ports": [{"name": "rendezvous", "containerPort": settings.master_port}],
    }
    if settings.trainer_metrics_port:
        c["ports"].append({"name": "metrics", "containerPort": settings.trainer_metrics_port})
    if settings.image_pull_policy:
        c["imagePullPolicy"] = settings.image_pull_policy
    resources = build_resources(spec)
    if resources:
        c["resources"] = {"requests": resources, "limits": dict(resources)}
    return c


def trainer_uid(spec: PretrainJobSpec) -> int:
    """The user the trainer runs as: the template's runAsUser (container, else pod), else the
    image's (labels.TRAINER_UID)."""
    if spec.template is None:
        return labels.TRAINER_UID
    for ctx in (spec.template.trainer().get("securityContext"),
                spec.template.spec.get("securityContext")):
        uid = (ctx or {}).get("runAsUser")
        if isinstance(uid, int):
            return uid
    return labels.TRAINER_UID


def _cache_owner(spec: PretrainJobSpec, settings: OperatorSettings) -> Container:
    """Hands the node-local compile cache (a root-owned hostPath) to the trainer's user."""
    uid = trainer_uid(spec)
    c: Container = {
        "name": CACHE_OWNER_CONTAINER,
        "image": resolve_image(spec, settings) or "",
        "command": ["chown", f"{uid}:{uid}", spec.neuron.cache_dir],
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": spec.neuron.cache_dir}],
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False,
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}},
        "resources": {"requests": dict(CACHE_OWNER_RESOURCES),
                      "limits": dict(CACHE_OWNER_RESOURCES)},
    }
    if settings.image_pull_policy:
        c["imagePullPolicy"] = settings.image_pull_policy
    return c


def build_resources(spec: PretrainJobSpec) -> dict[str, str]:
    """The whole node: its accelerators, EFA interfaces, and the instance type's cpu and
    memory (requests = limits: Guaranteed QoS); nothing on `cpu`."""
    info = INSTANCE_TYPES[spec.instance_type]
    wanted: dict[str, int | str | None] = {
        "cpu": info.cpu,
        "memory": info.memory,
        labels.NEURON_RESOURCE: info.neuron_devices,
        labels.EFA_RESOURCE: info.efa_interfaces,
        labels.GPU_RESOURCE: info.gpus,
    }
    if info.gpus and info.efa_interfaces:
        wanted.update(EFA_GPU_HUGEPAGES)
    return {k: str(v) for k, v in wanted.items() if v}


EFA_GPU_HUGEPAGES: dict[str, int | str | None] = {"hugepages-2Mi": "5120Mi"}
"""What AWS's EFA GPU manifests request beside the GPUs and EFA interfaces: libfabric's EFA
provider takes its internal buffers from 2 MiB huge pages (awsome-distributed-training 7217859,
micro-benchmarks/nccl-tests/kubernetes/nccl-tests.yaml:89,94, p5.48xlarge workers: requests =
limits `hugepages-2Mi: 5120Mi`). Not on Trainium: AWS's Neuron manifests request none
(3.test_cases/pytorch/neuronx-distributed/llama3/kubernetes/llama3_train.yaml-template:101-107).
The node must have the pages reserved (docs/neuron.md, "EFA")."""


def _field_env(name: str, path: str) -> EnvVar:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def build_env(
    job: JobRef,
    spec: PretrainJobSpec,
    attempt: int,
    rank: int,
    pod: str,
    settings: OperatorSettings,
    steps_done: int = 0,
    master_addr: str | None = None,
) -> list[EnvVar]:
    plain = {
        Env.JOB_NAME: job.name,
        Env.NAMESPACE: job.namespace,
        Env.ATTEMPT: str(attempt),
        Env.CONFIG: f"{labels.CONFIG_DIR}/{labels.CONFIG_FILE}",
        Env.NNODES: str(spec.nodes),
        Env.NODE_RANK: str(rank),
        Env.NPROC_PER_NODE: str(spec.ranks_per_node),
        Env.MASTER_ADDR: master_addr or labels.master_addr(job.name),
        Env.MASTER_PORT: str(settings.master_port),
        Env.HEARTBEAT_LEASE: labels.worker_lease_name(job.name, attempt, rank),
        Env.HEARTBEAT_PERIOD: f"{settings.heartbeat_period_seconds:g}",
        Env.METRICS_PORT: str(settings.trainer_metrics_port),
        Env.LOG_FORMAT: settings.log_format,
        Env.STEPS_DONE: str(steps_done),
    }
    if in_place(spec):
        plain[Env.GANG_LEASE] = labels.gang_lease_name(job.name)
    env: list[EnvVar] = [
        _field_env(Env.POD_NAME, "metadata.name"),
        _field_env(Env.NODE_NAME, "spec.nodeName"),
    ]
    env += [{"name": str(k), "value": v} for k, v in plain.items()]
    return env


def _is_trainium(spec: PretrainJobSpec) -> bool:
    return INSTANCE_TYPES[spec.instance_type].neuron_devices > 0


def _volumes(job: JobRef, spec: PretrainJobSpec, settings: OperatorSettings) -> list[Volume]:
    shm: dict[str, str] = {"medium": "Memory"}
    if settings.shm_size_limit:
        shm["sizeLimit"] = settings.shm_size_limit
    vols: list[Volume] = [
        {"name": SHM_VOLUME, "emptyDir": shm},
        {
            "name": CONFIG_VOLUME,
            "configMap": {"name": labels.config_map_name(job.name)},
        },
    ]
    if spec.storage.claim_name:
        vols.append(
            {"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": spec.storage.claim_name}}
        )
    if _is_trainium(spec):
        vols.append(
            {
                "name": CACHE_VOLUME,
                "hostPath": {"path": spec.neuron.cache_dir, "type": "DirectoryOrCreate"},
            }
        )
    return vols


def _mounts(spec: PretrainJobSpec) -> list[VolumeMount]:
    mounts: list[VolumeMount] = [
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
        {"name": CONFIG_VOLUME, "mountPath": labels.CONFIG_DIR, "readOnly": True},
    ]
    if spec.storage.claim_name:
        mounts.append({"name": DATA_VOLUME, "mountPath": spec.storage.mount_path})
    if _is_trainium(spec):
        mounts.append({"name": CACHE_VOLUME, "mountPath": spec.neuron.cache_dir})
    return mounts


def node_selector(spec: PretrainJobSpec) -> dict[str, str]:
    """The labels a worker's node must carry (spec.scheduling, the instance type, the
    template's nodeSelector winning), as the merged pod will have them."""
    selector = dict(spec.scheduling.node_selector)
    if spec.instance_type != "cpu":
        selector.setdefault(labels.INSTANCE_TYPE_LABEL, spec.instance_type)
    theirs = spec.template.spec.get("nodeSelector") if spec.template else None
    return {**selector, **(theirs if isinstance(theirs, dict) else {})}


def _apply_scheduling(pod: PodSpec, spec: PretrainJobSpec, avoid_nodes: list[str],
                      settings: OperatorSettings, place: RankPlacement | None = None) -> None:
    s = spec.scheduling
    selector = dict(s.node_selector)
    if spec.instance_type != "cpu":
        selector.setdefault(labels.INSTANCE_TYPE_LABEL, spec.instance_type)
    if selector:
        pod["nodeSelector"] = selector
    tolerations: list[dict[str, Any]] = []
    if _is_trainium(spec):
        tolerations.append(
            {"key": labels.NEURON_TAINT, "operator": "Exists", "effect": "NoSchedule"}
        )
    if INSTANCE_TYPES[spec.instance_type].gpus:
        tolerations.append({"key": labels.GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"})
    tolerations += [t.model_dump(by_alias=True, exclude_none=True) for t in s.tolerations]
    if tolerations:
        pod["tolerations"] = tolerations
    if avoid_nodes or place:
        pod["affinity"] = build_node_affinity(avoid_nodes, place)
    if s.priority_class_name:
        pod["priorityClassName"] = s.priority_class_name
    scheduler = s.scheduler_name or settings.scheduler_name
    if scheduler:
        pod["schedulerName"] = scheduler


PLANNED_NODE_WEIGHT = 100
"""Preferred-affinity weight of a rank's planned node (the most the API allows)..."""
NEAR_WEIGHT = 50
"""...and of its bottom network level's domain, for when that node is taken."""


def build_node_affinity(avoid: list[str], place: RankPlacement | None = None
                        ) -> dict[str, Any]:
    """Node affinity: required, `metadata.name NotIn [node]` for each avoided node (one
    expression per node: the API server allows a single value per node-field expression; the
    expressions of a term are ANDed), a hard rule because a gang placed on a node that just
    failed tends to fail again, and then the whole gang restarts; and the topology domain
    every pod of the gang shares. Preferred: the rank's planned node, then its bottom-level
    network domain (kube-scheduler's NodeAffinity score plugin sums the matching weights)."""
    term: dict[str, Any] = {}
    if avoid:
        term["matchFields"] = [{"key": "metadata.name", "operator": "NotIn", "values": [n]}
                               for n in avoid]
    if place and place.required:
        level, value = place.required
        term["matchExpressions"] = [{"key": level, "operator": "In", "values": [value]}]
    affinity: dict[str, Any] = {}
    if term:
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": [term]}
    preferred = []
    if place and place.node:
        preferred.append({"weight": PLANNED_NODE_WEIGHT, "preference": {"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [place.node]}]}})
    if place and place.near:
        level, value = place.near
        preferred.append({"weight": NEAR_WEIGHT, "preference": {"matchExpressions": [
            {"key": level, "operator": "In", "values": [value]}]}})
    if preferred:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return {"nodeAffinity": affinity}


HOLD_CONTAINER = "checkpoint-hold"
EVALUATION_TTL_SECONDS = 86400
"""A finished evaluation Job (and its pods' logs) stays this long; its result is in status."""


def build_evaluation_job(job: JobRef, spec: PretrainJobSpec, step: int,
                         settings: OperatorSettings) -> BatchJob:
    """The batch/v1 Job that evaluates the durable checkpoint of `step` (spec.evaluation):
    one pod, never restarted in place (the Job retries `retries` times), on the evaluation's
    own nodes, with the workers' volumes and mounts (the checkpoint directory is where the
    workers see it) and the job's config; its result comes back as the container's
    termination message (`evaluations.RESULT_PATH`). A native sidecar (an init container
    with restartPolicy Always) runs `hlat-eval --hold` from the trainer image beside the
    evaluator, so that checkpoint.keep never deletes the checkpoint while any evaluator,
    ours or the user's own, reads it."""
    ev = spec.evaluation
    assert ev is not None
    worker = build_worker_pod(job, spec, 0, 0, settings)
    trainer = next(c for c in worker["spec"]["containers"] if c["name"] == CONTAINER)
    name = labels.evaluation_job_name(job.name, step)
    extra = {labels.COMPONENT: labels.EVALUATION, labels.STEP: str(step)}
    env: list[EnvVar] = [
        {"name": str(Env.JOB_NAME), "value": job.name},
        {"name": str(Env.NAMESPACE), "value": job.namespace},
        {"name": str(Env.CONFIG), "value": f"{labels.CONFIG_DIR}/{labels.CONFIG_FILE}"},
        {"name": str(Env.EVAL_STEP), "value": str(step)},
        {"name": str(Env.EVAL_RESULT), "value": RESULT_PATH},
    ]
    env += [e for e in trainer.get("env", []) if not e["name"].startswith("HLAT_")]
    mounts = list(trainer.get("volumeMounts", []))
    ours = resolve_image(spec, settings) or ""
    command = list(ev.command)
    if command[0] == "hlat-eval":
        command = [*settings.eval_command, *command[1:]]
    container: Container = {
        "name": EVALUATOR,
        "image": ev.image or ours,
        "command": command,
        "env": env,
        "volumeMounts": mounts,
        "terminationMessagePath": RESULT_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    hold: dict[str, Any] = {
        "name": HOLD_CONTAINER,
        "image": ours,
        "command": [*settings.eval_command, "--hold"],
        "env": env,
        "volumeMounts": mounts,
        "restartPolicy": "Always",
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
    }
    if ev.resources:
        container["resources"] = {"requests": dict(ev.resources), "limits": dict(ev.resources)}
    if settings.image_pull_policy:
        container["imagePullPolicy"] = hold["imagePullPolicy"] = settings.image_pull_policy
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "initContainers": [hold],
        "containers": [container],
        "volumes": list(worker["spec"].get("volumes", [])),
    }
    theirs: dict[str, Any] = dict(worker["spec"])
    for key in ("imagePullSecrets", "securityContext"):
        if key in theirs:
            pod_spec[key] = theirs[key]
    if spec.template is not None and "serviceAccountName" in spec.template.spec:
        pod_spec["serviceAccountName"] = spec.template.spec["serviceAccountName"]
    if ev.node_selector:
        pod_spec["nodeSelector"] = dict(ev.node_selector)
    if ev.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True)
                                   for t in ev.tolerations]
    meta = _meta(job, name, extra)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": ev.retries,
            "activeDeadlineSeconds": ev.deadline_seconds,
            "ttlSecondsAfterFinished": EVALUATION_TTL_SECONDS,
            "template": {"metadata": {"labels": {**meta["labels"]}}, "spec": pod_spec},
        },
    }
