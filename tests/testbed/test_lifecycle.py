"""``up``/``down`` of a second, throwaway cluster, and the CLI against the session's cluster.

The throwaway cluster runs beside the session's one (its own state dir, bridge, subnet and etcd
ports, chosen free at run time because other clusters may share the machine), so proving that
``down`` leaves nothing behind does not disturb other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client

from hlat_testbed import netns
from hlat_testbed.cluster import Cluster
from hlat_testbed.procs import cmdline, is_alive
from hlat_testbed.testing import (
    python_pod,
    spare_cluster_config,
    wait_pod_phase,
    wait_pod_running,
)

pytestmark = pytest.mark.cluster


def _processes_mentioning(text: str) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and text in " ".join(cmdline(int(p.name)))]


def test_down_leaves_no_process_netns_or_veth(cluster: Cluster, tmp_path: Path) -> None:
    cfg = spare_cluster_config(str(tmp_path / "state"))
    spare = Cluster(cfg)
    spare.up(nodes=1)
    try:
        core = client.CoreV1Api(spare.admin_api())
        core.create_namespaced_pod("default", python_pod("sleeper", "import time; time.sleep(600)"))  # type: ignore[arg-type]
        wait_pod_running(core, "default", "sleeper")
        pod_pid = int(next(cfg.pods_dir.glob("default_sleeper_*/main.pid")).read_text())
        assert netns.cluster_netns(cfg.bridge) and len(netns.cluster_links(cfg.bridge)) == 2
    finally:
        spare.down()
    assert not is_alive(pod_pid)
    assert _processes_mentioning(cfg.state_dir) == []
    assert netns.cluster_netns(cfg.bridge) == []
    assert netns.cluster_links(cfg.bridge) == []
    assert cluster.is_up()  # the session's cluster was not touched


def _cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HLAT_CLUSTER_DIR": str(cluster.config.state)}
    return subprocess.run([sys.executable, "-m", "hlat_testbed.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_status_kubeconfig_and_kubectl(cluster: Cluster) -> None:
    status = _cli(cluster, "status")
    assert status.returncode == 0, status.stderr
    assert "kube-apiserver" in status.stdout and "kubelet-node-0" in status.stdout
    assert _cli(cluster, "kubeconfig").stdout.strip() == str(cluster.kubeconfig)
    nodes = _cli(cluster, "kubectl", "get", "nodes", "-L", "node.kubernetes.io/instance-type")
    assert nodes.returncode == 0, nodes.stderr
    assert "node-0" in nodes.stdout and "trn1.32xlarge" in nodes.stdout
    version = _cli(cluster, "kubectl", "version", "-o", "json")
    assert '"gitVersion": "v1.35.4"' in version.stdout


def test_up_is_idempotent(cluster: Cluster) -> None:
    before = cluster.status()
    up = _cli(cluster, "up", "--nodes", str(len(cluster.nodes())))
    assert up.returncode == 0, up.stderr
    assert cluster.status() == before


def test_cli_shared_volume_and_pod_logs(cluster: Cluster, core: client.CoreV1Api,
                                        namespace: str, tmp_path: Path) -> None:
    shared = tmp_path / "fsx"
    made = _cli(cluster, "volume", "fsx", "--path", str(shared), "-n", namespace)
    assert made.returncode == 0, made.stderr
    pod = python_pod("writer", "open('/run/hlat-test/fsx-cli/ckpt', 'w').write('step 7')\n"
                               "print('wrote checkpoint')",
                     volumes=[{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx"}}],
                     container={"volumeMounts": [{"name": "fsx",
                                                  "mountPath": "/run/hlat-test/fsx-cli"}]})
    core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    done = wait_pod_phase(core, namespace, "writer", {"Succeeded", "Failed"})
    assert done.status.phase == "Succeeded", cluster.pod_log(namespace, "writer")
    assert (shared / "ckpt").read_text() == "step 7"
    logs = _cli(cluster, "logs", "writer", "-n", namespace)
    assert logs.stdout == "wrote checkpoint\n"
