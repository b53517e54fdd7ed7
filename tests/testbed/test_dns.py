"""Pods behind a headless Service find each other by DNS name, over TCP, as on EKS."""

from __future__ import annotations

import pytest
from kubernetes import client

from hlat_testbed.cluster import Cluster
from hlat_testbed.testing import python_pod, wait_pod_phase

pytestmark = pytest.mark.cluster

PEER = """
import os, socket, threading, time
me, peer = os.environ["ME"], os.environ["PEER"]
server = socket.create_server(("0.0.0.0", 29500))
def serve():
    conn, _ = server.accept()
    with conn:
        conn.sendall(f"hello from {me} at {socket.gethostbyname(socket.gethostname())}".encode())
threading.Thread(target=serve, daemon=True).start()
deadline = time.time() + 60
while True:
    try:
        with socket.create_connection((peer, 29500), timeout=2) as conn:
            print("received:", conn.recv(200).decode(), flush=True)
            break
    except OSError as err:
        if time.time() > deadline:
            raise
        time.sleep(0.2)
time.sleep(2)  # let the peer connect to us too
"""


def test_two_pods_reach_each_other_by_dns_name_over_tcp(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_service(namespace, {  # type: ignore[arg-type]
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "job"},
        "spec": {"clusterIP": "None", "selector": {"app": "job"},
                 "publishNotReadyAddresses": True,
                 "ports": [{"name": "rdzv", "port": 29500}]}})
    names = ("worker-0", "worker-1")
    for me, peer in (names, names[::-1]):
        pod = python_pod(me, PEER, hostname=me, subdomain="job", container={"env": [
            {"name": "ME", "value": me},
            {"name": "PEER", "value": f"{peer}.job.{namespace}.svc.cluster.local"}]})
        pod["metadata"]["labels"] = {"app": "job"}
        core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    for me, peer in (names, names[::-1]):
        done = wait_pod_phase(core, namespace, me, {"Succeeded", "Failed"}, timeout=90)
        log = cluster.pod_log(namespace, me)
        assert done.status.phase == "Succeeded", log
        assert f"received: hello from {peer}" in log
