"""Small helpers for tests that run against the local cluster (this suite and the operator's).

Waiting is by polling the API with a deadline, and a timeout says what was last seen, so a
failing test tells you where the cluster got stuck rather than only that it did.
"""

from __future__ import annotations

import socket
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed import netns
from hlat_testbed.config import ClusterConfig

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition did not hold before its deadline."""


def wait_for(probe: Callable[[], T | None], timeout: float, what: str,
             interval: float = 0.25) -> T:
    """Poll ``probe`` until it returns something truthy; raise with the last result if not."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise WaitTimeout(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def python_pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    """A Pod manifest whose single container runs ``script`` with this interpreter.

    Extra keyword arguments are merged into the pod spec (camelCase keys, as in YAML); the
    ``container`` keyword is merged into the container instead.
    """
    container = {"name": "main", "image": "host", "command": [sys.executable, "-u", "-c",
                                                               textwrap.dedent(script)]}
    container.update(spec.pop("container", {}))
    pod_spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
                "containers": [container]}
    pod_spec.update(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": pod_spec}


def read_pod(core: client.CoreV1Api, namespace: str, name: str) -> Any:
    try:
        return core.read_namespaced_pod(name, namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def wait_pod_phase(core: client.CoreV1Api, namespace: str, name: str, phases: set[str],
                   timeout: float = 60) -> Any:
    """The pod once its phase is one of ``phases``."""
    def probe() -> Any:
        pod = read_pod(core, namespace, name)
        return pod if pod is not None and pod.status.phase in phases else None
    return wait_for(probe, timeout, f"pod {namespace}/{name} in {sorted(phases)}")


def wait_pod_running(core: client.CoreV1Api, namespace: str, name: str,
                     timeout: float = 60) -> Any:
    """The pod once it is Running and Ready."""
    def probe() -> Any:
        pod = read_pod(core, namespace, name)
        if pod is None or pod.status.phase != "Running":
            return None
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        return pod if ready else None
    return wait_for(probe, timeout, f"pod {namespace}/{name} Running and Ready")


def wait_pod_gone(core: client.CoreV1Api, namespace: str, name: str, timeout: float = 60) -> None:
    wait_for(lambda: read_pod(core, namespace, name) is None, timeout,
             f"pod {namespace}/{name} to be deleted")


def terminated(pod: Any, container: int = 0) -> Any:
    """The ``terminated`` state of a pod's container (None if it has not terminated)."""
    statuses = pod.status.container_statuses or []
    return statuses[container].state.terminated if len(statuses) > container else None


def spare_cluster_config(state_dir: str) -> ClusterConfig:
    """A config for a throwaway cluster beside any others on this machine (other sessions'
    included): a random bridge, a /16 no interface uses, and free etcd ports."""
    used = netns.ip("-4", "-o", "addr", "show")
    subnet = next(f"10.{b}.0.0/16" for b in range(200, 240) if f" 10.{b}." not in used)
    tag = uuid.uuid4().hex[:6]
    return ClusterConfig(name=f"spare-{tag}", state_dir=state_dir, bridge=f"hls{tag}",
                         subnet=subnet, etcd_port=_free_port_pair())


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")
