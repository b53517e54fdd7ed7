"""hlat-doctor: each missing add-on named with its fix, the exit code a script can act on, and
the same verdicts against the real local cluster (its nodes as the rig models EKS's)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hlat_operator import doctor
from hlat_operator.doctor import ClusterView, Finding, diagnose

ROOT = Path(__file__).resolve().parents[2]


def node(name: str, itype: str = "trn1.32xlarge", neuron: str | None = "16",
         efa: str | None = "8", health: bool = True, topology: bool = True
         ) -> dict[str, Any]:
    alloc = {"cpu": "127", "memory": "470Gi"}
    if neuron is not None:
        alloc["aws.amazon.com/neuron"] = neuron
    if efa is not None:
        alloc["vpc.amazonaws.com/efa"] = efa
    conds = [{"type": "Ready", "status": "True"}]
    if health:
        conds.append({"type": "AcceleratedHardwareReady", "status": "True"})
    layers = {f"topology.k8s.aws/network-node-layer-{i}": f"nn-{i}-{name}" for i in (1, 2, 3)}
    return {"metadata": {"name": name, "labels": {"node.kubernetes.io/instance-type": itype,
                                                  **(layers if topology else {})}},
            "status": {"allocatable": alloc, "conditions": conds}}


def healthy(**overrides: Any) -> ClusterView:
    view = ClusterView(
        crds=["pretrainjobs.hlat.dev"],
        operators=[{"metadata": {"name": "hlat", "namespace": "hlat-system"},
                    "spec": {"replicas": 2}, "status": {"readyReplicas": 2}}],
        nodes=[node("n1"), node("n2")],
        daemonsets=[],
        csi_drivers=["fsx.csi.aws.com"],
        claim_name="fsx", namespace="team-a",
        claim={"metadata": {"name": "fsx"}, "spec": {"accessModes": ["ReadWriteMany"]},
               "status": {"phase": "Bound"}},
    )
    for key, value in overrides.items():
        setattr(view, key, value)
    return view


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {f.name: f for f in findings}


def test_a_complete_cluster_passes_and_says_what_it_did_not_check() -> None:
    findings = diagnose(healthy())
    assert all(f.state == "ok" for f in findings), [f for f in findings if f.state != "ok"]
    out = doctor.report(findings)
    assert "every required piece the API shows is present" in out
    assert "security groups" in out and "not checked" in out


@pytest.mark.parametrize(("overrides", "name", "fix"), [
    ({"crds": []}, "PretrainJob CRD", "kubectl apply -f crds/"),
    ({"operators": []}, "HLAT operator", "helm install hlat"),
    ({"nodes": [node("n1", efa=None), node("n2", efa="0")]}, "EFA device plugin",
     "aws-efa-k8s-device-plugin"),
    ({"nodes": [node("n1", neuron=None)]}, "Neuron device plugin", "neuron-helm-chart"),
    ({"nodes": [node("n1", itype="m5.large")]}, "node labels", "spec.instanceType"),
    ({"claim": None}, "claim team-a/fsx", "ReadWriteMany PersistentVolumeClaim"),
    ({"claim": {"spec": {"accessModes": ["ReadWriteOnce"]}, "status": {"phase": "Bound"}}},
     "claim team-a/fsx", "ReadWriteMany"),
    ({"claim": {"spec": {"accessModes": ["ReadWriteMany"]}, "status": {"phase": "Pending"}}},
     "claim team-a/fsx", "FSx for Lustre"),
    ({"claim_name": None, "csi_drivers": []}, "FSx CSI driver", "aws-fsx-csi-driver"),
])
def test_each_missing_piece_is_named_with_its_fix_and_fails_the_check(
        overrides: dict[str, Any], name: str, fix: str) -> None:
    findings = diagnose(healthy(**overrides))
    f = by_name(findings)[name]
    assert f.state == "missing" and f.required and fix in f.fix, f
    assert [g.name for g in findings if g.failed] == [name]
    out = doctor.report(findings)
    assert f"[MISSING] {name}" in out and f"1 required piece(s) missing: {name}" in out


def test_a_device_plugin_daemonset_that_advertises_nothing_is_pointed_at() -> None:
    view = healthy(nodes=[node("n1", efa=None)],
                   daemonsets=[{"metadata": {"name": "aws-efa-k8s-device-plugin-daemonset",
                                             "namespace": "kube-system"}}])
    f = by_name(diagnose(view))["EFA device plugin"]
    assert f.state == "missing" and "kube-system/aws-efa-k8s-device-plugin" in f.detail
    assert "tolerations" in f.detail


def test_hyperpod_instance_type_names_count() -> None:
    f = by_name(diagnose(healthy(nodes=[node("h1", itype="ml.trn1.32xlarge")])))["node labels"]
    assert f.state == "ok" and "ml.trn1.32xlarge x1" in f.detail


def test_advisories_warn_without_failing() -> None:
    view = healthy(nodes=[node("n1", health=False)], csi_drivers=[])
    findings = by_name(diagnose(view))
    assert findings["node monitoring agent"].state == "warn"
    assert "eks-node-monitoring-agent" in findings["node monitoring agent"].fix
    assert findings["FSx CSI driver"].state == "warn"  # the claim is bound through another
    assert not any(f.failed for f in findings.values())
    agent = by_name(diagnose(healthy(
        nodes=[node("n1", health=False)],
        daemonsets=[{"metadata": {"name": "eks-node-monitoring-agent",
                                  "namespace": "kube-system"}}])))["node monitoring agent"]
    assert agent.state == "ok"


def test_nodes_without_network_topology_labels_are_an_advisory() -> None:
    f = by_name(diagnose(healthy(nodes=[node("n1"), node("n2", topology=False)])))[
        "network topology labels"]
    assert f.state == "warn" and not f.failed
    assert "1 of 2 accelerated node(s) lack topology.k8s.aws/network-node-layer-3" in f.detail
    assert "scheduling.topology" in f.fix
    ok = by_name(diagnose(healthy()))["network topology labels"]
    assert ok.state == "ok" and "all 2 accelerated node(s), 2 block(s)" in ok.detail


def test_an_operator_scaled_to_zero_is_a_warning_not_a_pass() -> None:
    f = by_name(diagnose(healthy(operators=[{"metadata": {"name": "hlat",
                                                          "namespace": "hlat-system"},
                                             "spec": {"replicas": 0}, "status": {}}])))
    assert f["HLAT operator"].state == "warn" and "scaled to 0" in f["HLAT operator"].detail


def test_what_could_not_be_read_is_said_not_guessed() -> None:
    view = healthy(nodes=None, errors={"nodes": "Forbidden"})
    f = by_name(diagnose(view))["EFA device plugin"]
    assert f.state == "warn" and "could not read nodes: Forbidden" in f.detail


def test_the_exit_code_is_non_zero_when_something_required_is_missing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kubernetes import config
    monkeypatch.setattr(config, "load_kube_config", lambda **_: None)
    monkeypatch.setattr(doctor, "read_cluster", lambda *_: healthy())
    assert doctor.main([]) == 0
    monkeypatch.setattr(doctor, "read_cluster", lambda *_: healthy(crds=[]))
    assert doctor.main([]) == 1
    assert "[MISSING] PretrainJob CRD" in capsys.readouterr().out


# --- on the local cluster ------------------------------------------------------------------


def _doctor(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "hlat-doctor"),
                           "--kubeconfig", str(kubeconfig), *args],
                          capture_output=True, text=True, timeout=120)


def _efa_nodes(core: Any) -> list[str]:
    return [n.metadata.name for n in core.list_node().items
            if (n.status.allocatable or {}).get("vpc.amazonaws.com/efa", "0") != "0"]


@pytest.mark.cluster
def test_on_the_local_cluster_what_the_rig_models_passes(cluster: Any, crd: None, core: Any,
                                                         namespace: str, tmp_path: Path
                                                         ) -> None:
    """CRD, Neuron and EFA resources, instance-type labels and a Bound ReadWriteMany claim are
    all there as the rig models EKS; the FSx CSI driver is not (the rig's claim is a host
    directory) and is a warning, the operator runs outside the cluster (not a failure of
    what the rig can show), and what no API shows is listed as not checked."""
    cluster.create_shared_volume(namespace, "fsx", tmp_path / "fsx")
    try:
        deadline = time.monotonic() + 30
        while (core.read_namespaced_persistent_volume_claim("fsx", namespace).status.phase
               != "Bound" and time.monotonic() < deadline):
            time.sleep(0.5)
        proc = _doctor(cluster.kubeconfig, "-n", namespace, "--claim", "fsx")
    finally:
        core.delete_persistent_volume(f"{namespace}-fsx")
    out = proc.stdout
    for name in ("PretrainJob CRD", "Neuron device plugin", "EFA device plugin", "node labels",
                 f"claim {namespace}/fsx"):
        assert f"[ok     ] {name}:" in out, out
    assert "[warn   ] FSx CSI driver: CSIDriver fsx.csi.aws.com not found" in out, out
    assert "not checked (outside the Kubernetes API)" in out and "security groups" in out
    # the operator is a local process here: the chart's Deployment has 0 replicas, or, when
    # no test installed the chart yet, none exists; nothing else may fail
    missing = [line for line in out.splitlines() if line.startswith("[MISSING]")]
    assert all(line.startswith("[MISSING] HLAT operator") for line in missing), out
    assert proc.returncode == (1 if missing else 0), out


@pytest.mark.cluster
def test_on_the_local_cluster_a_missing_efa_device_plugin_is_named(cluster: Any, crd: None,
                                                                    core: Any) -> None:
    """EFA's resource removed from every node that had it, as where its device plugin never
    ran: the preflight names the EFA device plugin with its fix and exits 1, and still does
    after the nodes' kubelets have written their status again (the fault holds)."""
    from hlat_testbed import faults
    from hlat_testbed.kubelet import STATUS_PERIOD_S

    nodes = _efa_nodes(core)
    assert nodes, "the rig's nodes should advertise vpc.amazonaws.com/efa"
    api = cluster.admin_api()
    try:
        for name in nodes:
            faults.without_resource(cluster.config, api, name, "vpc.amazonaws.com/efa")
        first = _doctor(cluster.kubeconfig)
        time.sleep(STATUS_PERIOD_S + 2)  # every kubelet has patched its status since
        assert _efa_nodes(core) == []
        again = _doctor(cluster.kubeconfig)
    finally:
        for name in nodes:
            faults.with_resource(cluster.config, name, "vpc.amazonaws.com/efa")
        deadline = time.monotonic() + STATUS_PERIOD_S * 3
        while sorted(_efa_nodes(core)) != sorted(nodes) and time.monotonic() < deadline:
            time.sleep(1)
    for proc in (first, again):
        assert "[MISSING] EFA device plugin: no node advertises vpc.amazonaws.com/efa" \
            in proc.stdout, proc.stdout
        assert "aws-efa-k8s-device-plugin" in proc.stdout and proc.returncode == 1
    assert "[ok     ] Neuron device plugin" in first.stdout
    assert sorted(_efa_nodes(core)) == sorted(nodes)  # restored for the tests after
