"""The real controllers act on what the process kubelet reports: GC and node lifecycle."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from hlat_testbed import faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.podfiles import container_pid
from hlat_testbed.procs import is_alive
from hlat_testbed.testing import python_pod, read_pod, wait_for, wait_pod_running

pytestmark = pytest.mark.cluster

UNREACHABLE = "node.kubernetes.io/unreachable"


def test_garbage_collector_deletes_pods_of_a_deleted_owner(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    owner: Any = core.create_namespaced_config_map(namespace, {  # type: ignore[arg-type]
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    for name in ("owned-0", "owned-1"):
        pod = python_pod(name, "import time; time.sleep(600)")
        pod["metadata"]["ownerReferences"] = [ref]
        core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    for name in ("owned-0", "owned-1"):
        wait_pod_running(core, namespace, name)
    core.delete_namespaced_config_map("owner", namespace)
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, 60,
             "the garbage collector to delete the owned pods")


def _node_state(core: client.CoreV1Api, name: str) -> tuple[str, set[str]]:
    node: Any = core.read_node(name)
    ready = next(c.status for c in node.status.conditions if c.type == "Ready")
    return ready, {t.key for t in node.spec.taints or []}


def test_node_taken_down_turns_not_ready_with_the_unreachable_taint_and_recovers(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    node = cluster.nodes()[1]
    pod = python_pod("on-lost-node", "import time; time.sleep(600)",
                     nodeSelector={"kubernetes.io/hostname": node})
    core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    wait_pod_running(core, namespace, "on-lost-node")
    faults.node_down(cluster.config, node)
    try:
        wait_for(lambda: (s := _node_state(core, node))[0] == "Unknown" and UNREACHABLE in s[1],
                 cluster.config.node_monitor_grace_s + 30, f"{node} NotReady and tainted")
        # the pod's process died with the node, but nobody can report it: still Running
        assert read_pod(core, namespace, "on-lost-node").status.phase == "Running"
    finally:
        faults.node_up(cluster.config, node)
    wait_for(lambda: _node_state(core, node) == ("True", set()), 60,
             f"{node} Ready without taints again")


SERVER = """
import socket, time
listener = socket.create_server(("0.0.0.0", 7000))
conn, _ = listener.accept()
print("accepted", flush=True)
time.sleep(600)
"""

CLIENT = """
import os, socket, time
sock = socket.create_connection((os.environ["SERVER_IP"], 7000), timeout=10)
print("connected", flush=True)
sock.settimeout(1)
while True:
    try:
        if sock.recv(1) == b"":
            print("eof", flush=True)
            break
    except TimeoutError:
        continue
    except OSError as err:
        print(f"error {err}", flush=True)
        break
"""


def test_a_lost_node_vanishes_from_the_network_without_closing_its_connections(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    """A node that loses power sends no FIN or RST: a peer's connection to one of its pods just
    goes quiet (so training peers find out by timeouts, as on EKS), rather than ending."""
    lost, other = cluster.nodes()[1], cluster.nodes()[2]
    core.create_namespaced_pod(namespace, python_pod(  # type: ignore[arg-type]
        "server", SERVER, nodeSelector={"kubernetes.io/hostname": lost}))
    server_ip = wait_pod_running(core, namespace, "server").status.pod_ip
    core.create_namespaced_pod(namespace, python_pod(  # type: ignore[arg-type]
        "client", CLIENT, nodeSelector={"kubernetes.io/hostname": other},
        container={"env": [{"name": "SERVER_IP", "value": server_ip}]}))
    wait_for(lambda: "connected" in cluster.pod_log(namespace, "client")
             if read_pod(core, namespace, "client").status.phase == "Running" else None,
             30, "the client to connect")
    server_pid = container_pid(cluster.config, namespace, "server")
    faults.node_down(cluster.config, lost)
    try:
        wait_for(lambda: not is_alive(server_pid), 20, "the lost node's pod process to die")
        time.sleep(5)  # a FIN or RST would have arrived long before this
        log = cluster.pod_log(namespace, "client")
        assert "eof" not in log and "error" not in log, log
    finally:
        faults.node_up(cluster.config, lost)
