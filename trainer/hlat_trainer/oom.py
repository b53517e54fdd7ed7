"""Out-of-memory kills in this process's memory cgroup: how the launcher tells an OOM kill of
its trainer from any other SIGKILL.

A container's processes share its memory cgroup, whose limit is the container's memory limit.
When they exceed it, the kernel kills the process with the highest badness (the trainer, by
far the largest) with SIGKILL and counts the kill in the group: `oom_kill` in cgroup v2's
`memory.events`, in cgroup v1's `memory.oom_control` (Linux 4.13+). A container runtime reads
that count to report a container `OOMKilled`; under `restartStrategy: InPlace` the container
outlives its trainer and nobody else would. The launcher reads the count when it starts an
attempt and again when a worker died by a signal, and reports `OOMKilled` when it rose.

The group is found as the runtime would show it to the process: its line in /proc/self/cgroup
(the v1 memory hierarchy's on a hybrid host, else the v2 one), under that hierarchy's mount in
/proc/self/mountinfo (inside a container with its own cgroup namespace both say `/`, the mount
is the container's group).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

OOM_KILLED = "OOMKilled"
"""The reason a container runtime gives a container whose group had an OOM kill."""


def locate(proc_cgroup: str, mountinfo: str) -> Path | None:
    """The directory of the memory cgroup described by /proc/<pid>/cgroup's text, under the
    mounts of /proc/<pid>/mountinfo's text; None where there is none (no memory controller
    mounted, or the group outside every mount)."""
    v1: str | None = None
    v2: str | None = None
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    mounts: list[tuple[str, str, str, str]] = []  # fstype, super options, root, mount point
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) >= 3:
            mounts.append((after[0], after[2], fields[3], _unescape(fields[4])))
    mounts.reverse()  # of mounts stacked on one point, the last one is the one seen
    if v1 is not None:
        for fstype, options, root, point in mounts:
            if fstype == "cgroup" and "memory" in options.split(","):
                return _under(point, root, v1)
    if v2 is not None:
        for fstype, _, root, point in mounts:
            if fstype == "cgroup2":
                found = _under(point, root, v2)
                return found if found is not None and (found / "memory.events").exists() else None
    return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in octal (`\\040`)."""
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def _under(point: str, root: str, path: str) -> Path | None:
    rel = os.path.relpath(path, root)
    if rel == ".." or rel.startswith("../"):
        return None
    return Path(point) if rel == "." else Path(point) / rel


def memory_cgroup(pid: int | str = "self") -> Path | None:
    """This process's (or `pid`'s) memory cgroup directory, or None."""
    try:
        return locate(Path(f"/proc/{pid}/cgroup").read_text(),
                      Path(f"/proc/{pid}/mountinfo").read_text())
    except OSError:
        return None


def kills(group: Path | None) -> int | None:
    """The group's count of OOM kills (v2 `memory.events`, v1 `memory.oom_control`); None
    where it cannot be read (no group, an older kernel without the field)."""
    if group is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        with contextlib.suppress(OSError, ValueError):
            for line in (group / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return None


class OomCounter:
    """The launcher's view of its container's OOM kills: `mark()` when an attempt starts,
    `since_mark()` when a worker died: True if the kernel OOM-killed a process of the group
    in between (the group is looked up once: a container's group does not change)."""

    def __init__(self, group: Path | None = None) -> None:
        self.group = memory_cgroup() if group is None else group
        self.marked = kills(self.group)

    def mark(self) -> None:
        self.marked = kills(self.group)

    def since_mark(self) -> bool:
        now = kills(self.group)
        return now is not None and self.marked is not None and now > self.marked
