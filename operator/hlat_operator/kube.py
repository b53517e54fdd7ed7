"""TypedDicts for the raw Kubernetes payloads the operator builds and reads.

The builders return plain dicts (what the API server takes and what kopf hands us), typed
here so mypy catches a misspelled key. Only the fields we use are spelled out; `total=False`
because Kubernetes omits what is unset. Deeper, pass-through structures stay `dict[str, Any]`.
"""

from __future__ import annotations

from typing import Any, TypedDict


class OwnerReference(TypedDict):
    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: bool
    blockOwnerDeletion: bool


class ObjectMeta(TypedDict, total=False):
    name: str
    namespace: str
    uid: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ownerReferences: list[OwnerReference]
    creationTimestamp: str
    deletionTimestamp: str
    generation: int


class EnvVar(TypedDict, total=False):
    name: str
    value: str
    valueFrom: dict[str, Any]


class ContainerPort(TypedDict):
    name: str
    containerPort: int


class VolumeMount(TypedDict, total=False):
    name: str
    mountPath: str
    readOnly: bool


class Container(TypedDict, total=False):
    name: str
    image: str
    imagePullPolicy: str
    command: list[str]
    env: list[EnvVar]
    ports: list[ContainerPort]
    resources: dict[str, dict[str, str]]
    volumeMounts: list[VolumeMount]
    terminationMessagePath: str
    terminationMessagePolicy: str
    securityContext: dict[str, Any]


class Volume(TypedDict, total=False):
    name: str
    emptyDir: dict[str, str]
    hostPath: dict[str, str]
    persistentVolumeClaim: dict[str, str]
    configMap: dict[str, Any]


class PodSpec(TypedDict, total=False):
    hostname: str
    subdomain: str
    restartPolicy: str
    serviceAccountName: str
    terminationGracePeriodSeconds: int
    nodeSelector: dict[str, str]
    tolerations: list[dict[str, Any]]
    affinity: dict[str, Any]
    priorityClassName: str
    schedulerName: str
    containers: list[Container]
    initContainers: list[Container]
    volumes: list[Volume]
    enableServiceLinks: bool
    securityContext: dict[str, Any]


class Pod(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: PodSpec
    status: dict[str, Any]


class ServicePort(TypedDict):
    name: str
    port: int
    targetPort: int


class ServiceSpec(TypedDict, total=False):
    clusterIP: str
    selector: dict[str, str]
    publishNotReadyAddresses: bool
    ports: list[ServicePort]


class Service(TypedDict):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: ServiceSpec


class ConfigMap(TypedDict):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    data: dict[str, str]


class ServiceAccount(TypedDict):
    apiVersion: str
    kind: str
    metadata: ObjectMeta


class PolicyRule(TypedDict, total=False):
    apiGroups: list[str]
    resources: list[str]
    resourceNames: list[str]
    verbs: list[str]


class Role(TypedDict):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    rules: list[PolicyRule]


class Subject(TypedDict):
    kind: str
    name: str
    namespace: str


class RoleRef(TypedDict):
    apiGroup: str
    kind: str
    name: str


class RoleBinding(TypedDict):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    subjects: list[Subject]
    roleRef: RoleRef


class LeaseSpec(TypedDict, total=False):
    holderIdentity: str
    leaseDurationSeconds: int
    renewTime: str
    acquireTime: str


class Lease(TypedDict):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: LeaseSpec


class PodGroupSpec(TypedDict):
    minMember: int
    queue: str


class PodGroup(TypedDict):
    """Volcano's scheduling.volcano.sh/v1beta1 PodGroup."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: PodGroupSpec


class PodDisruptionBudgetSpec(TypedDict):
    minAvailable: int
    selector: dict[str, Any]


class PodDisruptionBudget(TypedDict):
    """policy/v1 PodDisruptionBudget."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: PodDisruptionBudgetSpec


class WorkloadSpec(TypedDict, total=False):
    queueName: str
    podSets: list[dict[str, Any]]
    priorityClassRef: dict[str, str]
    priority: int


class Workload(TypedDict):
    """Kueue's kueue.x-k8s.io/v1beta2 Workload."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: WorkloadSpec


class BatchJob(TypedDict):
    """batch/v1 Job (an evaluation Job: builders.build_evaluation_job)."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: dict[str, Any]


Object = (Pod | Service | ConfigMap | ServiceAccount | Role | RoleBinding | Lease | PodGroup
          | PodDisruptionBudget | Workload | BatchJob)
"""Anything the operator creates for a job."""
