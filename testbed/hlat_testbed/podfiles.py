"""Where a pod's files live on the host, for the CLI, fault injection and tests.

The process kubelet keeps each pod's output, pids and volumes under
``<state>/pods/<namespace>_<pod>_<uid>/``. Reading them needs no API client, which keeps
``hlat-cluster logs`` and ``hlat-cluster fault`` fast.
"""

from __future__ import annotations

from pathlib import Path

from hlat_testbed.config import ClusterConfig
from hlat_testbed.procs import is_alive


class PodNotFound(RuntimeError):
    """The pod never ran on this cluster's kubelets, or has no running process."""


def directory_for(config: ClusterConfig, namespace: str, pod: str, uid: str) -> Path:
    """The state directory the kubelet gives one pod (one per uid)."""
    return config.pods_dir / f"{namespace}_{pod}_{uid}"


def pod_dir(config: ClusterConfig, namespace: str, pod: str) -> Path:
    """The newest state directory of ``namespace/pod`` (a recreated pod has a new uid)."""
    matches = sorted(config.pods_dir.glob(f"{namespace}_{pod}_*"),
                     key=lambda p: p.stat().st_mtime)
    if not matches:
        raise PodNotFound(f"pod {namespace}/{pod} has never run on this cluster's kubelets")
    return matches[-1]


def pod_log(config: ClusterConfig, namespace: str, pod: str,
            container: str | None = None) -> str:
    """stdout+stderr of one container, or of all the pod's containers in name order."""
    directory = pod_dir(config, namespace, pod)
    logs = [directory / f"{container}.log"] if container else sorted(directory.glob("*.log"))
    return "".join(p.read_text(errors="replace") for p in logs if p.exists())


def container_pid(config: ClusterConfig, namespace: str, pod: str,
                  container: str | None = None) -> int:
    """The live main pid of a container (the first one running if ``container`` is None)."""
    directory = pod_dir(config, namespace, pod)
    candidates = [directory / f"{container}.pid"] if container else sorted(
        directory.glob("*.pid"))
    for path in candidates:
        try:
            pid = int(path.read_text())
        except (OSError, ValueError):
            continue
        if is_alive(pid):
            return pid
    raise PodNotFound(f"pod {namespace}/{pod} has no running process"
                      + (f" in container {container}" if container else ""))
