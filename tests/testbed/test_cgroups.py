"""A container's cgroup holds everything it starts, and killing the group ends all of it."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from hlat_testbed import cgroups
from hlat_testbed.procs import is_alive
from hlat_testbed.testing import wait_for

SPAWNS_A_DETACHED_WORKER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          start_new_session=True)
print(worker.pid, flush=True)
time.sleep(600)
"""


def test_killing_a_container_group_ends_workers_in_other_sessions() -> None:
    if cgroups.hierarchy() is None:
        pytest.skip("no writable cgroup v2 hierarchy on this machine (the kubelet then falls "
                    "back to process groups)")
    group = cgroups.for_container("hlt-unit", str(uuid.uuid4()), "main")
    assert group is not None
    group.create()
    try:
        main = subprocess.Popen(
            ["sh", "-c", cgroups.JOIN, str(group.procs), sys.executable, "-c",
             SPAWNS_A_DETACHED_WORKER], stdout=subprocess.PIPE, text=True)
        assert main.stdout is not None
        worker = int(main.stdout.readline())
        assert sorted(group.pids()) == sorted([main.pid, worker])
        group.kill()
        main.wait(timeout=10)
        wait_for(lambda: not is_alive(worker), 10, "the detached worker to die")
        assert group.pids() == []
    finally:
        group.remove()
        cgroups.clear_leftovers("hlt-unit")
    assert not group.path.exists() and not group.path.parent.exists()
