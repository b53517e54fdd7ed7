"""Where a local cluster lives: its state directory, addresses, ports and controller timings.

Everything that two clusters on one machine must not share is derived from one small
``ClusterConfig``: the state directory, the bridge and its private /16, and etcd's loopback
ports. Every other server (API server, scheduler, controller manager, CoreDNS) listens on the
bridge's host address, so a second cluster on another bridge reuses the same port numbers.
That is what lets the test of ``down`` start and stop a throwaway cluster next to the
session's cluster.

Timings are shorter than Kubernetes' defaults so that a node taken down turns NotReady within
seconds and its pods are evicted within a minute (EKS: 40-50 s and 300 s); the mechanism is the
real node lifecycle and taint-eviction controllers either way.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hlat_testbed.build import cache_root

K8S_CLUSTER_DOMAIN = "cluster.local"
SERVICE_CIDR = "10.96.0.0/16"
API_PORT = 6443
SCHEDULER_PORT = 10259
CONTROLLER_MANAGER_PORT = 10257
DNS_PORT = 53
DNS_READY_PORT = 8181


@dataclass(frozen=True)
class ClusterConfig:
    """The identity of one local cluster; ``default()`` is the one people and the suite use."""

    name: str = "hlat"
    state_dir: str = ""
    """Logs, pids, certificates, etcd data and pod directories; removed (except logs) by down."""
    bridge: str = "hlat0"
    """Linux bridge the pods' veths attach to; at most 15 characters."""
    subnet: str = "10.244.0.0/16"
    """Private range: .0.1 is the host (API server, CoreDNS), node i gets 10.x.(i+1).0/24."""
    etcd_port: int = 2379
    """etcd client port on 127.0.0.1 (peer port is this + 1)."""
    node_monitor_grace_s: int = 16
    """Controller manager --node-monitor-grace-period: silence before a node is NotReady."""
    eviction_toleration_s: int = 30
    """Default not-ready/unreachable toleration added to pods (EKS: 300)."""
    lease_renew_s: float = 2.0
    """How often a kubelet renews its node Lease."""

    @staticmethod
    def default() -> ClusterConfig:
        """The shared cluster; ``HLAT_CLUSTER_DIR`` overrides its state directory. A
        ``config.json`` already there (another bridge/subnet/etcd port: a second cluster
        beside the shared one) is honored."""
        state = os.environ.get("HLAT_CLUSTER_DIR", str(cache_root() / "cluster"))
        if (Path(state) / "config.json").exists():
            with contextlib.suppress(ValueError, TypeError):
                return ClusterConfig.load(Path(state))
        return ClusterConfig(state_dir=state)

    @property
    def state(self) -> Path:
        return Path(self.state_dir)

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet)

    @property
    def host_ip(self) -> str:
        """The bridge's address: where pods and host clients reach the API server and DNS."""
        return str(self.network.network_address + 1)

    @property
    def api_url(self) -> str:
        return f"https://{self.host_ip}:{API_PORT}"

    def node_cidr(self, index: int) -> ipaddress.IPv4Network:
        """Pod range of the index-th node (0-based): a /24 after the host's."""
        base = int(self.network.network_address) + (index + 1) * 256
        return ipaddress.IPv4Network(f"{ipaddress.IPv4Address(base)}/24")

    # paths
    @property
    def pki_dir(self) -> Path:
        return self.state / "pki"

    @property
    def logs_dir(self) -> Path:
        return self.state / "logs"

    @property
    def pids_dir(self) -> Path:
        return self.state / "pids"

    @property
    def pods_dir(self) -> Path:
        return self.state / "pods"

    @property
    def nodes_dir(self) -> Path:
        return self.state / "nodes"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    def kubeconfig(self, identity: str) -> Path:
        return self.pki_dir / f"{identity}.kubeconfig"

    def save(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "config.json").write_text(json.dumps(asdict(self), indent=2))

    @staticmethod
    def load(state_dir: Path) -> ClusterConfig:
        return ClusterConfig(**json.loads((state_dir / "config.json").read_text()))
