"""The rig's fault tools that need no cluster: `faults.pin`, which keeps a slowed trainer and
its healthy peers on separate CPUs (`faults.Slowdown(apart=...)`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hlat_testbed import faults

CPUS = sorted(os.sched_getaffinity(0))
# a process with a second thread and a child: what a trainer has (torch's threads, gloo's)
PROGRAM = ("import subprocess, sys, threading, time; "
           "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           "print('ready', flush=True); time.sleep(60)")


@pytest.fixture
def trainer() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    yield proc
    for child in faults._descendants(proc.pid):
        os.kill(child, 9)
    proc.kill()
    proc.wait()


def _affinities(pid: int) -> list[set[int]]:
    tasks = [t for p in (pid, *faults._descendants(pid))
             for t in Path(f"/proc/{p}/task").iterdir()]
    return [os.sched_getaffinity(int(t.name)) for t in tasks]


@pytest.mark.skipif(len(CPUS) < 2, reason="pinning apart needs two CPUs")
def test_pin_moves_every_thread_and_child_and_back(trainer: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 10
    while len(_affinities(trainer.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the child started
    assert len(_affinities(trainer.pid)) == 3  # its two threads and its child
    faults.pin([trainer.pid], {CPUS[-1]})
    assert all(a == {CPUS[-1]} for a in _affinities(trainer.pid))
    faults.pin([trainer.pid], set(CPUS))
    assert all(a == set(CPUS) for a in _affinities(trainer.pid))
