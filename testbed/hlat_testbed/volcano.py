"""Volcano's gang scheduler on the local cluster: its CRDs and a real `vc-scheduler` process.

Built from its Go module like the control plane (hlat_testbed.build.VOLCANO); the CRDs it needs
(PodGroup, Queue, and Numatopology, which its ResourceTopology feature watches) are copied out
of the same module at build time. The scheduler runs beside kube-scheduler, as on a cluster
where Volcano is installed: it schedules only pods whose `schedulerName` is `volcano`, creates
the `default` Queue itself, and binds a PodGroup's pods only when `minMember` of them fit.
Started on demand (`hlat-cluster volcano`, or the tests' fixture), not by `hlat-cluster up`.
"""

from __future__ import annotations

import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed import build
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import install_component_crds
from hlat_testbed.prometheus import free_port

PROCESS = "vc-scheduler"
SCHEDULER_NAME = "volcano"
GROUP, VERSION = "scheduling.volcano.sh", "v1beta1"


def is_running(cluster: Cluster) -> bool:
    return cluster.processes.pid(PROCESS) is not None


def start(cluster: Cluster, timeout: float = 60) -> None:
    """Install the CRDs and start the scheduler (no-op if it runs); wait for its Queue."""
    api = cluster.admin_api()
    install_component_crds(api, build.VOLCANO)
    cluster.processes.start(PROCESS, [
        str(build.VOLCANO.binary(PROCESS)),
        f"--kubeconfig={cluster.kubeconfig}",
        f"--scheduler-name={SCHEDULER_NAME}",
        "--leader-elect=false",
        f"--listen-address=127.0.0.1:{free_port()}",
        "--logtostderr", "-v=3",
    ])
    custom = client.CustomObjectsApi(api)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_running(cluster):
            log = cluster.processes.log_path(PROCESS)
            raise RuntimeError(f"{PROCESS} exited; see {log}")
        try:
            custom.get_cluster_custom_object(GROUP, VERSION, "queues", "default")
            return
        except ApiException as err:
            if err.status != 404:
                raise
        time.sleep(0.5)
    raise TimeoutError(f"{PROCESS} did not create the default Queue within {timeout}s")


def stop(cluster: Cluster) -> None:
    cluster.processes.stop(PROCESS)


def pod_group(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """A PodGroup as stored, or None."""
    try:
        group: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, "podgroups", name)  # type: ignore[assignment]
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return group
