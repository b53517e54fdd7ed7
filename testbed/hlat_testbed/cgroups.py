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

A container with a memory limit (``resources.limits.memory``) gets it enforced by the kernel,
as a runtime does: in its own v2 group (``memory.max``) where the v2 hierarchy has the memory
controller, else, on a hybrid host (the memory controller in cgroup v1), in a v1 memory group
of its own under this process's (``memory.limit_in_bytes``), which the container's first
process joins too. When the container ends having had an OOM kill in its group, its reason is
``OOMKilled``. (This machine is a hybrid one: the v1 path is the one its tests exercise.)
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import threading
import time
from pathlib import Path

from hlat_trainer import oom

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
    # a name per thread: the kubelet starts pods on threads, and functools.cache lets two
    # first calls run at once; with one name, one removed the group the other was probing
    # and cached False (memory limits unenforced for that kubelet's life: a flaky OOM test)
    probe = base / f"probe-{os.getpid()}-{threading.get_ident()}"
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


@functools.cache
def memory_base() -> Path | None:
    """Where the containers' v1 memory groups go on a hybrid host: under this process's own
    memory group; None where the memory controller is not in cgroup v1 or cannot be written."""
    group = oom.memory_cgroup()
    if group is None or not (group / "memory.limit_in_bytes").exists():
        return None
    probe = group / f"hlat-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        probe.mkdir(exist_ok=True)
        return group / "hlat"
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def can_limit_memory() -> bool:
    """Whether containers' memory limits are enforced here (see the module's docstring)."""
    root = hierarchy()
    if root is None:
        return False
    if memory_base() is not None:
        return True
    with contextlib.suppress(OSError):
        return "memory" in (root / "cgroup.controllers").read_text().split()
    return False


def container_mounts() -> list[dict[str, str]]:
    """The cgroup file systems a container sees at /sys/fs/cgroup, read-only, as a runtime
    mounts them: the v2 hierarchy on a unified host; on a hybrid one a tmpfs holding the v1
    memory hierarchy and the v2 one (``unified``), the two the trainer reads. In the host's
    cgroup namespace (a runtime's default on a v1 or hybrid host): /proc/self/cgroup then
    names the container's groups by their full paths, which these mounts resolve."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            if fields[2] == "cgroup2":
                found.setdefault("cgroup2", fields[1])
            elif fields[2] == "cgroup" and "memory" in fields[3].split(","):
                found.setdefault("memory", fields[1])
    if found.get("cgroup2") == "/sys/fs/cgroup":
        return [{"fstype": "cgroup2", "options": "ro", "target": "/sys/fs/cgroup"}]
    if "memory" not in found:
        return []
    out = [{"fstype": "tmpfs", "options": "mode=755", "target": "/sys/fs/cgroup"},
           {"fstype": "cgroup", "options": "ro,memory", "target": "/sys/fs/cgroup/memory"}]
    if "cgroup2" in found:
        out.append({"fstype": "cgroup2", "options": "ro", "target": "/sys/fs/cgroup/unified"})
    return out


class ContainerGroup:
    """The cgroup of one container (created empty; the container's first process joins it)."""

    def __init__(self, path: Path, memory: Path | None = None) -> None:
        self.path = path
        self.memory = memory
        """Its v1 memory group (a hybrid host), made by `limit_memory`."""
        self.memory_limited = False
        self.oom_mark: int | None = None

    def limit_memory(self, limit: int) -> bool:
        """Have the kernel hold the container to `limit` bytes; False where it cannot."""
        try:
            if self.memory is not None:
                self.memory.mkdir(parents=True, exist_ok=True)
                (self.memory / "memory.limit_in_bytes").write_text(str(limit))
            else:
                root = hierarchy()
                if root is None or "memory" not in (root / "cgroup.controllers").read_text():
                    return False
                self.create()
                for parent in reversed(self.path.relative_to(root).parents):
                    (root / parent / "cgroup.subtree_control").write_text("+memory")
                (self.path / "memory.max").write_text(str(limit))
        except OSError:
            return False
        self.memory_limited = True
        return True

    def join_files(self) -> list[Path]:
        """The ``cgroup.procs`` files the container's first process writes its pid to."""
        if self.memory_limited and self.memory is not None:
            return [self.procs, self.memory / "cgroup.procs"]
        return [self.procs]

    def mark_oom(self) -> None:
        """The container (re)starts: OOM kills from here on are its own."""
        self.oom_mark = self._oom_kills()

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed a process of the container since `mark_oom`."""
        now, mark = self._oom_kills(), self.oom_mark
        return now is not None and mark is not None and now > mark

    def _oom_kills(self) -> int | None:
        if not self.memory_limited:
            return None
        return oom.kills(self.memory if self.memory is not None else self.path)

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
        for path in (self.path, self.path.parent, *self._memory_dirs()):
            with contextlib.suppress(OSError):
                path.rmdir()

    def _memory_dirs(self) -> list[Path]:
        if self.memory is None:
            return []
        deadline = time.monotonic() + 5  # the kernel empties a v1 group a moment after a kill
        while self.memory.exists() and time.monotonic() < deadline:
            try:
                self.memory.rmdir()
            except OSError:
                time.sleep(0.05)
        return [self.memory.parent]


def for_container(bridge: str, pod_uid: str, container: str) -> ContainerGroup | None:
    root = hierarchy()
    if root is None:
        return None
    base = memory_base()
    memory = base / bridge / pod_uid / container if base is not None else None
    return ContainerGroup(root / "hlat" / bridge / pod_uid / container, memory)


def clear_leftovers(bridge: str) -> None:
    """Kill and remove every container group a previous kubelet of this cluster left."""
    root = hierarchy()
    if root is None:
        return
    base = root / "hlat" / bridge
    if not base.exists():
        return
    memory = memory_base()
    for pod in sorted(p for p in base.iterdir() if p.is_dir()):
        for container in sorted(c for c in pod.iterdir() if c.is_dir()):
            mem = memory / bridge / pod.name / container.name if memory is not None else None
            ContainerGroup(container, mem if mem is not None and mem.exists() else None).remove()
    with contextlib.suppress(OSError):
        base.rmdir()
    if memory is not None:
        with contextlib.suppress(OSError):
            (memory / bridge).rmdir()
