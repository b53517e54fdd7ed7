"""The launcher tells an out-of-memory kill from any other SIGKILL (`hlat_trainer.oom`): the
memory cgroup found as /proc shows it, and, with the kernel's own OOM killer in a real memory
cgroup of this machine (v1 on a hybrid host, v2 where the memory controller is there), the
exit reported `OOMKilled`, or not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hlat_trainer import agent, oom

HYBRID_CGROUP = """12:memory:/kubepods/pod1/c1
4:cpu,cpuacct:/kubepods/pod1/c1
0::/kubepods/pod1/c1
"""
HYBRID_MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
NAMESPACED_V2 = "0::/\n"
NAMESPACED_MOUNTS = "900 800 0:40 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup ro\n"


def test_the_memory_group_is_found_as_proc_shows_it(tmp_path: Path) -> None:
    # a hybrid host: the v1 memory hierarchy has the limit, not the controller-less v2 one
    assert oom.locate(HYBRID_CGROUP, HYBRID_MOUNTS) == Path(
        "/sys/fs/cgroup/memory/kubepods/pod1/c1")
    # a container with its own cgroup namespace: both say /, the mount is its group
    mount = tmp_path / "cg"
    (mount / "memory.events").parent.mkdir()
    (mount / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert oom.locate(NAMESPACED_V2, NAMESPACED_MOUNTS.replace("/sys/fs/cgroup", str(mount))
                      ) == mount
    assert oom.kills(mount) == 1
    # a mount whose root is below the process's group does not hold it
    assert oom.locate("7:memory:/other\n", "35 31 0:32 /kubepods /m rw - cgroup cgroup rw,memory\n"
                      ) is None
    # no memory controller anywhere: nothing to read, no claim made
    assert oom.locate("4:cpu:/x\n", HYBRID_MOUNTS) is None
    assert oom.kills(None) is None
    assert not oom.OomCounter(tmp_path / "absent").since_mark()


def _make_group(limit: int) -> Path | None:
    """A child of this process's memory cgroup limited to `limit` bytes, or None."""
    parent = oom.memory_cgroup()
    if parent is None or os.geteuid() != 0:
        return None
    group = parent / f"hlat-oom-test-{os.getpid()}"
    try:
        group.mkdir()
        if (group / "memory.limit_in_bytes").exists():  # v1
            (group / "memory.limit_in_bytes").write_text(str(limit))
        else:
            (group / "memory.max").write_text(str(limit))
            (group / "memory.swap.max").write_text("0")
    except OSError:
        return None
    return group


@pytest.fixture
def memory_group() -> Iterator[Path]:
    group = _make_group(64 << 20)
    if group is None:
        pytest.skip("needs root and a writable memory cgroup (this machine's is cgroup v1)")
    try:
        yield group
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


GREEDY = "b = []\nwhile True: b.append(bytearray(16 << 20))"
QUIET = "import time; time.sleep(60)"


class Reports:
    pushed = False

    def __init__(self) -> None:
        self.exits: list[tuple[int, int, str | None]] = []

    def record(self, fresh: bool = False) -> None:
        return None

    def report_exit(self, attempt: int, rank: int, code: int, reason: str | None = None
                    ) -> None:
        self.exits.append((attempt, code, reason))


def _supervise(group: Path, code: str, kill: bool) -> list[tuple[int, int, str | None]]:
    """The launcher's loop over one real worker started in `group`; its reports."""
    control = Reports()
    layout = agent.NodeLayout(nnodes=1, nproc=1, node_rank=0, master_addr="localhost",
                              master_port=29500)
    run = agent.Agent(layout, [], {}, control=control, wait_bound=0.5, warm=False,
                      oom=oom.OomCounter(group))

    def start(*_: object) -> list[subprocess.Popen[bytes]]:
        run.oom.mark()
        proc = subprocess.Popen(["sh", "-c", 'echo $$ > "$0" && exec "$@"',
                                 str(group / "cgroup.procs"), sys.executable, "-c", code])
        if kill:
            time.sleep(0.5)
            proc.send_signal(signal.SIGKILL)
        run.procs = [proc]
        return [proc]

    run._start = start  # type: ignore[method-assign]
    assert run._loop(attempt=3, steps_done=0, started=time.monotonic()) == 137
    return control.exits


def test_a_worker_the_kernel_killed_for_memory_is_reported_oomkilled(memory_group: Path
                                                                      ) -> None:
    before = oom.kills(memory_group)
    assert _supervise(memory_group, GREEDY, kill=False) == [(3, 137, "OOMKilled")]
    assert oom.kills(memory_group) == (before or 0) + 1  # the kernel's count, not ours


def test_a_worker_sigkilled_otherwise_is_not_called_out_of_memory(memory_group: Path) -> None:
    """Even in a group that had an OOM kill before the attempt began."""
    _supervise(memory_group, GREEDY, kill=False)
    assert _supervise(memory_group, QUIET, kill=True) == [(3, 137, None)]
