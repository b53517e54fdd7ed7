"""`spec.template`: a PodTemplateSpec the worker pods are built on, as in JobSet and Kubeflow.

The user's template carries everything the cluster asks of a pod that HLAT has no opinion on:
a ServiceAccount (IRSA / EKS Pod Identity for S3 and ECR), image pull secrets, env and envFrom,
volumes and mounts, labels and annotations, tolerations, affinity, a priority class, security
contexts, resources, sidecar and init containers. The container named `trainer` is the worker's
own container; the operator merges what it builds onto the template (hlat_operator.podmerge).

The operator's fields win only where correctness needs them, and this module refuses a template
that tries to set one of those, naming the field, instead of dropping it silently:
- the trainer's `command`/`args` (the entrypoint is `hlat-launch`) and the `HLAT_*` variables
  the operator sets (`hlat_api.env.Env`);
- `restartPolicy` (a worker exit is the operator's to judge, not the kubelet's), `hostname`,
  `subdomain` and `nodeName` (the rendezvous DNS and the gang placement);
- the volumes the operator mounts itself (`shm`, `config`, `data`), and the name of its init
  container. A volume named `neuron-cache` is allowed: it replaces the node-local hostPath
  compile cache (e.g. with an emptyDir in a namespace whose Pod Security level forbids hostPath).

Kubernetes validates the rest when the pod is created; an error there ends the job Failed with
the API server's message (the operator never retries a request that cannot succeed).
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hlat_api.env import Env
from hlat_api.errors import SpecError

TRAINER_CONTAINER: Final = "trainer"
"""The worker's container; a template container of this name is merged into it."""
CACHE_OWNER_CONTAINER: Final = "neuron-cache-owner"
"""The operator's init container that hands the compile cache to the trainer's user."""
SHM_VOLUME: Final = "shm"
CONFIG_VOLUME: Final = "config"
DATA_VOLUME: Final = "data"
CACHE_VOLUME: Final = "neuron-cache"
RESERVED_VOLUMES: Final = frozenset({SHM_VOLUME, CONFIG_VOLUME, DATA_VOLUME})
"""Volumes the operator always defines; a template may not redefine them."""
RESERVED_ENV: Final = frozenset(str(e) for e in Env)
"""The variables the operator sets (hlat_api.env.Env): a template may not set them."""
OPERATOR_POD_FIELDS: Final = ("restartPolicy", "hostname", "subdomain", "nodeName")
OPERATOR_CONTAINER_FIELDS: Final = ("command", "args")


class TemplateError(SpecError):
    """A template field the operator owns or cannot merge; `field` is its path under spec."""


class TemplateMetadata(BaseModel):
    """Labels and annotations for every worker pod (the operator's own labels win)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on the worker pods."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Extra annotations on the worker pods (e.g. for a service mesh or a log shipper)."""


class PodTemplate(BaseModel):
    """A Kubernetes PodTemplateSpec for the worker pods: `metadata` (labels, annotations) and
    `spec` (a PodSpec). The container named `trainer` is merged into the worker's container;
    other containers are sidecars. See docs/operator.md, "The pod template"."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    metadata: TemplateMetadata = Field(default_factory=TemplateMetadata)
    """Labels and annotations of the worker pods."""
    spec: dict[str, Any] = Field(default_factory=dict)
    """A PodSpec (as in a Deployment's template): serviceAccountName, imagePullSecrets,
    volumes, tolerations, affinity, nodeSelector, priorityClassName, securityContext,
    initContainers, and containers, of which the one named `trainer` is the worker's."""

    @model_validator(mode="after")
    def _check(self) -> PodTemplate:
        """`template.spec` leaves to the operator what it sets for the gang (restartPolicy,
        hostname, subdomain, nodeName; the trainer container's command, args and `HLAT_*` env;
        its init container and volume names), and names its containers and volumes uniquely:
        docs/operator.md, "The pod template"."""
        check_template(self.spec)
        return self

    def containers(self) -> list[dict[str, Any]]:
        return list(self.spec.get("containers") or [])

    def trainer(self) -> dict[str, Any]:
        """The template's `trainer` container ({} when it has none)."""
        return next((c for c in self.containers() if c.get("name") == TRAINER_CONTAINER), {})

    def sidecars(self) -> list[dict[str, Any]]:
        return [c for c in self.containers() if c.get("name") != TRAINER_CONTAINER]


def _names(items: Any, path: str) -> list[str]:
    if not isinstance(items, list):
        raise TemplateError(path, "must be a list")
    names: list[str] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise TemplateError(f"{path}[{i}].name", "required (a non-empty string)")
        if item["name"] in names:
            raise TemplateError(f"{path}[{i}].name", f"duplicate name {item['name']!r}")
        names.append(item["name"])
    return names


def check_template(spec: dict[str, Any]) -> None:
    """Refuse what the operator owns or cannot merge, naming the field (see the module doc)."""
    base = "template.spec"
    for key in OPERATOR_POD_FIELDS:
        if key in spec:
            raise TemplateError(f"{base}.{key}", "set by the operator for the gang; remove it")
    containers = _names(spec.get("containers") or [], f"{base}.containers")
    inits = _names(spec.get("initContainers") or [], f"{base}.initContainers")
    if CACHE_OWNER_CONTAINER in inits:
        raise TemplateError(f"{base}.initContainers",
                            f"{CACHE_OWNER_CONTAINER!r} is the operator's init container")
    for i, name in enumerate(_names(spec.get("volumes") or [], f"{base}.volumes")):
        if name in RESERVED_VOLUMES:
            raise TemplateError(f"{base}.volumes[{i}].name",
                                f"{name!r} is a volume the operator defines; use another name")
    if TRAINER_CONTAINER not in containers:
        return
    index = containers.index(TRAINER_CONTAINER)
    trainer = spec["containers"][index]
    where = f"{base}.containers[{index}]"
    for key in OPERATOR_CONTAINER_FIELDS:
        if key in trainer:
            raise TemplateError(f"{where}.{key}",
                                "the trainer's entrypoint is hlat-launch, set by the operator")
    for j, var in enumerate(trainer.get("env") or []):
        name = var.get("name", "") if isinstance(var, dict) else ""
        if name in RESERVED_ENV:
            raise TemplateError(f"{where}.env[{j}].name",
                                f"{name} is set by the operator (hlat_api.env.Env)")
