"""Pod networking: one Linux bridge per cluster, one network namespace and veth per pod.

EndpointSlices reject loopback addresses, so pods need real, distinct IPs for headless Services
and DNS to work as on EKS. Each pod gets a network namespace with ``eth0`` (a veth whose host
end sits on the cluster's bridge) in the cluster's private /16; the bridge's own address is the
host, where the API server and CoreDNS listen. All pods share one L2 segment, so no routes or
forwarding are needed and no packet leaves this machine.

``ip netns exec`` bind-mounts the files in ``/etc/netns/<ns>/`` over ``/etc/``; that is how each
pod gets its own resolv.conf (pointing at CoreDNS) and hosts file. Names are derived from the
bridge name, so ``cleanup`` can find and remove everything a cluster created, even after a crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
from pathlib import Path

NETNS_RUN = Path("/var/run/netns")
NETNS_ETC = Path("/etc/netns")


class NetError(RuntimeError):
    """An ``ip`` command failed."""


def ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def bridge_mac(bridge: str) -> str:
    """The bridge's own MAC address: fixed, locally administered, derived from its name."""
    digest = hashlib.sha1(bridge.encode()).hexdigest()[:10]
    return ":".join(["02", *(digest[i:i + 2] for i in range(0, 10, 2))])


def link_mac(name: str) -> str:
    return Path(f"/sys/class/net/{name}/address").read_text().strip()


def ensure_bridge(bridge: str, host_cidr: str) -> None:
    """Create the bridge with the host's address (e.g. ``10.244.0.1/16``) if missing.

    The bridge gets a MAC address of its own. Left to itself Linux gives a bridge the lowest MAC
    among its ports, so it changed as pods came and went, and every pod that had the old one in
    its ARP cache lost what it sent the host (DNS, the API server) until that entry expired:
    seen as 10 to 40 s of DNS timeouts at a trainer's rendezvous."""
    if not link_exists(bridge):
        ip("link", "add", bridge, "type", "bridge")
    if link_mac(bridge) != bridge_mac(bridge):
        ip("link", "set", "dev", bridge, "address", bridge_mac(bridge))
    if host_cidr.split("/")[0] not in ip("-4", "addr", "show", "dev", bridge):
        ip("addr", "add", host_cidr, "dev", bridge)
    ip("link", "set", bridge, "up")


def pod_netns_name(bridge: str, pod_uid: str) -> str:
    return f"{bridge}-{pod_uid}"


def veth_names(bridge: str, pod_uid: str) -> tuple[str, str]:
    """The pod veth's host end (on the bridge) and its peer's name before it becomes eth0."""
    digest = hashlib.sha1(pod_uid.encode()).hexdigest()[:8]
    return f"{bridge[:6]}{digest}", f"tmp{digest}"


def create_pod_network(bridge: str, pod_uid: str, pod_cidr: str, gateway: str,
                       resolv_conf: str, hosts: str) -> str:
    """Create the pod's netns with ``eth0`` at ``pod_cidr`` (e.g. ``10.244.1.5/16``)."""
    ns = pod_netns_name(bridge, pod_uid)
    host_end, peer = veth_names(bridge, pod_uid)
    delete_pod_network(bridge, pod_uid)
    etc = NETNS_ETC / ns
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "resolv.conf").write_text(resolv_conf)
    (etc / "hosts").write_text(hosts)
    ip("netns", "add", ns)
    ip("link", "add", host_end, "type", "veth", "peer", "name", peer)
    ip("link", "set", peer, "netns", ns)
    ip("-n", ns, "link", "set", peer, "name", "eth0")
    ip("-n", ns, "addr", "add", pod_cidr, "dev", "eth0")
    ip("-n", ns, "link", "set", "eth0", "up")
    ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", ns, "route", "add", "default", "via", gateway)
    ip("link", "set", host_end, "master", bridge, "up")
    return ns


def delete_pod_network(bridge: str, pod_uid: str) -> None:
    """Remove the pod's netns, veth and /etc/netns files; absent parts are fine."""
    ns = pod_netns_name(bridge, pod_uid)
    host_end, _ = veth_names(bridge, pod_uid)
    _delete_netns(ns)
    if link_exists(host_end):
        ip("link", "del", host_end, check=False)


def set_pod_link(bridge: str, pod_uid: str, up: bool) -> None:
    """Bring the host end of the pod's veth down (the pod is cut off the network: what it sends
    is lost, nothing reaches it) or up again; absent links are fine."""
    host_end, _ = veth_names(bridge, pod_uid)
    if link_exists(host_end):
        ip("link", "set", host_end, "up" if up else "down", check=False)


def limit_port_rate(bridge: str, pod_uid: str, port: int, bytes_per_second: int) -> None:
    """What the pod sends to TCP/UDP destination `port` leaves its eth0 at `bytes_per_second`
    at most (an HTB class with a u32 filter on the destination port; other traffic is not
    classified and goes at full speed); replaces an earlier limit."""
    ns, dev = pod_netns_name(bridge, pod_uid), "eth0"
    clear_port_rates(bridge, pod_uid)
    rate = f"{bytes_per_second * 8}bit"
    for args in (["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"],
                 ["class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb",
                  "rate", rate, "ceil", rate],
                 ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                  "u32", "match", "ip", "dport", str(port), "0xffff", "flowid", "1:20"]):
        ip("netns", "exec", ns, "tc", *args)


def clear_port_rates(bridge: str, pod_uid: str) -> None:
    """Remove `limit_port_rate`'s limit (none, or the pod gone, is fine)."""
    ip("netns", "exec", pod_netns_name(bridge, pod_uid), "tc", "qdisc", "del", "dev", "eth0",
       "root", check=False)


def _delete_netns(ns: str) -> None:
    if (NETNS_RUN / ns).exists():
        ip("netns", "del", ns, check=False)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(NETNS_ETC / ns)


def cluster_netns(bridge: str) -> list[str]:
    """Every pod network namespace of the cluster on ``bridge``."""
    if not NETNS_RUN.exists():
        return []
    return sorted(p.name for p in NETNS_RUN.iterdir() if p.name.startswith(f"{bridge}-"))


def cluster_links(bridge: str) -> list[str]:
    """The bridge and every link enslaved to it (the host ends of its pods' veths)."""
    if not link_exists(bridge):
        return []
    lines = ip("-o", "link", "show", "master", bridge, check=False).splitlines()
    ports = [line.split(":")[1].strip().split("@")[0] for line in lines if ":" in line]
    return sorted([bridge, *ports])


def cleanup(bridge: str) -> None:
    """Remove every netns, veth and the bridge of one cluster."""
    for ns in cluster_netns(bridge):
        _delete_netns(ns)
    if NETNS_ETC.exists():
        for stale in NETNS_ETC.glob(f"{bridge}-*"):
            shutil.rmtree(stale, ignore_errors=True)
    for link in cluster_links(bridge):
        if link != bridge:
            ip("link", "del", link, check=False)
    if link_exists(bridge):
        ip("link", "del", bridge, check=False)
