"""The chart through the real Helm CLI (v3.19.2, built from its Go module with its release
ldflags): lint, templates over a matrix of values, RBAC that covers what the operator does and
no more; on the local cluster, install / upgrade / uninstall and the CRD's lifecycle, and what
the chart's ServiceAccount may and may not do (asked of the real RBAC authorizer)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import install_crd

pytestmark = [pytest.mark.slow]

CHART = Path(__file__).parents[2] / "charts" / "hlat"
CRD = "pretrainjobs.hlat.dev"
RELEASE_NS = "hlat-system"
IMAGE = "image.repository=123456789012.dkr.ecr.us-west-2.amazonaws.com/hlat-operator"
"""No operator image is published: the chart needs one named (README, "On EKS")."""


def run(helm: Path, *args: str, kubeconfig: Path | None = None, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    argv = [str(helm), *args]
    if kubeconfig is not None:
        argv += ["--kubeconfig", str(kubeconfig)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(helm: Path, *sets: str, api_versions: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    args = ["template", "hlat", str(CHART), "-n", RELEASE_NS, "--set", IMAGE]
    for s in sets:
        args += ["--set", s]
    for v in api_versions:
        args += ["--api-versions", v]
    return [d for d in yaml.safe_load_all(run(helm, *args).stdout) if d]


def grants(docs: list[dict[str, Any]], kind: str, namespace: str | None = None
           ) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs over the Roles/ClusterRoles of `kind` (in `namespace`)."""
    out: dict[tuple[str, str], set[str]] = {}
    for doc in docs:
        if doc["kind"] != kind or (namespace and doc["metadata"].get("namespace") != namespace):
            continue
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


# What the operator does (k8s.py, kopf's watches), per namespace it watches.
NEEDED = {
    ("hlat.dev", "pretrainjobs"): {"get", "list", "watch", "patch", "delete"},
    ("hlat.dev", "pretrainjobs/status"): {"patch"},
    ("hlat.dev", "pretrainjobs/finalizers"): {"update"},
    ("", "pods"): {"list", "watch", "create", "delete", "patch"},  # patch: in-place restarts
    ("", "services"): {"create"},
    ("", "serviceaccounts"): {"create"},
    ("", "configmaps"): {"create", "update"},
    ("rbac.authorization.k8s.io", "roles"): {"create", "update"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"create", "update"},
    # watch: launchers' trainer-exit reports (in-place restarts), a server-side selector
    ("coordination.k8s.io", "leases"): {"list", "watch", "create", "delete", "update", "get",
                                        "patch"},
    ("", "events"): {"create"},
    ("scheduling.volcano.sh", "podgroups"): {"create", "patch"},  # patch: minMember (elastic)
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "watch", "create", "patch"},  # patch: spec.active
    ("kueue.x-k8s.io", "workloads/status"): {"update"},
    ("policy", "poddisruptionbudgets"): {"create", "delete"},
    ("batch", "jobs"): {"list", "watch", "create"},  # evaluation Jobs (spec.evaluation)
}
CLUSTER_READS = {("", "nodes"), ("apiextensions.k8s.io", "customresourcedefinitions"),
                 ("", "namespaces"), ("kueue.x-k8s.io", "resourceflavors"),
                 ("kueue.x-k8s.io", "workloadpriorityclasses")}


# --- without a cluster -------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [
    (), ("operator.watchNamespace=team-a",), ("operator.watchNamespace={team-a,team-b}",),
    ("crds.install=false",), ("serviceMonitor.enabled=true", "podMonitor.enabled=true"),
    ("global.imageRegistry=example.com",),
], ids=["defaults", "one-namespace", "two-namespaces", "no-crd", "monitors", "global"])
def test_helm_lint_strict_passes(helm: Path, sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART), "--set", IMAGE]
    for s in sets:
        args += ["--set", s]
    assert "0 chart(s) failed" in run(helm, *args).stdout


def test_values_outside_the_schema_are_refused_by_helm(helm: Path) -> None:
    bad = run(helm, "template", "hlat", str(CHART), "--set", "operator.watchNamespace=Team_A",
              check=False)
    assert bad.returncode != 0 and "watchNamespace" in bad.stderr
    bad = run(helm, "template", "hlat", str(CHART), "--set", "replicaCount=9", check=False)
    assert bad.returncode != 0 and "replicaCount" in bad.stderr
    bad = run(helm, "template", "hlat", str(CHART), "--set", "replicaCount=2",
              "--set", "operator.leaderElection=false", check=False)
    assert bad.returncode != 0 and "needs operator.leaderElection" in bad.stderr


def test_all_namespaces_one_cluster_role_covers_what_the_operator_does(helm: Path) -> None:
    docs = render(helm)
    namespaced = grants(docs, "ClusterRole")
    for key, verbs in NEEDED.items():
        assert verbs <= namespaced.get(key, set()), f"{key}: missing {verbs - namespaced[key]}"
    assert "*" not in {v for vs in namespaced.values() for v in vs}
    # the one Role: the leader Lease in the operator's own namespace
    assert grants(docs, "Role") == {("coordination.k8s.io", "leases"): {"create", "get", "update"}}
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"} == {RELEASE_NS}
    for key in CLUSTER_READS:
        assert namespaced[key] == {"get", "list", "watch"}, key
    assert not ({"", "secrets"} & {r for _, r in namespaced})


@pytest.mark.parametrize("watched", [["team-a"], ["team-a", "team-b"]])
def test_watched_namespaces_get_roles_and_nothing_else_is_cluster_wide(
        helm: Path, watched: list[str]) -> None:
    value = watched[0] if len(watched) == 1 else "{" + ",".join(watched) + "}"
    docs = render(helm, f"operator.watchNamespace={value}")
    cluster = grants(docs, "ClusterRole")
    assert set(cluster) == CLUSTER_READS
    assert all(verbs == {"get", "list", "watch"} for verbs in cluster.values())
    for ns in watched:
        role = grants(docs, "Role", ns)
        for key, verbs in NEEDED.items():
            assert verbs <= role.get(key, set()), f"{ns} {key}"
        (binding,) = [d for d in docs if d["kind"] == "RoleBinding"
                      and d["metadata"]["namespace"] == ns]
        assert binding["subjects"][0]["namespace"] == RELEASE_NS
    env = {e["name"]: e["value"] for d in docs if d["kind"] == "Deployment"
           for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HLAT_OPERATOR_NAMESPACE"] == ",".join(watched)


def test_monitors_only_where_the_monitoring_api_exists(helm: Path) -> None:
    sets = ("serviceMonitor.enabled=true", "podMonitor.enabled=true")
    assert not [d for d in render(helm, *sets) if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    kinds = {d["kind"] for d in render(helm, *sets, api_versions=(
        "monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor"))}
    assert {"ServiceMonitor", "PodMonitor"} <= kinds


def test_the_crd_is_the_generated_one_and_kept_on_uninstall(helm: Path) -> None:
    (crd,) = [d for d in render(helm) if d["kind"] == "CustomResourceDefinition"]
    generated = yaml.safe_load((Path(__file__).parents[2] / "crds" / "pretrainjob.yaml")
                               .read_text())
    assert crd["spec"] == generated["spec"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert not [d for d in render(helm, "crds.install=false")
                if d["kind"] == "CustomResourceDefinition"]


# --- on the local cluster ------------------------------------------------------------------


@pytest.fixture
def release(cluster: Cluster, helm: Path) -> Iterator[tuple[str, str]]:
    """A release name and its namespace; uninstalled (and the namespace deleted) afterwards."""
    name, ns = f"hlat-{uuid.uuid4().hex[:5]}", f"hlat-sys-{uuid.uuid4().hex[:5]}"
    yield name, ns
    run(helm, "uninstall", name, "-n", ns, "--wait", kubeconfig=cluster.kubeconfig, check=False)
    core = client.CoreV1Api(cluster.admin_api())
    for namespace in [ns, *[n.metadata.name for n in core.list_namespace(
            label_selector=f"hlat-test={name}").items]]:
        try:
            core.delete_namespace(namespace)
        except ApiException as err:
            if err.status != 404:
                raise


def _can(api: client.ApiClient, sa: tuple[str, str], verb: str, resource: str,
         namespace: str = "", group: str = "") -> bool:
    ns, name = sa
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=f"system:serviceaccount:{ns}:{name}",
        groups=["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"],
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, resource=resource, namespace=namespace or None, group=group)))
    result: Any = client.AuthorizationV1Api(api).create_subject_access_review(review)
    return bool(result.status.allowed)


@pytest.mark.cluster
def test_install_in_one_namespace_grants_there_and_nowhere_else(
        cluster: Cluster, helm: Path, release: tuple[str, str]) -> None:
    name, ns = release
    api = cluster.admin_api()
    core = client.CoreV1Api(api)
    team = f"team-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=team, labels={"hlat-test": name})))
    run(helm, "install", name, str(CHART), "-n", ns, "--create-namespace",
        "--set", "replicaCount=0", "--set", "crds.install=false",
        "--set", f"operator.watchNamespace={team}", kubeconfig=cluster.kubeconfig)
    sa = (ns, name)
    assert _can(api, sa, "create", "pods", team)
    assert _can(api, sa, "patch", "pretrainjobs", team, "hlat.dev")
    assert _can(api, sa, "update", "pretrainjobs/finalizers", team, "hlat.dev")
    assert _can(api, sa, "list", "nodes")
    # and nothing it does not need, where it does not watch
    assert not _can(api, sa, "create", "pods", "kube-system")
    assert not _can(api, sa, "create", "pods", "default")
    assert not _can(api, sa, "update", "configmaps", "kube-system")
    assert not _can(api, sa, "get", "secrets", team)
    assert not _can(api, sa, "list", "secrets")
    assert not _can(api, sa, "patch", "nodes")
    assert not _can(api, sa, "create", "clusterrolebindings", group="rbac.authorization.k8s.io")


@pytest.mark.cluster
def test_install_upgrade_uninstall_and_the_crd_lifecycle(
        cluster: Cluster, helm: Path, release: tuple[str, str], tmp_path: Path) -> None:
    name, ns = release
    api = cluster.admin_api()
    ext = client.ApiextensionsV1Api(api)
    install_crd(api)  # as `kubectl apply -f crds/` leaves it: not Helm's
    args = ("-n", ns, "--set", "replicaCount=0")
    plain = run(helm, "install", name, str(CHART), *args, "--create-namespace",
                kubeconfig=cluster.kubeconfig, check=False)
    # Helm names the conflict and the object; the README says what to do (either flag below)
    assert plain.returncode != 0 and CRD in plain.stderr
    assert "invalid ownership metadata" in plain.stderr
    run(helm, "uninstall", name, "-n", ns, kubeconfig=cluster.kubeconfig, check=False)
    run(helm, "install", name, str(CHART), *args, "--create-namespace", "--take-ownership",
        kubeconfig=cluster.kubeconfig)
    crd: Any = ext.read_custom_resource_definition(CRD)
    assert crd.metadata.annotations["meta.helm.sh/release-name"] == name
    # an upgrade carries a schema change to the API server
    chart = tmp_path / "hlat"
    shutil.copytree(CHART, chart)
    crd_file = chart / "files" / "pretrainjob-crd.yaml"
    marker = "Schema change carried by helm upgrade."
    crd_file.write_text(crd_file.read_text().replace(
        "            description: What to train, on what, and how to survive faults.\n",
        f"            description: {marker}\n", 1))
    assert marker in crd_file.read_text()
    run(helm, "upgrade", name, str(chart), *args, kubeconfig=cluster.kubeconfig)
    crd = ext.read_custom_resource_definition(CRD)
    spec_schema = crd.spec.versions[0].schema.open_apiv3_schema.properties["spec"]
    assert spec_schema.description == marker
    run(helm, "upgrade", name, str(CHART), *args, kubeconfig=cluster.kubeconfig)
    # uninstall keeps the CRD (and with it every PretrainJob)
    run(helm, "uninstall", name, "-n", ns, "--wait", kubeconfig=cluster.kubeconfig)
    crd = ext.read_custom_resource_definition(CRD)
    assert crd.metadata.deletion_timestamp is None
    install_crd(api)  # hand it back to the other tests as they found it
