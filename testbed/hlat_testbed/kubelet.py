"""The process kubelet: one background process per node, registering and running that node.

No real kubelet can run here (no container runtime), and the operator must not be able to tell
the difference, so this one does a kubelet's API-facing job faithfully and nothing else:

- registers a Node as its provisioner would make it (eksnodes.py: capacity, allocatable after
  EKS's reservations, labels, taints, Neuron and EFA devices), renews its Lease
  in ``kube-node-lease`` and its Ready condition, with the node's own ``system:node:`` credentials
  (so the Node authorizer and NodeRestriction bound it as on EKS);
- watches the pods bound to it and gives each to a ``PodWorker`` (podworker.py);
- honours deletion (grace period, then the final delete with grace 0).

Faults arrive as signals, so the CLI and tests need no RPC: SIGUSR1 takes the node down (lease
and status stop, every pod process is SIGKILLed, the API is no longer watched: to the cluster it
is a lost node), SIGUSR2 brings it back, SIGTERM shuts the kubelet down and removes its pods'
processes and networks. What becomes of a lost node's pods is left to the real node lifecycle,
taint-eviction and pod GC controllers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from hlat_testbed import eksnodes, faults, netns
from hlat_testbed.build import K8S_VERSION
from hlat_testbed.config import ClusterConfig
from hlat_testbed.instancetypes import ZONE, InstanceType, instance_type
from hlat_testbed.kube import Obj, Pod, api_client
from hlat_testbed.podworker import PodWorker, Status

LEASE_NAMESPACE = "kube-node-lease"
STATUS_PERIOD_S = 10.0


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeAgent:
    """The kubelet of one node."""

    def __init__(self, cfg: ClusterConfig, name: str, index: int, itype: InstanceType,
                 provisioner: eksnodes.Provisioner = eksnodes.DEFAULT_PROVISIONER,
                 pool: str = "default", taint: bool | None = None) -> None:
        self.config, self.name, self.itype = cfg, name, itype
        self.provisioner, self.pool, self.taint = provisioner, pool, taint
        self.cidr = cfg.node_cidr(index)
        self.api = api_client(cfg.kubeconfig(f"node-{name}"))
        self.core = client.CoreV1Api(self.api)
        self.resources = eksnodes.node_resources(itype, provisioner)
        self.allocatable = self.resources.allocatable  # what a container without limits gets
        self.online = threading.Event()
        self.online.set()
        self.stopping = threading.Event()
        self.workers: dict[str, PodWorker] = {}
        self.unreported: dict[str, tuple[PodWorker, Status]] = {}
        self.ips: dict[str, str] = {}
        self.lock = threading.Lock()
        self.ready_since = _now()
        self.boot_id = str(uuid.uuid4())

    def log(self, message: str) -> None:
        print(f"{_now()} kubelet[{self.name}] {message}", flush=True)

    # --- node ----------------------------------------------------------------------------
    def node_status(self) -> dict[str, Any]:
        beat = _now()

        def cond(kind: str, ok: bool, reason: str) -> dict[str, str]:
            return {"type": kind, "status": "True" if ok else "False", "reason": reason,
                    "message": reason, "lastHeartbeatTime": beat,
                    "lastTransitionTime": self.ready_since}

        gone = dict.fromkeys(faults.without_resources(self.config, self.name))
        return {
            # a resource a fault took away (faults.without_resource) stays away: null deletes
            "capacity": {**self.resources.capacity, **gone},
            "allocatable": {**self.resources.allocatable, **gone},
            "conditions": [cond("MemoryPressure", False, "KubeletHasSufficientMemory"),
                           cond("DiskPressure", False, "KubeletHasNoDiskPressure"),
                           cond("PIDPressure", False, "KubeletHasSufficientPID"),
                           cond("Ready", True, "KubeletReady")],
            "addresses": [{"type": "InternalIP", "address": self.config.host_ip},
                          {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": self.boot_id.replace("-", ""), "systemUUID": self.boot_id,
                         "bootID": self.boot_id, "kernelVersion": "hlat-process-kubelet",
                         "osImage": "hlat local", "containerRuntimeVersion": "process://1",
                         "kubeletVersion": K8S_VERSION, "kubeProxyVersion": "",
                         "operatingSystem": "linux", "architecture": "amd64"},
        }

    def register(self) -> None:
        labels = eksnodes.node_labels(self.name, self.itype, self.provisioner, self.pool)
        spec: dict[str, Any] = {"podCIDR": str(self.cidr), "podCIDRs": [str(self.cidr)],
                                "providerID": f"aws:///{ZONE}/i-{uuid.uuid4().hex[:17]}"}
        taints = eksnodes.node_taints(self.itype, self.provisioner, self.taint)
        if taints:
            spec["taints"] = taints
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": labels}, "spec": spec}
        try:
            self.core.create_node(body)  # type: ignore[arg-type]
        except ApiException as err:
            if err.status != 409:
                raise
        self.patch_status()
        self.renew_lease()
        self.log(f"registered as {self.itype.name} ({self.provisioner}, pool {self.pool}), "
                 f"pods {self.cidr}")

    def patch_status(self) -> None:
        self.core.patch_node_status(self.name, {"status": self.node_status()},
                                    _content_type="application/strategic-merge-patch+json")

    def renew_lease(self) -> None:
        coord = client.CoordinationV1Api(self.api)
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": 40,
                "renewTime": _micro_now()}
        try:
            coord.patch_namespaced_lease(self.name, LEASE_NAMESPACE, {"spec": spec},
                                         _content_type="application/merge-patch+json")
        except ApiException as err:
            if err.status != 404:
                raise
            node: Obj = self.core.read_node(self.name)
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.name,
                     "uid": node.metadata.uid}
            coord.create_namespaced_lease(LEASE_NAMESPACE, {  # type: ignore[arg-type]
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "ownerReferences": [owner]}, "spec": spec})

    def _every(self, period: float, action: Any) -> None:
        while not self.stopping.wait(period):
            if not self.online.is_set():
                continue
            try:
                action()
            except Exception as err:
                self.log(f"{action.__name__}: {err!r}")

    # --- pods ----------------------------------------------------------------------------
    def allocate_ip(self, uid: str) -> str:
        with self.lock:
            used = set(self.ips.values())
            for host in self.cidr.hosts():
                if int(host) & 0xFF >= 2 and str(host) not in used:
                    self.ips[uid] = str(host)
                    return str(host)
        raise RuntimeError(f"node {self.name}: pod range {self.cidr} exhausted")

    def release_ip(self, uid: str) -> None:
        with self.lock:
            self.ips.pop(uid, None)

    def report_status(self, worker: PodWorker, status: Status) -> None:
        if not self.online.is_set():
            self.unreported[worker.uid] = (worker, status)
            return
        meta: Obj = worker.pod.metadata
        try:
            self.core.patch_namespaced_pod_status(
                meta.name, meta.namespace, {"metadata": {"uid": worker.uid}, "status": status},
                _content_type="application/strategic-merge-patch+json")
        except ApiException as err:
            if err.status not in (404, 409):
                self.log(f"status of {worker.key}: {err.status} {err.reason}")
        except Exception as err:  # API server unreachable: sent again by report_unreported
            with self.lock:
                self.unreported[worker.uid] = (worker, status)
            self.log(f"status of {worker.key} kept to send again: {err!r}")

    def report_unreported(self) -> None:
        """Statuses the API server could not take yet, sent again (a real kubelet's status
        manager resyncs the same way): a pod that finished during an outage of the API server
        must not stay Running there for good."""
        with self.lock:
            pending, self.unreported = self.unreported, {}
        for worker, _ in pending.values():
            worker.report()

    def pod_gone(self, worker: PodWorker) -> None:
        """Final step of deletion: the processes are gone, so remove the API object."""
        with self.lock:
            self.workers.pop(worker.uid, None)
        self.delete_pod(worker.pod)

    def delete_pod(self, pod: Pod) -> None:
        """Delete with grace 0 and a UID precondition: the kubelet's confirmation of deletion."""
        meta: Obj = pod.metadata
        body = client.V1DeleteOptions(grace_period_seconds=0,
                                      preconditions=client.V1Preconditions(uid=meta.uid))
        try:
            self.core.delete_namespaced_pod(meta.name, meta.namespace, body=body)
        except ApiException as err:
            if err.status not in (404, 409):
                self.log(f"delete {meta.namespace}/{meta.name}: {err.status} {err.reason}")

    def sync_pod(self, event: str, pod: Pod) -> None:
        uid = pod.metadata.uid
        with self.lock:
            worker = self.workers.get(uid)
        if event == "DELETED":
            if worker:
                worker.terminate(0)
        elif pod.metadata.deletion_timestamp is not None:
            grace = pod.metadata.deletion_grace_period_seconds or 0
            if worker:
                worker.terminate(float(grace))
            else:
                self.delete_pod(pod)
        elif worker is None and (pod.status.phase or "Pending") not in ("Succeeded", "Failed"):
            worker = PodWorker(self, pod)
            with self.lock:
                self.workers[uid] = worker
            self.log(f"starting pod {worker.key}")
            worker.start()

    def _list_and_watch(self) -> None:
        selector = f"spec.nodeName={self.name}"
        listed: Obj = self.core.list_pod_for_all_namespaces(field_selector=selector)
        present = {p.metadata.uid for p in listed.items}
        with self.lock:
            vanished = [w for uid, w in self.workers.items() if uid not in present]
        for worker in vanished:
            worker.terminate(0)
        for pod in listed.items:
            self.sync_pod("ADDED", pod)
        watcher = watch.Watch()  # type: ignore[no-untyped-call]
        stream = watcher.stream(  # type: ignore[no-untyped-call]
            self.core.list_pod_for_all_namespaces, field_selector=selector, timeout_seconds=30,
            resource_version=listed.metadata.resource_version,
            _request_timeout=(5, 45))  # a stream quiet past the server's 30 s is broken
        for event in stream:
            if not self.online.is_set() or self.stopping.is_set():
                return
            if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                self.sync_pod(event["type"], event["object"])

    def watch_pods(self) -> None:
        while not self.stopping.is_set():
            if not self.online.wait(0.5):
                continue
            try:
                self._list_and_watch()
            except Exception as err:
                self.log(f"pod watch: {err!r}")
                time.sleep(1)

    # --- faults and shutdown -------------------------------------------------------------
    def go_down(self) -> None:
        """As a node that loses power: it falls silent, and its pods vanish from the network
        before their processes die, so peers see no FIN or RST (they find out by timeouts)."""
        self.log("node down: lease and status stop, pod network cut, pod processes killed")
        self.online.clear()
        with self.lock:
            workers = list(self.workers.values())
        for worker in workers:
            netns.set_pod_link(self.config.bridge, worker.uid, up=False)
        for worker in workers:
            worker.kill_silently()

    def go_up(self) -> None:
        self.log("node up")
        self.ready_since = _now()
        with self.lock:
            workers = list(self.workers.values())
        for worker in workers:
            netns.set_pod_link(self.config.bridge, worker.uid, up=True)
        self.online.set()
        self.renew_lease()
        self.patch_status()
        self.report_unreported()

    def shutdown(self) -> None:
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.shutdown()

    def run(self) -> None:
        self.register()
        for target, period in ((self.renew_lease, self.config.lease_renew_s),
                               (self.patch_status, STATUS_PERIOD_S),
                               (self.report_unreported, self.config.lease_renew_s)):
            threading.Thread(target=self._every, args=(period, target), daemon=True).start()
        threading.Thread(target=self.watch_pods, name="watch", daemon=True).start()
        signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=self.go_down).start())
        signal.signal(signal.SIGUSR2, lambda *_: threading.Thread(target=self.go_up).start())
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        while not self.stopping.wait(0.5):
            pass
        self.log("shutting down")
        self.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="HLAT process kubelet (one node)")
    parser.add_argument("--state", required=True, type=Path)
    parser.add_argument("--node", required=True)
    parser.add_argument("--index", required=True, type=int)
    parser.add_argument("--instance-type", required=True)
    parser.add_argument("--provisioner", default=eksnodes.DEFAULT_PROVISIONER,
                        choices=eksnodes.PROVISIONERS)
    parser.add_argument("--pool", default="default")
    parser.add_argument("--taint", choices=["auto", "yes", "no"], default="auto",
                        help="the accelerator taint: the provisioner's usual choice, or forced")
    args = parser.parse_args(argv)
    cfg = ClusterConfig.load(args.state)
    ipaddress.IPv4Network(cfg.subnet)  # fail early on a corrupt config
    taint = None if args.taint == "auto" else args.taint == "yes"
    NodeAgent(cfg, args.node, args.index, instance_type(args.instance_type),
              eksnodes.provisioner(args.provisioner), args.pool, taint).run()
    sys.exit(0)


if __name__ == "__main__":
    main()
