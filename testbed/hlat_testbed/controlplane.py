"""Start and stop the control plane: etcd, kube-apiserver, controller manager, scheduler, CoreDNS.

Each is the upstream binary from the build cache, run as a detached background process with its
log under ``logs/``. Order matters both ways: etcd before the API server, the API server before
anything that talks to it; on the way down the API server stops before etcd (it hangs on
shutdown otherwise). Every start waits on the component's own health endpoint, with a bound,
and names the log to read when it fails.

Flags worth knowing:
- the API server listens on the bridge's host address only, which is also its advertise address,
  the address in its certificate, and what pods get as KUBERNETES_SERVICE_HOST (no kube-proxy
  exists, so the ``kubernetes`` ClusterIP would not route);
- ``Node,RBAC`` authorization and NodeRestriction admission, as on EKS;
- shorter node-monitor and eviction timings from ``ClusterConfig`` (see config.py);
- controllers run with per-controller service-account credentials, like kubeadm clusters.
"""

from __future__ import annotations

import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from hlat_testbed import pki
from hlat_testbed.build import binary
from hlat_testbed.config import (
    API_PORT,
    CONTROLLER_MANAGER_PORT,
    DNS_PORT,
    DNS_READY_PORT,
    K8S_CLUSTER_DOMAIN,
    SCHEDULER_PORT,
    SERVICE_CIDR,
    ClusterConfig,
)
from hlat_testbed.procs import ProcessTable, is_alive

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "coredns")


class StartupError(RuntimeError):
    """A component did not become healthy in time."""


def processes(config: ClusterConfig) -> ProcessTable:
    return ProcessTable(config.pids_dir, config.logs_dir)


def _wait_healthy(name: str, pid: int, url: str, config: ClusterConfig, timeout: float,
                  context: ssl.SSLContext | None = None) -> None:
    # liveness by pid, not by the pid file's cmdline check: right after fork the child still
    # shows our own cmdline until it has exec'd
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not is_alive(pid):
            last = "process exited"
            break
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as err:
            last = str(err)
        time.sleep(0.3)
    log = processes(config).log_path(name)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
    raise StartupError(f"{name} not healthy at {url} ({last}); log {log}:\n{tail}")


def _admin_tls(config: ClusterConfig) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(config.pki_dir / "ca.crt"))
    ctx.load_cert_chain(str(config.pki_dir / "admin.crt"), str(config.pki_dir / "admin.key"))
    return ctx


def _insecure_tls() -> ssl.SSLContext:
    # controller manager and scheduler serve self-signed certs; /healthz is all we ask of them
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _require_free_port(port: int, owner: str) -> None:
    """Fail before starting a server whose port is taken: a health check would otherwise be
    answered by the other process (e.g. another cluster's etcd) and we would use its data."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as err:
            raise StartupError(f"{owner}: port 127.0.0.1:{port} is in use ({err}); another "
                               "cluster? give this one other ports (ClusterConfig.etcd_port)"
                               ) from err


def start_etcd(config: ClusterConfig) -> None:
    if processes(config).pid("etcd") is None:
        _require_free_port(config.etcd_port, "etcd")
        _require_free_port(config.etcd_port + 1, "etcd")
    url = f"http://127.0.0.1:{config.etcd_port}"
    peer = f"http://127.0.0.1:{config.etcd_port + 1}"
    pid = processes(config).start("etcd", [
        str(binary("etcd")), "--name", config.name, "--data-dir", str(config.state / "etcd"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{config.name}={peer}", "--log-level", "warn",
        "--quota-backend-bytes", str(2 << 30), "--unsafe-no-fsync",
    ])
    _wait_healthy("etcd", pid, f"{url}/health", config, 30)


def start_apiserver(config: ClusterConfig) -> None:
    p = config.pki_dir
    tol = str(config.eviction_toleration_s)
    pid = processes(config).start("kube-apiserver", [
        str(binary("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{config.etcd_port}",
        f"--bind-address={config.host_ip}", f"--advertise-address={config.host_ip}",
        f"--secure-port={API_PORT}",
        f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
        f"--client-ca-file={p / 'ca.crt'}",
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        f"--service-account-issuer=https://kubernetes.default.svc.{K8S_CLUSTER_DOMAIN}",
        f"--service-account-key-file={p / 'sa.pub'}",
        f"--service-account-signing-key-file={p / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
        f"--default-not-ready-toleration-seconds={tol}",
        f"--default-unreachable-toleration-seconds={tol}",
        "--profiling=false", "--event-ttl=30m", "--v=1",
    ])
    _wait_healthy("kube-apiserver", pid, f"{config.api_url}/readyz", config, 120, _admin_tls(config))


def start_controller_manager(config: ClusterConfig) -> None:
    p = config.pki_dir
    kubeconfig = str(config.kubeconfig(pki.CONTROLLER_MANAGER.name))
    pid = processes(config).start("kube-controller-manager", [
        str(binary("kube-controller-manager")),
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={config.host_ip}", f"--secure-port={CONTROLLER_MANAGER_PORT}",
        "--leader-elect=false", "--use-service-account-credentials=true",
        f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--node-monitor-period=2s", "--pvclaimbinder-sync-period=2s",
        f"--node-monitor-grace-period={config.node_monitor_grace_s}s",
        "--controllers=*,-bootstrapsigner,-tokencleaner,-service-lb-controller,"
        "-node-route-controller,-cloud-node-lifecycle-controller",
        "--v=1",
    ])
    url = f"https://{config.host_ip}:{CONTROLLER_MANAGER_PORT}/healthz"
    _wait_healthy("kube-controller-manager", pid, url, config, 60, _insecure_tls())


def start_scheduler(config: ClusterConfig) -> None:
    kubeconfig = str(config.kubeconfig(pki.SCHEDULER.name))
    pid = processes(config).start("kube-scheduler", [
        str(binary("kube-scheduler")),
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={config.host_ip}", f"--secure-port={SCHEDULER_PORT}",
        "--leader-elect=false", "--v=1",
    ])
    url = f"https://{config.host_ip}:{SCHEDULER_PORT}/healthz"
    _wait_healthy("kube-scheduler", pid, url, config, 60, _insecure_tls())


def corefile(config: ClusterConfig) -> str:
    """Cluster names from the kubernetes plugin; anything else is NXDOMAIN (no upstream here)."""
    kubeconfig = config.kubeconfig(pki.COREDNS.name)
    return f"""\
{K8S_CLUSTER_DOMAIN}:{DNS_PORT} in-addr.arpa:{DNS_PORT} {{
    bind {config.host_ip}
    errors
    ready {config.host_ip}:{DNS_READY_PORT}
    kubernetes {K8S_CLUSTER_DOMAIN} in-addr.arpa {{
        kubeconfig {kubeconfig} hlat
        pods insecure
        ttl 0
    }}
}}
.:{DNS_PORT} {{
    bind {config.host_ip}
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def start_coredns(config: ClusterConfig) -> None:
    path = config.state / "Corefile"
    path.write_text(corefile(config))
    pid = processes(config).start("coredns", [str(binary("coredns")), "-conf", str(path)])
    url = f"http://{config.host_ip}:{DNS_READY_PORT}/ready"
    _wait_healthy("coredns", pid, url, config, 60)


STARTERS: dict[str, Callable[[ClusterConfig], None]] = {
    "etcd": start_etcd,
    "kube-apiserver": start_apiserver,
    "kube-controller-manager": start_controller_manager,
    "kube-scheduler": start_scheduler,
    "coredns": start_coredns,
}


def stop(config: ClusterConfig) -> None:
    """Stop every component in reverse start order (API server before etcd)."""
    table = processes(config)
    for name in reversed(COMPONENTS):
        table.stop(name, timeout=15)
