"""Checkpoint faults end to end: a crash in the middle of an asynchronous write, a corrupt
newest checkpoint, every checkpoint unreadable. Real operator, real trainers, the shared
volume's real files; what must hold: no complete checkpoint is lost, the work lost is at most
one checkpoint interval, one gang at a time, and a run that cannot resume fails with the
reason instead of starting over at step 1.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_env import (
    JOB,
    Env,
    after_a_fresh_beat,
    first_step_time,
    metric_lines,
    report_recovery,
    resumed_from,
    steps_logged,
)
from e2e_spec import tiny_spec

from hlat_api.layout import list_checkpoints
from hlat_testbed import faults, netns
from hlat_testbed.podfiles import container_pid

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

INTERVAL = 4
# 300 s by default; shortened for the test of a worker that never exits after finishing. Not to
# 8 s: under a full run's load a healthy gang took longer than that from its `finished` beat to
# its pods' exit (trainer and torchrun teardown, the launcher's standbys, the kubelet's report),
# and the crash-mid-write test, done training, was restarted once more (CI, 2026-11-27)
OPERATOR_ENV = {"HLAT_OPERATOR_EXIT_AFTER_FINISH_SECONDS": "30"}


def checkpoints(env: Env) -> Path:
    return env.fsx / "checkpoints"


def complete_steps(env: Env) -> list[int]:
    return [e.step for e in list_checkpoints(checkpoints(env), JOB) if e.complete]


def async_spec(steps: int, write_delay: float) -> dict[str, object]:
    spec = tiny_spec(steps=steps)
    spec["checkpoint"].update({"async": True, "interval": INTERVAL, "keep": 3})
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "HLAT_FAULT_CHECKPOINT_WRITE_DELAY_SECONDS", "value": str(write_delay)}]}]}}
    return spec


def test_a_crash_in_the_middle_of_an_asynchronous_write_loses_no_checkpoint(job_env: Env
                                                                            ) -> None:
    """Writes take 3 s; the worker is killed while one is in flight (its directory exists,
    its `done` does not): the new gang removes the incomplete one, resumes from the newest
    complete one, and loses at most one interval of steps."""
    job_env.create(async_spec(steps=24, write_delay=3.0))
    job_env.wait("a complete checkpoint", lambda s: s.get("phase") == "Running"
                 and (s.get("latestCheckpoint") or {}).get("step", 0) >= INTERVAL, 180)
    root = checkpoints(job_env) / JOB
    deadline = time.monotonic() + 60
    in_flight = None
    while time.monotonic() < deadline:  # a write in flight: a step directory without `done`
        entries = list_checkpoints(checkpoints(job_env), JOB)
        in_flight = next((e.step for e in entries if not e.complete), None)
        if in_flight is not None:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"no write in flight seen in {root}")
    before = complete_steps(job_env)
    fault_at = time.time()
    faults.kill(job_env.cluster.config, job_env.ns, f"{JOB}-a0-0")
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    report_recovery(job_env, "crash mid asynchronous write", fault_at)
    assert done["restarts"]["total"] == 1 and done["progress"]["step"] == 24
    resumed = resumed_from(job_env.pod_log(1, 0))
    assert resumed is not None and resumed == max(before), (resumed, before)
    # the one before the unfinished write: lost are that interval and the steps trained
    # while it was written (an asynchronous checkpoint counts only once complete)
    assert in_flight is not None and resumed == in_flight - INTERVAL
    assert max(steps_logged(job_env.pod_log(0, 0))) >= in_flight
    assert not (checkpoints(job_env) / JOB / f"step_{in_flight}").exists() or (
        in_flight in complete_steps(job_env))  # removed, or written again to completion
    assert 24 in complete_steps(job_env)
    assert all(e.complete for e in list_checkpoints(checkpoints(job_env), JOB))
    assert job_env.max_gangs == 1


def test_a_corrupt_newest_checkpoint_resumes_from_the_one_before(job_env: Env) -> None:
    job_env.create(tiny_spec(steps=30))
    job_env.wait_saved(6)  # steps 2 and 4 complete (by the log: the status lags)
    fault_at = time.time()
    faults.kill(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1")
    job_env.wait_phase("Restarting", 30)
    newest = max(complete_steps(job_env))
    for shard in (checkpoints(job_env) / JOB / f"step_{newest}").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated, though `done` exists
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    assert done["progress"]["step"] == 30
    report_recovery(job_env, "newest checkpoint corrupt", fault_at)
    log = job_env.pod_log(1, 0)
    assert resumed_from(log) == newest - 2, log[-1500:]
    assert f"step_{newest} is unreadable" in log


def test_every_checkpoint_unreadable_fails_the_job_instead_of_starting_over(job_env: Env
                                                                           ) -> None:
    job_env.create(tiny_spec(steps=30))
    job_env.wait_saved(6)  # steps 2 and 4 complete (by the log: the status lags)
    faults.kill(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1")
    job_env.wait_phase("Restarting", 30)
    for shard in (checkpoints(job_env) / JOB).glob("step_*/*.distcp"):
        shard.write_bytes(b"garbage")
    failed = job_env.wait("Failed", lambda s: s.get("phase") == "Failed", 180)
    assert failed["lastFailure"]["reason"] == "ConfigError", failed["lastFailure"]
    assert failed["restarts"]["total"] == 1  # the kill's restart only: not retried
    log = job_env.pod_log(1, 0)
    assert "no complete checkpoint of job" in log and "could be loaded" in log
    assert not steps_logged(log), "it started over at step 1"


def _process_with_local_rank(root: int, rank: int) -> int:
    """The trainer process of `root`'s tree whose LOCAL_RANK is `rank`."""
    for pid in faults._descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"hlat_trainer" in cmdline and f"LOCAL_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no trainer with LOCAL_RANK={rank} under {root}")


def _wait_retraining(job_env: Env) -> None:
    """Recovered: the next attempt trains a step, with one restart counted and never two gangs
    (training on to the end, as other tests do, proves nothing more here and cost two to three
    minutes each of the suite's critical path)."""
    back = job_env.wait("attempt 1 training", lambda s: s.get("attempt") == 1
                        and s.get("phase") == "Running"
                        and first_step_time(job_env.pod_log(1, 0)) is not None, 180)
    assert back["restarts"]["total"] == 1 and job_env.max_gangs == 1, back["restarts"]


def test_a_worker_alive_and_renewing_but_stuck_in_a_collective_is_restarted(
        job_env: Env) -> None:
    """Two processes per node; node 1's second process is frozen, so every rank blocks in
    the next collective while each node's heartbeat thread (local rank 0) goes on renewing:
    a hang only the progress clock shows."""
    # 300 steps: still training when frozen (40 could all be done before the freeze)
    spec = tiny_spec(steps=300, heartbeat={"startupTimeoutSeconds": 120, "timeoutSeconds": 6})
    spec["processesPerNode"] = 2
    spec["train"].update({"globalBatch": 8, "microBatch": 2})
    job_env.create(spec)
    job_env.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                 and (s.get("latestCheckpoint") or {}).get("step", 0) >= 2, 180)
    pod = f"{JOB}-a0-1"
    frozen = _process_with_local_rank(container_pid(job_env.cluster.config, job_env.ns, pod), 1)
    fault_at = time.time()
    os.kill(frozen, signal.SIGSTOP)
    restarting = job_env.wait_phase("Restarting", 60)
    failure = restarting["lastFailure"]
    assert failure["reason"] == "HeartbeatTimeout", failure
    assert "alive but no progress" in failure["message"], failure
    _wait_retraining(job_env)
    report_recovery(job_env, "one process stuck in a collective (6 s timeout)", fault_at)


@pytest.fixture
def small_disk(job_env: Env) -> Iterator[Path]:
    """The job's shared volume on a 40 MiB tmpfs (its data copied over): a disk that fills."""
    data = job_env.fsx.parent / "data-copy"
    shutil.copytree(job_env.fsx, data)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(job_env.fsx)],
                   check=True)
    try:
        shutil.copytree(data, job_env.fsx, dirs_exist_ok=True)
        yield job_env.fsx
    finally:
        job_env.delete()
        subprocess.run(["umount", "-l", str(job_env.fsx)], check=False)


def _fill(disk: Path) -> Path:
    """Write a filler file until the file system is full."""
    filler = disk / "filler"
    chunk = b"\0" * (1 << 20)
    with filler.open("wb") as out:
        try:
            while True:
                out.write(chunk)
                out.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    return filler


def test_a_disk_that_fills_while_writing_loses_no_checkpoint(job_env: Env, small_disk: Path
                                                             ) -> None:
    """The volume fills up (another job's files, say) while checkpoints are being written: the
    write fails, the trainer exits with the error, the gang restarts, the half-written
    checkpoint is removed, and once space is freed the job resumes from its newest complete
    checkpoint (work lost: at most one interval) and ends Succeeded. An attempt that starts
    while the disk is still full fails the same way (how many do depends on how fast the
    space is freed): every restart must be the disk's doing, and none may come after."""
    interval = 2
    job_env.create(tiny_spec(steps=200))
    job_env.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                 and (s.get("latestCheckpoint") or {}).get("step", 0) >= 4, 180)
    filler = _fill(small_disk)
    restarting = job_env.wait_phase("Restarting", 60)
    assert restarting["lastFailure"]["reason"] == "PodFailed", restarting["lastFailure"]
    complete_before = complete_steps(job_env)
    freed_at = time.time()
    filler.unlink()  # space freed
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    last = done["restarts"]["total"]
    report_recovery(job_env, "disk full (from the space freed)", freed_at, attempt=last)
    assert done["progress"]["step"] == 200 and job_env.max_gangs == 1
    for attempt in range(last):  # each one that failed, failed on the full disk
        failed = job_env.pod_log(attempt, 0) + job_env.pod_log(attempt, 1)
        errors = [line for line in failed.splitlines() if "Error" in line or "error" in line]
        assert "No space left on device" in failed, (attempt, job_env.event_messages(),
                                                     errors[-20:])
    resumed = resumed_from(job_env.pod_log(last, 0))
    assert resumed is not None and resumed >= max(complete_before), (resumed, complete_before)
    assert max(steps_logged(job_env.pod_log(0, 0))) - resumed <= interval
    assert all(e.complete for e in list_checkpoints(checkpoints(job_env), JOB))


def test_a_master_never_reachable_at_rendezvous_restarts_the_gang(job_env: Env) -> None:
    """The rank-0 pod is cut off the network as it starts (a broken ENI, a security group that
    drops the rendezvous port): no worker gets past rendezvous and none sends a first
    heartbeat. The startup timeout restarts the gang, whose new pods are reachable."""
    spec = tiny_spec(steps=20, heartbeat={"startupTimeoutSeconds": 20, "timeoutSeconds": "auto"})
    job_env.create(spec)
    master = f"{JOB}-a0-0"
    job_env.wait_process(master, 120)  # its network exists; its trainer is still importing
    uid = next(p.metadata.uid for p in job_env.pods() if p.metadata.name == master)
    fault_at = time.time()
    netns.set_pod_link(job_env.cluster.config.bridge, uid, up=False)
    restarting = job_env.wait_phase("Restarting", 120)
    failure = restarting["lastFailure"]
    assert failure["reason"] == "StartupTimeout", failure
    assert "no first heartbeat" in failure["message"], failure
    # the 20 s bound was for the faulted gang; a healthy one needs more where the machine is
    # loaded (two clusters' trainers importing torch at once took over 20 s to a first beat
    # and a second, false StartupTimeout): the operator judges by the spec as it is now
    job_env.patch_spec({"faultTolerance": {"heartbeat": {"startupTimeoutSeconds": 600}}})
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    assert done["restarts"]["total"] == 1 and done["progress"]["step"] == 20, done["restarts"]
    assert job_env.max_gangs == 1
    report_recovery(job_env, "master unreachable at rendezvous (20 s startup timeout)",
                    fault_at)
    assert not steps_logged(job_env.pod_log(0, 1)), "a worker trained without its master"


def _libfaketime() -> Path:
    import libfaketime

    found = list((Path(libfaketime.__file__).parent / "vendor").rglob("libfaketime.so.1"))
    assert found, "libfaketime (a dev dependency) ships its library in its wheel"
    return found[0]


def _clock_offset(job_env: Env, timeout: float = 60) -> tuple[float, float]:
    """How far rank 0's wall clock is off ours, bracketed: the time stamped on a step line
    that appeared while we watched, less our clock at the start and at the end of the watch.
    (The last line already there may be old: under load a synchronous save can hold a step
    for many seconds, and its age would read as skew.)"""
    def stamps() -> list[float]:
        return [row["time"] for row in metric_lines(job_env.pod_log(0, 0))]

    seen, before = len(stamps()), time.time()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = stamps()[seen:]
        if fresh:
            return fresh[-1] - time.time(), fresh[-1] - before
        time.sleep(0.2)
    raise AssertionError(f"rank 0 logged no step in {timeout:.0f}s")


@pytest.mark.parametrize("skew", [60, -60], ids=["ahead", "behind"])
def test_worker_clocks_a_minute_off_neither_cause_nor_hide_a_hang(job_env: Env, skew: int
                                                                  ) -> None:
    """Every process of the workers runs with its wall clock a minute off (libfaketime
    preloaded; monotonic clocks left alone, as NTP skew would): the heartbeats they stamp are
    a minute off. No hang is seen while they train, and a frozen worker is caught within its
    timeout, not a minute early or late."""
    timeout, interval = 6, 10
    # enough steps to train on past the watch and the freeze (alone: ~0.08 s a step)
    spec = tiny_spec(steps=800, heartbeat={"startupTimeoutSeconds": 120,
                                           "timeoutSeconds": timeout})
    spec["checkpoint"]["interval"] = interval
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "LD_PRELOAD", "value": str(_libfaketime())},
        {"name": "FAKETIME", "value": f"{skew:+d}s"},
        {"name": "DONT_FAKE_MONOTONIC", "value": "1"}]}]}}
    job_env.create(spec)
    job_env.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                 and (s.get("latestCheckpoint") or {}).get("step", 0) >= 10, 180)
    low, high = _clock_offset(job_env)
    assert low - 2 <= skew <= high + 2 and not low - 2 <= 0 <= high + 2, (
        f"the worker's clock is {low:+.0f}..{high:+.0f}s off, not {skew:+d}s")
    time.sleep(2 * timeout)  # training on: a skew taken at face value would have fired
    assert job_env.status()["phase"] == "Running" and "Restarting" not in job_env.phases()
    # frozen right after it reported a step, well before a save: its last beat says training,
    # so the steady timeout applies (a worker frozen in a save is given its saves' time, and
    # one CI run froze it there: detected after 29.6 s)
    after_a_fresh_beat(job_env, f"{JOB}-a0-1", interval,
                       lambda: faults.hang(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1"))
    fault_at = time.time() + skew  # on the workers' clock, which stamps the steps
    frozen = time.monotonic()
    restarting = job_env.wait_phase("Restarting", 60)
    detected = time.monotonic() - frozen
    assert restarting["lastFailure"]["reason"] == "HeartbeatTimeout", restarting["lastFailure"]
    # the timeout, give or take: the correction is as fine as the server's stamp (1 s), a
    # beat comes every period (2 s here: the last progress it carried may be 2 s older than
    # the freeze), the status is written every 2 s; the operator's pass is due right at the
    # deadline it computes. So as early as timeout - 3 s. A minute off shows.
    assert timeout - 3 <= detected <= timeout + 12, detected
    print(f"clock {skew:+d}s: hang detected {detected:.1f}s after the freeze")
    _wait_retraining(job_env)
    report_recovery(job_env, f"hang with worker clocks {skew:+d}s off (6 s timeout)", fault_at)


def test_a_worker_that_finished_but_never_exits_gets_the_gang_restarted(job_env: Env) -> None:
    """Every worker reports finished and the final checkpoint is complete, but the processes
    do not exit (stuck in teardown, here while a file exists): after the operator's
    `exit_after_finish_seconds` the gang is restarted; the new one resumes at the last step,
    has nothing to train, and exits: Succeeded."""
    linger = job_env.fsx / "linger"
    linger.touch()
    spec = tiny_spec(steps=20)
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "HLAT_FAULT_LINGER_WHILE_EXISTS", "value": "/fsx/linger"}]}]}}
    job_env.create(spec)
    restarting = job_env.wait_phase("Restarting", 180)
    failure = restarting["lastFailure"]
    assert failure["reason"] == "HeartbeatTimeout", failure
    assert "finished but still running" in failure["message"], failure
    linger.unlink()
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 180)
    assert done["restarts"]["total"] == 1 and done["progress"]["step"] == 20
    log = job_env.pod_log(1, 0)
    assert resumed_from(log) == 20 and not steps_logged(log), log[-1500:]
    assert job_env.max_gangs == 1
