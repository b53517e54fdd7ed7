"""The local cluster as one object: bring it up, take it down, and use it.

``up`` is idempotent: it builds missing binaries, then starts whatever is not already running,
in dependency order, and adds kubelets until the cluster has the requested nodes; a cluster
that is already healthy is reused as is. ``down`` stops kubelets first (they kill their pods'
processes and remove their networks), then the control plane in reverse order, then removes
whatever network state is left and every piece of state except the logs, so the next ``up``
starts from an empty etcd. ``Cluster`` is what tests, the CLI and the demo hold: kubeconfigs,
API clients for the admin, the operator and any service account, and pod logs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kubernetes import client

from hlat_testbed import bootstrap, build, cgroups, controlplane, netns, pki, podfiles
from hlat_testbed.config import ClusterConfig
from hlat_testbed.eksnodes import DEFAULT_PROVISIONER, Provisioner
from hlat_testbed.eksnodes import provisioner as check_provisioner
from hlat_testbed.instancetypes import DEFAULT_INSTANCE_TYPE, instance_type
from hlat_testbed.kube import Obj, api_client
from hlat_testbed.procs import ProcessTable, is_alive

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


_LIFECYCLE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


class Cluster:
    """A handle on one local cluster (running or not)."""

    def __init__(self, cfg: ClusterConfig | None = None) -> None:
        self.config = cfg or ClusterConfig.default()

    @property
    def processes(self) -> ProcessTable:
        return ProcessTable(self.config.pids_dir, self.config.logs_dir)

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (``system:masters``)."""
        return self.config.admin_kubeconfig

    # --- state ---------------------------------------------------------------------------
    def is_up(self) -> bool:
        return all(self.processes.pid(c) is not None for c in controlplane.COMPONENTS)

    def nodes(self) -> list[str]:
        """Nodes whose kubelet runs, in index order."""
        names = [n.removeprefix("kubelet-") for n in self.processes.names()
                 if n.startswith("kubelet-") and self.processes.pid(n) is not None]
        return sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]))

    def status(self) -> dict[str, str]:
        """Component -> pid or ``stopped``, for ``hlat-cluster status``."""
        names = [*controlplane.COMPONENTS,
                 *[n for n in self.processes.names() if n.startswith("kubelet-")]]
        return {n: (str(pid) if (pid := self.processes.pid(n)) else "stopped") for n in names}

    # --- up ------------------------------------------------------------------------------
    def up(self, nodes: int = 2, instance: str = DEFAULT_INSTANCE_TYPE,
           progress: Progress = _quiet, provisioner: str = DEFAULT_PROVISIONER) -> None:
        """`provisioner`: how the nodes are modelled (eksnodes.py): managed (an EKS managed
        node group, the default), karpenter, auto (EKS Auto Mode) or hyperpod."""
        instance_type(instance)  # reject an unknown type before starting anything
        check_provisioner(provisioner)
        build.ensure_built(progress)
        if not self.is_up():
            self._start_control_plane(progress)
        self._ensure_nodes(nodes, instance, progress, provisioner)
        self._wait_default_namespace_usable()
        progress(f"cluster up: {len(self.nodes())} node(s); export KUBECONFIG={self.kubeconfig}")

    def _wait_default_namespace_usable(self, timeout: float = 60) -> None:
        """Pods are admitted only once the default SA and root CA exist (controllers add them)."""
        core = client.CoreV1Api(self.admin_api())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if namespace_usable(core, "default"):
                return
            time.sleep(0.3)
        raise controlplane.StartupError("namespace default never got its service account")

    def wait_controllers_serve_new_namespaces(self, timeout: float = 180) -> float:
        """Create a throwaway namespace and wait until the controller manager has given it its
        default service account and root CA; return the seconds that took. After the API
        server has been away, the controllers' informers come back only on client-go's
        reflector back-off (0.8 s doubling to 30 s, each with up to as much jitter again:
        client-go tools/cache/reflector.go, NewExponentialBackoffManager), so measured here
        a new namespace waited up to 79 s for its service account: a test that restarts the
        API server hands the cluster back only once this passes."""
        core = client.CoreV1Api(self.admin_api())
        name = f"hlat-probe-{os.urandom(3).hex()}"
        core.create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]
        began = time.monotonic()
        try:
            while not namespace_usable(core, name):
                if time.monotonic() - began > timeout:
                    raise controlplane.StartupError(
                        f"the controller manager gave namespace {name} no default service "
                        f"account and root CA in {timeout:.0f}s; see its log "
                        f"{self.config.logs_dir / 'kube-controller-manager.log'}")
                time.sleep(0.3)
            return time.monotonic() - began
        finally:
            core.delete_namespace(name)

    def _start_control_plane(self, progress: Progress) -> None:
        cfg = self.config
        if not any(self.processes.pid(c) for c in controlplane.COMPONENTS):
            # a fresh cluster: whatever a crashed one left (kubelets with old credentials,
            # pod processes, network namespaces) must not leak into it
            self._stop_nodes(progress)
            netns.cleanup(cfg.bridge)
            self._wipe_state()
            self._rotate_logs()
        cfg.save()
        pki.ensure_pki(cfg)
        netns.ensure_bridge(cfg.bridge, f"{cfg.host_ip}/{cfg.network.prefixlen}")
        for name, start in controlplane.STARTERS.items():
            if name == "coredns":
                bootstrap.apply(self.admin_api(), bootstrap.COREDNS_RBAC)
                bootstrap.apply(self.admin_api(), bootstrap.OPERATOR_RBAC)
            progress(f"starting {name}")
            start(cfg)

    def _ensure_nodes(self, count: int, instance: str, progress: Progress,
                      provisioner: str = DEFAULT_PROVISIONER) -> None:
        running = set(self.nodes())
        for index in range(count):
            name = f"node-{index}"
            if name in running:
                continue
            progress(f"starting kubelet for {name} ({instance}, {provisioner})")
            self.start_kubelet(name, index, instance, provisioner)
        self.wait_nodes_ready([f"node-{i}" for i in range(count)])

    def start_kubelet(self, name: str, index: int, instance: str,
                      provisioner: str = DEFAULT_PROVISIONER, pool: str = "default",
                      taint: bool | None = None) -> None:
        pki.client_kubeconfig(self.config, pki.node_identity(name))
        self.processes.start(f"kubelet-{name}", [
            sys.executable, "-m", "hlat_testbed.kubelet", "--state", str(self.config.state),
            "--node", name, "--index", str(index), "--instance-type", instance,
            "--provisioner", provisioner, "--pool", pool,
            "--taint", "auto" if taint is None else ("yes" if taint else "no"),
        ])

    def add_node_pool(self, pool: str, count: int, instance: str, provisioner: Provisioner,
                      first_index: int, taint: bool | None = None) -> list[str]:
        """`count` more nodes named `<pool>-<i>`, modelled for `provisioner` (a Karpenter
        NodePool, a managed node group, a HyperPod instance group), once Ready. Their pod ranges
        are those of node indices `first_index`.. (keep them clear of the `node-<i>` nodes)."""
        instance_type(instance)
        names = [f"{pool}-{i}" for i in range(count)]
        for i, name in enumerate(names):
            self.start_kubelet(name, first_index + i, instance, provisioner, pool, taint)
        self.wait_nodes_ready(names)
        return names

    def remove_nodes(self, names: list[str]) -> None:
        """Stop the nodes' kubelets (their pods' processes die) and delete the Node objects."""
        core = client.CoreV1Api(self.admin_api())
        for name in names:
            self.processes.stop(f"kubelet-{name}", timeout=30)
            with contextlib.suppress(client.ApiException):
                core.delete_node(name)

    def wait_nodes_ready(self, names: list[str], timeout: float = 60) -> None:
        core = client.CoreV1Api(self.admin_api())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes: Obj = core.list_node()
            # Ready, and the node lifecycle controller has lifted its not-ready/unreachable
            # taints (a monitor period later): until then nothing schedules there and
            # controllers may still treat the node as lost
            ready = {n.metadata.name for n in nodes.items
                     if any(c.type == "Ready" and c.status == "True"
                            for c in n.status.conditions or [])
                     and not any(t.key in _LIFECYCLE_TAINTS for t in n.spec.taints or [])}
            if set(names) <= ready:
                return
            time.sleep(0.3)
        raise controlplane.StartupError(f"nodes not Ready and untainted after {timeout}s: {names}; "
                                        f"see {self.config.logs_dir}/kubelet-*.log")

    # --- down ----------------------------------------------------------------------------
    def down(self, progress: Progress = _quiet) -> None:
        self._stop_nodes(progress)
        for name in self.processes.names():  # add-ons started on demand (vc-scheduler)
            if not name.startswith("kubelet-") and name not in controlplane.COMPONENTS:
                progress(f"stopping {name}")
                self.processes.stop(name)
        progress("stopping control plane")
        controlplane.stop(self.config)
        netns.cleanup(self.config.bridge)
        self._wipe_state()
        progress("cluster down")

    def _stop_nodes(self, progress: Progress) -> None:
        """Stop every kubelet (each kills its pods), then any pod process left without one."""
        table = self.processes
        for name in table.names():
            if name.startswith("kubelet-"):
                progress(f"stopping {name}")
                table.stop(name, timeout=30)
        self._kill_pod_leftovers()

    def _kill_pod_leftovers(self) -> None:
        """Pod processes whose kubelet died without cleaning up: the containers' cgroups, and
        the pid files (the main processes' groups) where cgroups are not used."""
        cgroups.clear_leftovers(self.config.bridge)
        if not self.config.pods_dir.exists():
            return
        for pid_file in self.config.pods_dir.glob("*/*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pid_file.read_text())
                if is_alive(pid) and os.getpgid(pid) == pid:  # still the group we started
                    os.killpg(pid, signal.SIGKILL)

    def _rotate_logs(self) -> None:
        """A fresh cluster starts with empty logs; the previous run's stay in ``logs.previous``."""
        logs = self.config.logs_dir
        if logs.exists():
            previous = logs.with_name("logs.previous")
            shutil.rmtree(previous, ignore_errors=True)
            logs.rename(previous)

    def _wipe_state(self) -> None:
        """Remove everything but the logs (kept for a post-mortem until the next ``up``) and
        ``config.json`` (a cluster beside the shared one keeps its bridge, subnet and ports)."""
        state = self.config.state
        if not state.exists():
            return
        for child in state.iterdir():
            if child.name.startswith("logs") or child.name == "config.json":
                continue
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink()

    # --- clients -------------------------------------------------------------------------
    def admin_api(self) -> client.ApiClient:
        return api_client(self.kubeconfig)

    def service_account_kubeconfig(self, namespace: str, name: str, seconds: int = 86400) -> Path:
        """A kubeconfig with a TokenRequest token for ``namespace/name`` (created by admin)."""
        token = bootstrap.service_account_token(self.admin_api(), namespace, name, seconds)
        path = self.config.state / "tokens" / f"{namespace}.{name}.kubeconfig"
        return pki.write_kubeconfig(path, self.config.api_url, self.config.pki_dir / "ca.crt",
                                    f"{namespace}:{name}", token=token, namespace=namespace)

    def operator_kubeconfig(self) -> Path:
        """Credentials of the operator's service account, under the rig's operator RBAC."""
        return self.service_account_kubeconfig(bootstrap.OPERATOR_NAMESPACE,
                                               bootstrap.OPERATOR_SERVICE_ACCOUNT)

    def api_for(self, kubeconfig: Path) -> client.ApiClient:
        return api_client(kubeconfig)

    # --- pods and shared storage ---------------------------------------------------------
    def pod_log(self, namespace: str, pod: str, container: str | None = None) -> str:
        """stdout+stderr of a pod's container (all its containers by default)."""
        return podfiles.pod_log(self.config, namespace, pod, container)

    def create_shared_volume(self, namespace: str, claim: str, host_dir: Path,
                             size: str = "100Gi") -> None:
        """A PV/PVC pair backed by ``host_dir`` (ReadWriteMany), like an FSx for Lustre claim.

        The PV is pre-bound to the claim, so the real PV controller binds them without a
        provisioner; the process kubelet mounts the directory into every pod that uses the claim.
        Returns once the claim is Bound: until then the scheduler rejects every pod that uses it
        ("pod has unbound immediate PersistentVolumeClaims"), whatever else is wrong with the pod.
        """
        host_dir.mkdir(parents=True, exist_ok=True)
        core = client.CoreV1Api(self.admin_api())
        pv_name = f"{namespace}-{claim}"
        core.create_persistent_volume({  # type: ignore[arg-type]
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": pv_name, "labels": {"hlat.dev/shared-volume": claim}},
            "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "hostPath": {"path": str(host_dir), "type": "DirectoryOrCreate"},
                     "claimRef": {"namespace": namespace, "name": claim}},
        })
        core.create_namespaced_persistent_volume_claim(namespace, {  # type: ignore[arg-type]
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "volumeName": pv_name, "resources": {"requests": {"storage": size}}},
        })
        self.wait_claim_bound(namespace, claim)

    def wait_claim_bound(self, namespace: str, claim: str, timeout: float = 60) -> None:
        """The PV controller binds claims from its own work queue: under load, seconds later."""
        core = client.CoreV1Api(self.admin_api())
        deadline = time.monotonic() + timeout
        phase = None
        while time.monotonic() < deadline:
            pvc: Obj = core.read_namespaced_persistent_volume_claim(claim, namespace)
            phase = pvc.status.phase if pvc.status else None
            if phase == "Bound":
                return
            time.sleep(0.2)
        raise controlplane.StartupError(
            f"PersistentVolumeClaim {namespace}/{claim} is {phase}, not Bound, after {timeout}s; "
            f"see {self.config.logs_dir}/kube-controller-manager.log")


def namespace_usable(core: client.CoreV1Api, name: str) -> bool:
    """Whether the controllers have given namespace `name` what its pods need to be admitted:
    the default service account and the root CA ConfigMap."""
    sas: Obj = core.list_namespaced_service_account(name, field_selector="metadata.name=default")
    cms: Obj = core.list_namespaced_config_map(name,
                                               field_selector="metadata.name=kube-root-ca.crt")
    return bool(sas.items and cms.items)


def kubectl_binary() -> Path:
    return build.binary("kubectl")
