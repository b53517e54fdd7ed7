"""Background processes that outlive the command that started them, tracked by pid files.

``hlat-cluster up`` returns while etcd, the API server, the controllers, CoreDNS and the
kubelets keep running, so each is started in its own session (no terminal signal reaches it),
with stdout/stderr in ``logs/<name>.log`` and its pid in ``pids/<name>.pid``. Stopping is
bounded: SIGTERM, wait, SIGKILL, and the whole process group goes so no child is left behind.
A pid file records the process's start time as well (``/proc/<pid>/stat``), and is trusted only
while that still matches, which guards against pid reuse after a crash or a reboot (a cmdline
check would not do: right after fork the child still shows its parent's cmdline).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def is_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (reaping it if it is our own child)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


class ProcessTable:
    """Pid files and logs of the named background processes of one cluster."""

    def __init__(self, pids_dir: Path, logs_dir: Path) -> None:
        self.pids_dir, self.logs_dir = pids_dir, logs_dir

    def log_path(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def pid(self, name: str) -> int | None:
        """The live pid of ``name``, or None if it is not running."""
        path = self.pids_dir / f"{name}.pid"
        try:
            pid_str, ticks = path.read_text().split()[:2]
            pid = int(pid_str)
        except (OSError, ValueError):
            return None
        if not is_alive(pid) or str(start_ticks(pid)) != ticks:
            return None
        return pid

    def names(self) -> list[str]:
        if not self.pids_dir.exists():
            return []
        return sorted(p.stem for p in self.pids_dir.glob("*.pid"))

    def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None) -> int:
        """Start ``argv`` detached, unless ``name`` already runs; return its pid."""
        running = self.pid(name)
        if running is not None:
            return running
        self.pids_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path(name).open("ab") as log:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=env, close_fds=True,
            )
        (self.pids_dir / f"{name}.pid").write_text(f"{proc.pid}\n{start_ticks(proc.pid)}\n")
        return proc.pid

    def stop(self, name: str, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout``; forget the pid file."""
        pid = self.pid(name)
        if pid is not None:
            terminate_group(pid, timeout)
        with contextlib.suppress(FileNotFoundError):
            (self.pids_dir / f"{name}.pid").unlink()


def terminate_group(pid: int, timeout: float) -> None:
    """SIGTERM ``pid``'s process group (it leads one), then SIGKILL whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and is_alive(pid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and is_alive(pid):
        time.sleep(0.05)
