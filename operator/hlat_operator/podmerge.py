"""Merge the operator's worker pod onto the user's `spec.template`: one pure function.

The operator's pod (builders.build_worker_pod) holds what the gang needs to be correct; the
template holds everything else the cluster asks of a pod. The rules, field by field:

- metadata: the template's labels and annotations, the operator's winning on the same key
  (job, attempt and rank labels select the gang);
- command, the HLAT_* env, hostname, subdomain, restartPolicy and the accelerator requests
  (Neuron devices, EFA interfaces, GPUs) are the operator's (hlat_api.podtemplate refuses a
  template that sets them, so nothing is dropped silently);
- lists are joined, the operator's entries first: volumes, mounts, env (a template variable of
  the same name as one of the operator's is dropped), ports, tolerations, init containers,
  sysctls; a template volume named `neuron-cache` replaces the operator's hostPath cache;
- maps are joined, the template's entries winning except where noted: nodeSelector (the instance
  type label is the operator's only when the template leaves it unset), securityContext;
- affinity: the template's, with the operator's avoid-failed-nodes rule ANDed into each of its
  required node selector terms (a term is an OR branch, so the rule must hold in every one);
- serviceAccountName, priorityClassName, schedulerName, terminationGracePeriodSeconds,
  enableServiceLinks and imagePullPolicy: the template's when set;
- cpu and memory: the template's when it sets either requests or limits of that resource,
  else the instance type's defaults (requests = limits: Guaranteed QoS).
"""

from __future__ import annotations

import copy
from typing import Any

from hlat_api.podtemplate import TRAINER_CONTAINER, PodTemplate

Json = dict[str, Any]

_POD_OWNED = ("hostname", "subdomain", "restartPolicy")
_TEMPLATE_FIRST = ("serviceAccountName", "priorityClassName", "schedulerName",
                   "terminationGracePeriodSeconds", "enableServiceLinks")
_SIZED = ("cpu", "memory")


def merge_pod(ours: Json, template: PodTemplate | None) -> Json:
    """The worker pod: `ours` merged onto the template (neither argument is modified)."""
    pod = copy.deepcopy(ours)
    if template is None:
        return pod
    meta, spec = pod["metadata"], pod["spec"]
    theirs = copy.deepcopy(template.spec)
    meta["labels"] = {**template.metadata.labels, **meta.get("labels", {})}
    annotations = {**template.metadata.annotations, **meta.get("annotations", {})}
    if annotations:
        meta["annotations"] = annotations
    merged: Json = {**theirs}
    for key in _POD_OWNED:
        if key in spec:
            merged[key] = spec[key]
    for key in _TEMPLATE_FIRST:
        if key in spec or key in theirs:
            merged[key] = theirs.get(key, spec.get(key))
    merged["volumes"] = _volumes(spec.get("volumes", []), theirs.get("volumes", []))
    merged["initContainers"] = spec.get("initContainers", []) + theirs.get("initContainers", [])
    if not merged["initContainers"]:
        del merged["initContainers"]
    trainer = next(c for c in spec["containers"] if c["name"] == TRAINER_CONTAINER)
    merged["containers"] = [merge_container(trainer, template.trainer()), *template.sidecars()]
    _merge_maps(merged, spec, theirs)
    return {**pod, "spec": merged}


def _volumes(ours: list[Json], theirs: list[Json]) -> list[Json]:
    replaced = {v["name"] for v in theirs}
    return [v for v in ours if v["name"] not in replaced] + theirs


def _by_name(ours: list[Json], theirs: list[Json]) -> list[Json]:
    """The operator's entries, then the template's whose names are not taken."""
    names = {e.get("name") for e in ours}
    return ours + [e for e in theirs if e.get("name") not in names]


def _merge_maps(merged: Json, spec: Json, theirs: Json) -> None:
    selector = {**spec.get("nodeSelector", {}), **theirs.get("nodeSelector", {})}
    if selector:
        merged["nodeSelector"] = selector
    tolerations = spec.get("tolerations", []) + theirs.get("tolerations", [])
    if tolerations:
        merged["tolerations"] = tolerations
    security = {**spec.get("securityContext", {}), **theirs.get("securityContext", {})}
    sysctls = _by_name(spec.get("securityContext", {}).get("sysctls", []),
                       theirs.get("securityContext", {}).get("sysctls", []))
    if sysctls:
        security["sysctls"] = sysctls
    if security:
        merged["securityContext"] = security
    affinity = and_node_affinity(theirs.get("affinity"), spec.get("affinity"))
    if affinity:
        merged["affinity"] = affinity


def and_node_affinity(theirs: Json | None, ours: Json | None) -> Json | None:
    """The template's affinity with our required node-affinity expressions in every term."""
    if not ours:
        return theirs
    if not theirs:
        return copy.deepcopy(ours)
    out = copy.deepcopy(theirs)
    our_terms = ours["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    node_affinity = out.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        for our in our_terms:
            for key in ("matchFields", "matchExpressions"):
                if our.get(key):
                    term[key] = [*term.get(key, []), *our[key]]
    required["nodeSelectorTerms"] = terms
    return out


def merge_container(ours: Json, theirs: Json) -> Json:
    """The trainer container: the template's, with the operator's fields merged in."""
    out: Json = {**copy.deepcopy(theirs), **{k: ours[k] for k in ("name", "command") if k in ours}}
    out["image"] = ours.get("image") or theirs.get("image", "")
    if "imagePullPolicy" in ours and "imagePullPolicy" not in theirs:
        out["imagePullPolicy"] = ours["imagePullPolicy"]
    for key in ("env", "volumeMounts", "ports"):
        joined = _by_name(ours.get(key, []), theirs.get(key, [])) if key != "volumeMounts" else (
            ours.get(key, []) + theirs.get(key, []))
        if joined:
            out[key] = joined
    resources = merge_resources(ours.get("resources", {}), theirs.get("resources", {}))
    if resources:
        out["resources"] = resources
    else:
        out.pop("resources", None)
    return out


def merge_resources(ours: Json, theirs: Json) -> Json:
    """Accelerators are ours; cpu/memory the template's where it names them, else ours."""
    out: Json = {}
    for kind in ("requests", "limits"):
        mine, yours = dict(ours.get(kind, {})), dict(theirs.get(kind, {}))
        for name in _SIZED:
            if name in theirs.get("requests", {}) or name in theirs.get("limits", {}):
                mine.pop(name, None)
        values = {**yours, **mine}
        if values:
            out[kind] = values
    return out
