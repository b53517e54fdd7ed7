"""The rig's pod network: a pod keeps reaching the host (CoreDNS, the API server) while other
pods come and go on the bridge."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hlat_testbed import netns
from hlat_testbed.testing import spare_cluster_config

LOW_MAC = "02:00:00:00:00:01"
"""Below any MAC the kernel picks for a veth (those are random, locally administered)."""


@pytest.fixture
def bridge(tmp_path: Path) -> Iterator[tuple[str, str, int]]:
    cfg = spare_cluster_config(str(tmp_path / "state"))
    host = cfg.host_ip
    netns.ensure_bridge(cfg.bridge, f"{host}/{cfg.network.prefixlen}")
    try:
        yield cfg.bridge, host, cfg.network.prefixlen
    finally:
        netns.cleanup(cfg.bridge)


def _pod(bridge: str, uid: str, address: str, prefix: int, host: str) -> str:
    return netns.create_pod_network(bridge, uid, f"{address}/{prefix}", host,
                                    f"nameserver {host}\n", "127.0.0.1\tlocalhost\n")


def _connect_from(ns: str, host: str, port: int) -> subprocess.CompletedProcess[str]:
    code = (f"import socket; socket.create_connection(({host!r}, {port}), timeout=2).close(); "
            "print('connected')")
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=30)


def test_a_pod_reaches_the_host_after_another_pod_leaves_the_bridge(
        bridge: tuple[str, str, int]) -> None:
    name, host, prefix = bridge
    base = host.rsplit(".", 2)[0]
    mac = netns.link_mac(name)
    with socket.create_server((host, 0)) as server:
        port = server.getsockname()[1]
        # a pod whose veth has the lowest MAC on the bridge: a bridge without a MAC of its own
        # takes it, and gives it up when that pod goes
        _pod(name, "pod-low", f"{base}.1.2", prefix, host)
        netns.ip("link", "set", "dev", netns.veth_names(name, "pod-low")[0], "address", LOW_MAC)
        first = _pod(name, "pod-a", f"{base}.1.3", prefix, host)
        assert _connect_from(first, host, port).returncode == 0  # the host's MAC now cached
        netns.delete_pod_network(name, "pod-low")
        assert netns.link_mac(name) == mac
        reached = _connect_from(first, host, port)
        assert reached.returncode == 0, reached.stderr[-300:]
