"""`hlat_operator.k8s` and `nodewatch` against the real local API server: the node watch follows
nodes as they join, go not Ready and leave, and is never trusted once it is broken; a pass's
writes reuse the client's connections (a response left unread used to cost a TLS handshake per
request)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

import pytest
from kubernetes import client

from hlat_api.status import PretrainJobStatus
from hlat_operator import nodewatch
from hlat_operator.builders import JobRef
from hlat_operator.k8s import Kube
from hlat_operator.nodewatch import NodeWatch
from hlat_operator.reconcile import CreateObject, Decision, DeletePod, EmitEvent, PatchPod
from hlat_testbed.cluster import Cluster
from hlat_testbed.testing import wait_for

pytestmark = pytest.mark.cluster


def _names(items: list[Mapping[str, Any]] | None, ready: bool | None = None) -> set[str]:
    out = set()
    for n in items or []:
        conditions = (n.get("status") or {}).get("conditions") or []
        is_ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                       for c in conditions)
        if ready is None or ready == is_ready:
            out.add(str(n["metadata"]["name"]))
    return out


def _set_ready(core: client.CoreV1Api, name: str, ready: bool) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_node_status(name, {"status": {"conditions": [{
        "type": "Ready", "status": "True" if ready else "False", "reason": "Test",
        "message": "set by the test", "lastHeartbeatTime": now, "lastTransitionTime": now}]}})


def test_the_node_watch_follows_nodes_joining_failing_and_leaving(cluster: Cluster) -> None:
    core = client.CoreV1Api(cluster.admin_api())
    name = f"nodewatch-{int(time.time()) % 100000}"
    watch = NodeWatch(client.CoreV1Api(cluster.admin_api())).start()
    try:
        wait_for(watch.snapshot, 30, "the node watch's first list")
        core.create_node({"metadata": {"name": name, "labels": {"hlat.dev/test": "nodewatch"}},
                          "spec": {"taints": [{"key": "hlat.dev/test", "effect": "NoSchedule"}]}})
        _set_ready(core, name, True)
        wait_for(lambda: name in _names(watch.snapshot(), ready=True), 10, "the node Ready")
        _set_ready(core, name, False)
        wait_for(lambda: name in _names(watch.snapshot(), ready=False), 10, "the node NotReady")
        core.delete_node(name)
        wait_for(lambda: name not in _names(watch.snapshot()), 10, "the node gone")
        assert watch.lists == 1  # all of it from one list and the watch
    finally:
        watch.stop()
        with contextlib.suppress(client.exceptions.ApiException):
            core.delete_node(name)


def test_a_broken_node_watch_is_not_trusted_and_passes_list_instead(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch's API client loses its server (its address now refuses connections): when its
    watch ends (asked of the server after 1 s here) it cannot resume, the view turns unsynced
    and `Kube.nodes` lists through its own client, which still reaches the server."""
    monkeypatch.setattr(nodewatch, "WATCH_SECONDS", 1)
    api = cluster.admin_api()
    kube = Kube(cluster.admin_api())
    kube.node_watch = NodeWatch(client.CoreV1Api(api)).start()
    try:
        wait_for(kube.node_watch.snapshot, 30, "the node watch's first list")
        listed = kube.nodes()
        assert listed is not None
        api.configuration.host = "https://127.0.0.1:1"  # nothing listens there
        wait_for(lambda: kube.node_watch is not None and kube.node_watch.snapshot() is None,
                 30, "the broken watch marked unsynced")
        assert _names(kube.nodes()) == _names(listed)  # listed afresh, through Kube's client
    finally:
        kube.node_watch.stop()


def test_a_pass_s_writes_reuse_the_client_s_connections(cluster: Cluster, namespace: str) -> None:
    api = cluster.admin_api()
    kube = Kube(api)
    ref = JobRef("conn", namespace, "")
    actions: list[Any] = []
    for i in range(10):
        actions += [
            CreateObject({"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": f"conn-{i}"}, "data": {"i": str(i)}}),
            CreateObject({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"conn-{i}"},
                          "spec": {"nodeName": "nowhere", "containers": [
                              {"name": "c", "image": "none"}]}}),
            PatchPod(f"conn-{i}", {"hlat.dev/test": "yes"}, {}),
            EmitEvent("Normal", "Test", f"write {i}"),
            DeletePod(f"conn-{i}", grace_seconds=0),
        ]
    kube.execute(ref, Decision(actions=actions, requeue_after=None, status=PretrainJobStatus()))
    pool = api.rest_client.pool_manager.connection_from_url(api.configuration.host)
    assert pool.num_connections <= 2, (
        f"{len(actions)} writes opened {pool.num_connections} connections")
    assert json.loads(client.CoreV1Api(api).read_namespaced_config_map(
        "conn-9", namespace, _preload_content=False).data)["data"] == {"i": "9"}
