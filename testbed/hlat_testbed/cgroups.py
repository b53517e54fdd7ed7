"""One cgroup v2 group per container: how the process kubelet finds every process a container made.

A container runtime tracks a container by its cgroup, not by its process group: programs such as
torchrun start their workers in new sessions, so a signal to the main process's group misses
them, and once the main process is gone its workers are children of init, still holding ports and
blocked in collectives. Here each container gets ``<cgroup2>/hlat/<bridge>/<pod-uid>/<name>``;
the kubelet's spawn moves itself into it before it ``exec``s the container (``ip netns exec``
remounts /sys, so it cannot be done from inside), so everything the container starts is inside, and
``kill`` (``cgroup.kill``, Linux 5.14+) ends all of it at once.

Machines without a writable cgroup v2 hierarchy get ``None`` from ``for_container`` and the
kubelet falls back to process groups (the limitation above then applies).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import time
from pathlib import Path

JOIN = 'echo $$ > "$0" && exec "$@"'
"""``sh -c JOIN <cgroup.procs> ARGV...``: move this shell into the group, then exec ARGV."""


@functools.cache
def hierarchy() -> Path | None:
    """The cgroup v2 mount (``/sys/fs/cgroup`` or a hybrid's ``unified``), if it can be used."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                root = Path(fields[1])
                return root if _usable(root / "hlat") else None
    return None


def _usable(base: Path) -> bool:
    """Groups can be made under ``base``, a process moved into one, and the group killed."""
    probe = base / f"probe-{os.getpid()}"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        moved = subprocess.run(["sh", "-c", JOIN, str(probe / "cgroup.procs"), "true"],
                               capture_output=True, check=False).returncode == 0
        return moved and (probe / "cgroup.kill").exists()
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


class ContainerGroup:
    """The cgroup of one container (created empty; the container's first process joins it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def procs(self) -> Path:
        """Write a pid here to move that process into the group."""
        return self.path / "cgroup.procs"

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs.read_text().split()]
        except OSError:
            return []

    def kill(self, wait_s: float = 10.0) -> None:
        """SIGKILL every process in the group and wait until the kernel reports it empty."""
        if not self.path.exists():
            return
        with contextlib.suppress(OSError):
            (self.path / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + wait_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.02)

    def remove(self) -> None:
        """Kill what is left, then remove the group and its pod's group once that is empty."""
        self.kill()
        for path in (self.path, self.path.parent):
            with contextlib.suppress(OSError):
                path.rmdir()


def for_container(bridge: str, pod_uid: str, container: str) -> ContainerGroup | None:
    root = hierarchy()
    if root is None:
        return None
    return ContainerGroup(root / "hlat" / bridge / pod_uid / container)


def clear_leftovers(bridge: str) -> None:
    """Kill and remove every container group a previous kubelet of this cluster left."""
    root = hierarchy()
    if root is None:
        return
    base = root / "hlat" / bridge
    if not base.exists():
        return
    for pod in sorted(p for p in base.iterdir() if p.is_dir()):
        for container in sorted(c for c in pod.iterdir() if c.is_dir()):
            ContainerGroup(container).remove()
    with contextlib.suppress(OSError):
        base.rmdir()
