"""hlat-doctor: does this cluster have what a PretrainJob needs, and if not, what to install.

A job on a cluster that lacks an add-on fails late and far from the cause: pods Pending on
`Insufficient vpc.amazonaws.com/efa` an hour after `kubectl apply`, or checkpoints on a claim
that never binds. The preflight reads the cluster once (the current kubeconfig, read-only) and
names each missing piece with the command or AWS page that fixes it.

Design choices:
- `diagnose` is pure: it takes what was read (`ClusterView`) and returns `Finding`s, so every
  verdict is tested without a cluster; `read_cluster` is the only I/O.
- A device plugin counts as present when some node advertises its resource in allocatable
  (what the scheduler uses); a DaemonSet alone is not enough (it may not run on the
  accelerated nodes), but it is named when found, which points at its tolerations.
- Required (exit 1 when missing): the CRD, an operator, the Neuron and EFA device plugins, a
  node with a known instance type, the claim (Bound, ReadWriteMany) when `--claim` is given,
  else the FSx CSI driver. Advisory: the node monitoring agent (jobs run without it, but a
  failing device is then seen only as crashes), and the FSx CSI driver when the named claim is
  bound through another driver.
- What the Kubernetes API cannot show is listed as not checked, never passed silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hlat_api import labels
from hlat_api.manifest import API_GROUP
from hlat_api.presets import INSTANCE_TYPES

Raw = Mapping[str, Any]
State = Literal["ok", "missing", "warn"]

CRD_NAME = f"pretrainjobs.{API_GROUP}"
OPERATOR_SELECTOR = "app.kubernetes.io/name=hlat,app.kubernetes.io/component=operator"
"""The chart's labels on the operator Deployment (charts/hlat/templates/_helpers.tpl)."""
FSX_CSI_DRIVER = "fsx.csi.aws.com"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
HEALTH_CONDITION = "AcceleratedHardwareReady"
"""Set on every node by the EKS node monitoring agent (docs.aws.amazon.com/eks/latest/
userguide/node-health.html)."""

NEURON_FIX = ("helm upgrade --install neuron-helm-chart "
              "oci://public.ecr.aws/neuron/neuron-helm-chart --set npd.enabled=false  "
              "(Neuron docs, 'Deploy Neuron Device Plugin': awsdocs-neuron.readthedocs-hosted"
              ".com/en/latest/containers/tutorials/k8s-neuron-device-plugin.html)")
EFA_FIX = ("helm repo add eks https://aws.github.io/eks-charts && helm install "
           "aws-efa-k8s-device-plugin eks/aws-efa-k8s-device-plugin -n kube-system  "
           "(docs.aws.amazon.com/eks/latest/userguide/device-management-efa.html)")
FSX_FIX = ("helm repo add aws-fsx-csi-driver https://kubernetes-sigs.github.io/aws-fsx-csi-driver"
           " && helm upgrade --install aws-fsx-csi-driver aws-fsx-csi-driver/aws-fsx-csi-driver"
           " -n kube-system  (docs.aws.amazon.com/eks/latest/userguide/fsx-csi.html)")
AGENT_FIX = ("aws eks create-addon --cluster-name <cluster> --addon-name "
             "eks-node-monitoring-agent  (docs.aws.amazon.com/eks/latest/userguide/"
             "node-health.html)")
CRD_FIX = "kubectl apply -f crds/  (or helm install hlat charts/hlat, which installs it)"
OPERATOR_FIX = ("helm install hlat charts/hlat -n hlat-system --create-namespace "
                "--set image.repository=<your registry>/hlat-operator  (README, 'On EKS')")

NOT_CHECKED = (
    "IAM: the nodes' and the operator's permissions (Pod Identity or IRSA)",
    "security groups: EFA needs a rule allowing all traffic to and from the group itself",
    "the Neuron driver on the nodes' AMI (hlat-launch checks it when a worker starts)",
    "the data on the claim (Arrow files, tokenizer) and the images' pull access",
)


@dataclass(frozen=True)
class Finding:
    name: str
    state: State
    detail: str
    fix: str = ""
    required: bool = True

    @property
    def failed(self) -> bool:
        return self.state == "missing" and self.required


@dataclass
class ClusterView:
    """What `read_cluster` read; a field is None when it could not be read (then its check
    says so instead of guessing)."""

    crds: list[str] | None = None
    operators: list[Raw] | None = None
    nodes: list[Raw] | None = None
    daemonsets: list[Raw] | None = None
    csi_drivers: list[str] | None = None
    claim_name: str | None = None
    namespace: str = "default"
    claim: Raw | None = None
    errors: dict[str, str] = field(default_factory=dict)


def _name(obj: Raw) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


def _unread(view: ClusterView, what: str, name: str, fix: str) -> Finding:
    return Finding(name, "warn", f"could not read {what}: {view.errors.get(what, 'unknown')}",
                   fix)


def check_crd(view: ClusterView) -> Finding:
    name = "PretrainJob CRD"
    if view.crds is None:
        return _unread(view, "customresourcedefinitions", name, CRD_FIX)
    if CRD_NAME in view.crds:
        return Finding(name, "ok", f"{CRD_NAME} installed")
    return Finding(name, "missing", f"{CRD_NAME} is not installed", CRD_FIX)


def check_operator(view: ClusterView) -> Finding:
    name = "HLAT operator"
    if view.operators is None:
        return _unread(view, "deployments", name, OPERATOR_FIX)
    if not view.operators:
        return Finding(name, "missing", f"no Deployment labelled {OPERATOR_SELECTOR}",
                       OPERATOR_FIX)
    ready = [d for d in view.operators if ((d.get("status") or {}).get("readyReplicas") or 0)]
    if ready:
        return Finding(name, "ok", "Deployment " + ", ".join(_name(d) for d in ready) + " ready")
    wanted = [d for d in view.operators if ((d.get("spec") or {}).get("replicas", 1) or 0)]
    names = ", ".join(_name(d) for d in view.operators)
    if not wanted:
        return Finding(name, "warn", f"Deployment {names} is scaled to 0 replicas: jobs start "
                       "only if an operator runs elsewhere (as on the local cluster)",
                       "kubectl scale deployment -n <namespace> <name> --replicas=1")
    return Finding(name, "missing", f"Deployment {names} has no ready replica",
                   "kubectl describe deployment and its pods (image pull? RBAC?)")


def _advertising(nodes: Iterable[Raw], resource: str) -> list[str]:
    out = []
    for node in nodes:
        value = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
        if value not in (None, "", "0"):
            out.append(str((node.get("metadata") or {}).get("name")))
    return out


def check_device_plugin(view: ClusterView, name: str, resource: str, daemonset_hint: str,
                        fix: str) -> Finding:
    if view.nodes is None:
        return _unread(view, "nodes", name, fix)
    have = _advertising(view.nodes, resource)
    if have:
        return Finding(name, "ok", f"{resource} allocatable on {len(have)} node(s): "
                       + ", ".join(sorted(have)[:5]) + (" ..." if len(have) > 5 else ""))
    sets = [_name(d) for d in view.daemonsets or []
            if daemonset_hint in str((d.get("metadata") or {}).get("name"))]
    if sets:
        return Finding(name, "missing", f"no node advertises {resource}, though DaemonSet "
                       f"{', '.join(sets)} exists: do its pods run on the accelerated nodes "
                       "(nodeSelector, tolerations of the nodes' taints)?", fix)
    return Finding(name, "missing", f"no node advertises {resource} (no device plugin: "
                   "workers asking for it stay Pending)", fix)


def check_instance_types(view: ClusterView) -> Finding:
    name = "node labels"
    fix = (f"nodes need {INSTANCE_TYPE_LABEL} (EKS, Karpenter and HyperPod set it); "
           "spec.instanceType must be one of them")
    if view.nodes is None:
        return _unread(view, "nodes", name, fix)
    seen: dict[str, int] = {}
    for node in view.nodes:
        value = ((node.get("metadata") or {}).get("labels") or {}).get(INSTANCE_TYPE_LABEL)
        if value:
            seen[value] = seen.get(value, 0) + 1
    # HyperPod's EKS nodes carry the SageMaker name (ml.trn1.32xlarge)
    known = {t: n for t, n in seen.items() if t.removeprefix("ml.") in INSTANCE_TYPES}
    listing = ", ".join(f"{t} x{n}" for t, n in sorted(seen.items())) or "none"
    if known:
        return Finding(name, "ok", f"{INSTANCE_TYPE_LABEL}: {listing}")
    return Finding(name, "missing", f"no node has a {INSTANCE_TYPE_LABEL} HLAT knows "
                   f"({', '.join(t for t in INSTANCE_TYPES if t != 'cpu')}); seen: {listing}",
                   fix)


def check_storage(view: ClusterView) -> list[Finding]:
    csi_known = view.csi_drivers is not None
    csi = csi_known and FSX_CSI_DRIVER in (view.csi_drivers or [])
    if view.claim_name is None:
        if not csi_known:
            return [_unread(view, "csidrivers", "FSx CSI driver", FSX_FIX)]
        return [Finding("FSx CSI driver", "ok" if csi else "missing",
                        f"CSIDriver {FSX_CSI_DRIVER} " + ("installed" if csi else "not found")
                        + " (give --claim NAME to check the job's claim)",
                        "" if csi else FSX_FIX)]
    return [_check_claim(view), Finding(
        "FSx CSI driver", "ok" if csi else "warn",
        f"CSIDriver {FSX_CSI_DRIVER} " + ("installed" if csi else
                                          "not found: the claim is served by another driver"
                                          " (fine if every node mounts it read-write)"),
        "" if csi else FSX_FIX, required=False)]


def _check_claim(view: ClusterView) -> Finding:
    name = f"claim {view.namespace}/{view.claim_name}"
    fix = ("create a ReadWriteMany PersistentVolumeClaim on FSx for Lustre (docs.aws.amazon.com"
           "/eks/latest/userguide/fsx-csi.html) and set spec.storage.claimName to it")
    if view.claim is None:
        if "claim" in view.errors:
            return _unread(view, "claim", name, fix)
        return Finding(name, "missing", "not found", fix)
    phase = (view.claim.get("status") or {}).get("phase")
    modes = (view.claim.get("spec") or {}).get("accessModes") or []
    if phase != "Bound":
        return Finding(name, "missing", f"phase {phase}, not Bound", fix)
    if "ReadWriteMany" not in modes:
        return Finding(name, "missing", f"access modes {modes}: every worker writes "
                       "checkpoints, so it must be ReadWriteMany", fix)
    return Finding(name, "ok", "Bound, ReadWriteMany")


TOPOLOGY_FIX = ("spec.scheduling.topology places gangs by these labels; EKS sets them on "
                "trn1, trn2 and p5 nodes (EKS user guide, 'Place distributed AI/ML workloads "
                "with network topology labels'); elsewhere, label the nodes or leave "
                "scheduling.topology unset")


def check_network_topology(view: ClusterView) -> Finding:
    """Advisory: whether the accelerated nodes carry the bottom network layer's label, which
    spec.scheduling.topology (required or preferred by layer) needs."""
    name = "network topology labels"
    if view.nodes is None:
        return _unread(view, "nodes", name, TOPOLOGY_FIX)
    bottom = labels.NETWORK_LAYERS[-1]
    node_labels = [(n.get("metadata") or {}).get("labels") or {} for n in view.nodes]
    accelerated = [lab for lab in node_labels
                   if str(lab.get(INSTANCE_TYPE_LABEL, "")).removeprefix("ml.")
                   in set(INSTANCE_TYPES) - {"cpu"}]
    blocks = {lab[bottom] for lab in accelerated if lab.get(bottom)}
    lacking = sum(not lab.get(bottom) for lab in accelerated)
    if accelerated and not lacking:
        return Finding(name, "ok", f"{bottom} on all {len(accelerated)} accelerated node(s), "
                       f"{len(blocks)} block(s)", required=False)
    return Finding(name, "warn", f"{lacking} of {len(accelerated)} accelerated node(s) lack "
                   f"{bottom}: spec.scheduling.topology cannot place gangs on them",
                   TOPOLOGY_FIX, required=False)


def check_monitoring_agent(view: ClusterView) -> Finding:
    name = "node monitoring agent"
    sets = [_name(d) for d in view.daemonsets or []
            if "node-monitoring-agent" in str((d.get("metadata") or {}).get("name"))]
    reporting = [str((n.get("metadata") or {}).get("name")) for n in view.nodes or []
                 if any(c.get("type") == HEALTH_CONDITION
                        for c in (n.get("status") or {}).get("conditions") or [])]
    if sets or reporting:
        where = f"DaemonSet {', '.join(sets)}" if sets else ""
        if reporting:
            where += ("; " if where else "") + f"{HEALTH_CONDITION} on {len(reporting)} node(s)"
        return Finding(name, "ok", where, required=False)
    return Finding(name, "warn", f"no agent DaemonSet and no node reports {HEALTH_CONDITION}: "
                   "a failing Neuron device shows only as worker crashes", AGENT_FIX,
                   required=False)


def diagnose(view: ClusterView) -> list[Finding]:
    return [
        check_crd(view),
        check_operator(view),
        check_device_plugin(view, "Neuron device plugin", labels.NEURON_RESOURCE,
                            "neuron-device-plugin", NEURON_FIX),
        check_device_plugin(view, "EFA device plugin", labels.EFA_RESOURCE,
                            "efa-k8s-device-plugin", EFA_FIX),
        check_instance_types(view),
        check_network_topology(view),
        *check_storage(view),
        check_monitoring_agent(view),
    ]


def report(findings: list[Finding]) -> str:
    marks = {"ok": "ok", "missing": "MISSING", "warn": "warn"}
    lines = []
    for f in findings:
        mark = marks[f.state] if f.required or f.state != "missing" else "missing"
        lines.append(f"[{mark:7}] {f.name}: {f.detail}")
        if f.fix and f.state != "ok":
            lines.append(f"          fix: {f.fix}")
    lines.append("not checked (outside the Kubernetes API):")
    lines += [f"          - {item}" for item in NOT_CHECKED]
    failed = [f.name for f in findings if f.failed]
    lines.append(f"{len(failed)} required piece(s) missing: {', '.join(failed)}" if failed
                 else "every required piece the API shows is present")
    return "\n".join(lines)


# --- reading the cluster ---------------------------------------------------------------------


def read_cluster(api: Any, namespace: str, claim: str | None) -> ClusterView:
    """One read of each kind, raw JSON; a refusal (RBAC) or error is kept per kind."""
    from kubernetes import client

    view = ClusterView(claim_name=claim, namespace=namespace)

    def items(what: str, call: Callable[[], Any]) -> list[Raw] | None:
        try:
            found: list[Raw] = json.loads(call().data).get("items") or []
            return found
        except Exception as err:  # reported per check, never fatal
            view.errors[what] = getattr(err, "reason", None) or f"{type(err).__name__}: {err}"
            return None

    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    ext, storage = client.ApiextensionsV1Api(api), client.StorageV1Api(api)
    crds = items("customresourcedefinitions", lambda: ext.list_custom_resource_definition(
        _preload_content=False))
    view.crds = None if crds is None else [str(c["metadata"]["name"]) for c in crds]
    view.operators = items("deployments", lambda: apps.list_deployment_for_all_namespaces(
        label_selector=OPERATOR_SELECTOR, _preload_content=False))
    view.nodes = items("nodes", lambda: core.list_node(_preload_content=False))
    view.daemonsets = items("daemonsets", lambda: apps.list_daemon_set_for_all_namespaces(
        _preload_content=False))
    drivers = items("csidrivers", lambda: storage.list_csi_driver(_preload_content=False))
    view.csi_drivers = None if drivers is None else [str(d["metadata"]["name"]) for d in drivers]
    if claim:
        found = items("claim", lambda: core.list_namespaced_persistent_volume_claim(
            namespace, field_selector=f"metadata.name={claim}", _preload_content=False))
        view.claim = found[0] if found else None
    return view


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hlat-doctor",
        description="Check a cluster for what a PretrainJob needs (read-only); exit 1 when a "
                    "required piece is missing.")
    parser.add_argument("--namespace", "-n", default="default",
                        help="the namespace the jobs run in (for --claim)")
    parser.add_argument("--claim", help="the PersistentVolumeClaim of spec.storage.claimName")
    parser.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    parser.add_argument("--context", help="a context of the kubeconfig (default: current)")
    args = parser.parse_args(argv)
    from kubernetes import client, config

    # loaded before the ApiClient exists: its connection pool takes the CA and client
    # certificate from the configuration when it is made
    settings = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=args.kubeconfig, context=args.context, client_configuration=settings)
    api = client.ApiClient(settings)
    findings = diagnose(read_cluster(api, args.namespace, args.claim))
    print(report(findings))
    return 1 if any(f.failed for f in findings) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
