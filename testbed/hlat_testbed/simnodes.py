"""Simulated nodes for scale runs: many Nodes in one process that run nothing.

The process kubelet (kubelet.py) runs every pod as real processes, which bounds a rig on this
machine to a few nodes. To load the operator with hundreds of jobs, `SimNodes` registers `count`
Nodes (label `hlat.dev/simulated=true`, taint `hlat.dev/simulated=true:NoSchedule`, so only pods
that ask for them land there), keeps their Leases in `kube-node-lease` and their Ready condition
renewed, and does for the pods the scheduler binds to them only what the operator can see of a
kubelet: the pod is reported Running (a pod IP, a running container) as soon as it is bound, a
pod being deleted is removed at once, and `fail` reports a running pod's container terminated
with an exit code (a fault). Everything goes through the real API server, scheduler and
controllers; there are no processes, no heartbeats from trainers, no network.

It uses the admin credentials (one client for every node), not a node's own: the Node
authorizer is not what a scale run measures.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from hlat_testbed.instancetypes import REGION, ZONE

LABEL = "hlat.dev/simulated"
TAINT = {"key": LABEL, "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
LEASE_NAMESPACE = "kube-node-lease"
RENEW_SECONDS = 10.0
RENEW_THREADS = 8
POD_RANGE = ipaddress.ip_network("100.64.0.0/10")
"""Pod IPs handed out (never routed: nothing listens on them)."""


def _now(micro: bool = False) -> str:
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ"
    return dt.datetime.now(dt.UTC).strftime(fmt)


class SimNodes:
    """`count` simulated nodes named `<prefix>-<i>`, each taking up to `pods` pods."""

    def __init__(self, api: client.ApiClient, count: int, prefix: str = "sim",
                 pods: int = 64, cpu: int = 512, memory_gi: int = 4096,
                 on_running: Callable[[Any], None] | None = None) -> None:
        """`on_running(pod)`: called on the watch thread for every event of a pod reported
        Running (what its processes would do, e.g. a heartbeat)."""
        self.on_running = on_running
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.names = [f"{prefix}-{i}" for i in range(count)]
        self.capacity = {"cpu": str(cpu), "memory": f"{memory_gi}Gi", "pods": str(pods),
                         "ephemeral-storage": "10000Gi"}
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.running: dict[tuple[str, str], str] = {}
        """(namespace, pod) -> uid of the pods reported Running and not failed since."""
        self.requests = 0
        """Requests this simulator made (to tell its load from the operator's)."""
        self._ips = POD_RANGE.hosts()
        self._threads: list[threading.Thread] = []

    # --- nodes ---------------------------------------------------------------------------
    def _status(self) -> dict[str, Any]:
        beat = _now()
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "simulated", "lastHeartbeatTime": beat,
                 "lastTransitionTime": beat}
        return {"capacity": self.capacity, "allocatable": self.capacity,
                "conditions": [ready],
                "nodeInfo": {"kubeletVersion": "v1.35.4", "kernelVersion": "simulated",
                             "osImage": "simulated", "containerRuntimeVersion": "none://0",
                             "operatingSystem": "linux", "architecture": "amd64",
                             "machineID": "", "systemUUID": "", "bootID": "",
                             "kubeProxyVersion": ""}}

    def register(self) -> None:
        for name in self.names:
            body = {"metadata": {"name": name, "labels": {
                        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64", LABEL: "true",
                        "topology.kubernetes.io/region": REGION,
                        "topology.kubernetes.io/zone": ZONE}},
                    "spec": {"taints": [TAINT]}}
            try:
                self.requests += 1
                self.core.create_node(body)
            except ApiException as err:
                if err.status != 409:
                    raise
            self._renew(name, status=True)

    def _renew(self, name: str, status: bool = False) -> None:
        """The node's Lease (what the node lifecycle controller reads as its heartbeat, as a
        real kubelet renews it); its status only when asked (a real kubelet reports it every
        few minutes when nothing changes)."""
        if status:
            self.requests += 1
            self.core.patch_node_status(name, {"status": self._status()})
        self.requests += 1
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40,
                "renewTime": _now(micro=True)}
        try:
            self.coordination.patch_namespaced_lease(name, LEASE_NAMESPACE, {"spec": spec})
        except ApiException as err:
            if err.status != 404:
                raise
            self.coordination.create_namespaced_lease(LEASE_NAMESPACE, {
                "metadata": {"name": name}, "spec": spec})

    def _renew_loop(self) -> None:
        def renew(name: str) -> None:
            try:
                self._renew(name)
            except Exception as err:
                print(f"simnodes: renewing {name}: {err!r}", flush=True)

        # in parallel: one after the other, hundreds of renewals against a busy API server
        # can outlast the Lease, and the node lifecycle controller then takes the nodes for lost
        with ThreadPoolExecutor(RENEW_THREADS, thread_name_prefix="simnodes-renew") as pool:
            while not self.stopping.wait(RENEW_SECONDS):
                began = time.monotonic()
                list(pool.map(renew, self.names))
                took = time.monotonic() - began
                if took > RENEW_SECONDS:
                    print(f"simnodes: renewing {len(self.names)} Leases took {took:.0f} s",
                          flush=True)

    def remove(self) -> None:
        for name in self.names:
            for call in (self.core.delete_node,
                         lambda n: self.coordination.delete_namespaced_lease(n, LEASE_NAMESPACE)):
                try:
                    call(name)
                except ApiException as err:
                    if err.status != 404:
                        raise

    # --- pods ----------------------------------------------------------------------------
    def _ours(self, pod: Any) -> bool:
        return (pod.spec.node_name or "") in self._name_set

    def _pod_loop(self) -> None:
        self._name_set = set(self.names)
        while not self.stopping.is_set():
            try:
                self.requests += 1
                stream = watch.Watch().stream(self.core.list_pod_for_all_namespaces,
                                              timeout_seconds=60)
                for event in stream:
                    if self.stopping.is_set():
                        return
                    pod = event["object"]
                    if event["type"] != "DELETED" and self._ours(pod):
                        self._handle(pod)
            except Exception as err:
                print(f"simnodes: pod watch: {err!r}", flush=True)
                time.sleep(1)

    def _handle(self, pod: Any) -> None:
        meta = pod.metadata
        key = (meta.namespace, meta.name)
        if meta.deletion_timestamp is not None:
            with self.lock:
                self.running.pop(key, None)
            try:
                self.requests += 1
                self.core.delete_namespaced_pod(
                    meta.name, meta.namespace, grace_period_seconds=0,
                    body=client.V1DeleteOptions(grace_period_seconds=0,
                                                preconditions=client.V1Preconditions(uid=meta.uid)))
            except ApiException as err:
                if err.status not in (404, 409):
                    raise
            return
        if pod.status.phase == "Pending" and not pod.status.container_statuses:
            now = _now()
            status = {"phase": "Running", "podIP": str(next(self._ips)), "hostIP": "10.0.0.1",
                      "startTime": now,
                      "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                                     for t in ("PodScheduled", "Initialized", "ContainersReady",
                                               "Ready")],
                      "containerStatuses": [{
                          "name": c.name, "image": c.image, "imageID": "", "ready": True,
                          "restartCount": 0, "started": True,
                          "state": {"running": {"startedAt": now}}}
                          for c in pod.spec.containers]}
            self._patch_status(meta, status)
            with self.lock:
                self.running[key] = meta.uid
        if self.on_running is not None and pod.status.phase in ("Pending", "Running") \
                and key in self.running:
            try:
                self.on_running(pod)
            except Exception as err:
                print(f"simnodes: on_running {key}: {err!r}", flush=True)

    def _patch_status(self, meta: Any, status: dict[str, Any]) -> None:
        try:
            self.requests += 1
            self.core.patch_namespaced_pod_status(
                meta.name, meta.namespace, {"metadata": {"uid": meta.uid}, "status": status})
        except ApiException as err:
            if err.status not in (404, 409):
                raise

    def fail(self, rng: random.Random, exit_code: int = 137,
             group: Callable[[tuple[str, str]], str] | None = None
             ) -> tuple[str, str, float] | None:
        """Report one running pod, chosen by `rng` (among all, or in a group drawn first:
        `group` maps (namespace, pod) to its group), terminated with `exit_code`: (namespace,
        pod, when); None when no pod runs."""
        with self.lock:
            if not self.running:
                return None
            if group is None:
                key = rng.choice(sorted(self.running))
            else:  # a group first, then one of its pods: big groups are not hit more often
                groups: dict[str, list[tuple[str, str]]] = {}
                for k in self.running:
                    groups.setdefault(group(k), []).append(k)
                key = rng.choice(sorted(groups[rng.choice(sorted(groups))]))
            uid = self.running.pop(key)
        pod = self.core.read_namespaced_pod(key[1], key[0])
        if pod.metadata.uid != uid:
            return None
        now = _now()
        status = {"phase": "Failed", "conditions": [
                      {"type": "Ready", "status": "False", "lastTransitionTime": now}],
                  "containerStatuses": [{
                      "name": c.name, "image": c.image, "imageID": "", "ready": False,
                      "restartCount": 0, "started": False, "state": {"terminated": {
                          "exitCode": exit_code, "reason": "Error", "startedAt": now,
                          "finishedAt": now}}} for c in pod.spec.containers]}
        when = time.time()
        self._patch_status(pod.metadata, status)
        return key[0], key[1], when

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> SimNodes:
        self.register()
        for target in (self._renew_loop, self._pod_loop):
            thread = threading.Thread(target=target, daemon=True, name=f"simnodes-{target.__name__}")
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self.stopping.set()
