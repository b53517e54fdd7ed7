"""Kueue on the local cluster: its CRDs and a real Kueue manager process (v0.17.0).

Built from its Go module like the control plane (hlat_testbed.build.KUEUE); its CRDs are the
module's bases (`config/components/crd/bases/`, v1beta2 the storage version, no conversion
webhook), copied out at build time. Run as on a cluster where Kueue is installed, with what a
process outside the cluster needs instead of the in-cluster Deployment:

- `internalCertManagement.enable: false`: Kueue's cert rotator would wait for its webhook
  Secret and configurations, which an out-of-cluster manager does not have. Kueue then reads its
  webhook certificate from `webhook.certDir` and, hard-coded, its metrics certificate from
  `/etc/kueue/metrics/certs/` (cmd/kueue/main.go, v0.17.0: it exits when either is missing);
  both are self-signed here, served on loopback.
- No webhook configurations are registered: the API server never calls Kueue's webhooks. Its
  Workload webhooks only default `minCount` and check requests against limits
  (pkg/webhooks/workload_webhook.go); the CRDs' own defaults and CEL rules, which the API
  server applies, do the rest. PretrainJob is an external framework: Kueue has no webhook for it.
- `--feature-gates=VisibilityOnDemand=false` (else it wants `/visibility/tls.crt`), no leader
  election, `integrations.externalFrameworks: [PretrainJob.v1alpha1.hlat.dev]`.

Started on demand (`hlat-cluster kueue up`, or the tests' fixture), not by `hlat-cluster up`.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_api.manifest import API_GROUP, API_VERSION, KIND
from hlat_testbed import build, pki
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import install_component_crds
from hlat_testbed.prometheus import free_port

PROCESS = "kueue"
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
API = f"{GROUP}/{VERSION}"
PLURALS = {"ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues",
           "LocalQueue": "localqueues", "WorkloadPriorityClass": "workloadpriorityclasses",
           "Topology": "topologies", "Cohort": "cohorts"}
NAMESPACE = "kueue-system"
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
"""Where Kueue v0.17.0 reads its metrics certificate when its internal certificate management
is off: fixed in cmd/kueue/main.go, not configurable."""
EXTERNAL_FRAMEWORK = f"{KIND}.{API_VERSION}.{API_GROUP}"
"""`Kind.version.group`, the form `integrations.externalFrameworks` takes (Kueue's config
validation, pkg/config/validation.go)."""


def configuration(webhook_port: int, webhook_certs: Path, health_port: int) -> dict[str, Any]:
    """Kueue's `Configuration` (config.kueue.x-k8s.io/v1beta2) for a manager out of cluster."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "internalCertManagement": {"enable": False},
        "leaderElection": {"leaderElect": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(webhook_certs)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "integrations": {"frameworks": ["batch/job"],
                         "externalFrameworks": [EXTERNAL_FRAMEWORK]},
    }


def is_running(cluster: Cluster) -> bool:
    return cluster.processes.pid(PROCESS) is not None


def start(cluster: Cluster, timeout: float = 120) -> None:
    """Install the CRDs and start the manager (no-op if it runs); wait until it is ready."""
    api = cluster.admin_api()
    install_component_crds(api, build.KUEUE)
    if is_running(cluster):
        return
    try:
        client.CoreV1Api(api).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    except ApiException as err:
        if err.status != 409:
            raise
    state = cluster.config.state / "kueue"
    pki.self_signed_loopback(state / "webhook-certs", "kueue-local")
    pki.self_signed_loopback(METRICS_CERTS, "kueue-local")
    health = free_port()
    config = state / "config.yaml"
    config.write_text(yaml.safe_dump(configuration(free_port(), state / "webhook-certs",
                                                   health)))
    cluster.processes.start(PROCESS, [
        str(build.KUEUE.binary(PROCESS)),
        f"--config={config}",
        "--feature-gates=VisibilityOnDemand=false",
        "--zap-log-level=2",
    ], env={"KUBECONFIG": str(cluster.kubeconfig), "PATH": "/usr/bin:/bin"})
    _wait_ready(cluster, health, timeout)


def _wait_ready(cluster: Cluster, port: int, timeout: float) -> None:
    """Until the manager's readiness probe (plain HTTP on loopback) answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_running(cluster):
            raise RuntimeError(f"{PROCESS} exited; see {cluster.processes.log_path(PROCESS)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{PROCESS} not ready within {timeout}s; see "
                       f"{cluster.processes.log_path(PROCESS)}")


def stop(cluster: Cluster) -> None:
    cluster.processes.stop(PROCESS)


REPLACE_ATTEMPTS = 5


def apply(api: client.ApiClient, obj: dict[str, Any]) -> None:
    """Create a Kueue object (ResourceFlavor, ClusterQueue, LocalQueue, WorkloadPriorityClass,
    Topology), or replace the one of that name. A replace carries the version it read, and
    Kueue's controllers write the object's status meanwhile (a ClusterQueue's usage, its
    pending workloads): a replace that loses to such a write (409) reads and replaces again,
    up to REPLACE_ATTEMPTS times."""
    custom = client.CustomObjectsApi(api)
    plural = PLURALS[obj["kind"]]
    namespace = obj["metadata"].get("namespace")
    try:
        if namespace:
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, obj)
        else:
            custom.create_cluster_custom_object(GROUP, VERSION, plural, obj)
        return
    except ApiException as err:
        if err.status != 409:
            raise
    name = obj["metadata"]["name"]
    for attempt in range(1, REPLACE_ATTEMPTS + 1):
        current: Any = (custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
                        if namespace else
                        custom.get_cluster_custom_object(GROUP, VERSION, plural, name))
        fresh = {**obj, "metadata": {**obj["metadata"],
                                     "resourceVersion": current["metadata"]["resourceVersion"]}}
        try:
            if namespace:
                custom.replace_namespaced_custom_object(GROUP, VERSION, namespace, plural, name,
                                                        fresh)
            else:
                custom.replace_cluster_custom_object(GROUP, VERSION, plural, name, fresh)
            return
        except ApiException as err:
            if err.status != 409 or attempt == REPLACE_ATTEMPTS:
                raise
