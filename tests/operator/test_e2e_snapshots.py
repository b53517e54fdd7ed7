"""In-memory snapshots end to end (checkpoint.memoryInterval, restarts in place): the launchers
keep each pod's snapshots in its /dev/shm across trainer crashes, and a copy of them in the next
node's (checkpoint.memoryReplicas). A trainer SIGKILLed between durable checkpoints resumes from
memory, losing at most one step; a pod deleted takes its memory with it, and its new pod fetches
its rank's snapshots back from its peer's copy, so every rank resumes from memory again with no
checkpoint read; without copies (memoryReplicas 0) every rank resumes from the durable
checkpoint. Either way the steps trained again repeat the first attempt's losses bit for bit,
and status counts what was lost and where the restart's load came from (goodput's memoryRestore
vs restore)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import pytest
from e2e_env import JOB, Env, TrainerCensus, attempt_log, losses
from e2e_spec import tiny_spec

from hlat_api.heartbeat import REPLICA_PORT
from hlat_testbed import faults
from hlat_testbed.podfiles import container_pid
from hlat_testbed.testing import wait_for
from hlat_trainer import replica

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

DURABLE_EVERY = 25
COPY_EVERY = 4
"""memoryInterval of the tests that restore from a peer's copy. A copy is pushed after its
snapshot is written, so it must land within a snapshot interval for the ranks to meet at a
step (the documented rule: memoryInterval x the step time above a copy's time). The rig's
steps take 0.09 s and a copy 0.03 s when idle; with two clusters on two cores a copy took
longer than a step (a run of the spare test every step resumed from storage). Every 4 steps
keeps to the rule under that load."""


def _run(job_env: Env, fault: str, steps: int = 60, replicas: int = 1, every: int = 1,
         durable: int = DURABLE_EVERY) -> tuple[dict[str, Any], int, str]:
    """Train 60 steps, snapshots every step, durable every 25; `fault` (kill: rank 1's
    trainer; delete: rank 1's trainer frozen, then its pod deleted) once the status shows a
    step at least 8 past step_25. Returns
    the final status, the durable checkpoint the fault came after, and rank 0's log (both
    attempts: its pod is kept)."""
    spec = tiny_spec(steps=steps, restartStrategy="InPlace")
    spec["checkpoint"].update({"interval": durable, "memoryInterval": every,
                               "memoryReplicas": replicas})
    job_env.create(spec)
    pod0, pod1 = f"{JOB}-a0-0", f"{JOB}-a0-1"
    with TrainerCensus(job_env) as census:
        job_env.wait("a step past the durable checkpoint", lambda s: (
            ((s.get("latestCheckpoint") or {}).get("step", 0) >= DURABLE_EVERY
             or durable > steps)  # none before the end: the snapshots alone
            and (s.get("progress") or {}).get("step", 0) >= DURABLE_EVERY + 8), 240)
        if fault == "kill":
            faults.kill_trainer(job_env.cluster.config, job_env.ns, pod1)
        else:  # frozen first: a deletion takes seconds to reach the trainer, and the gang
            # would train on meanwhile, past the next durable checkpoint (a CI run did)
            faults.hang_trainer(job_env.cluster.config, job_env.ns, pod1)
            job_env.core.delete_namespaced_pod(pod1, job_env.ns)
        done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    assert census.most == 1, census.worst
    assert done["restarts"]["inPlace"] == 1 and done["attempt"] == 1, done["restarts"]
    log = job_env.cluster.pod_log(job_env.ns, pod0)
    seen = losses(log)
    assert max(seen) == steps
    for step, values in seen.items():  # trained again: the same numbers
        assert all(v == values[0] for v in values), (step, values)
    return done, DURABLE_EVERY, log


def test_a_killed_trainer_resumes_from_its_pod_s_memory_losing_at_most_one_step(
        job_env: Env) -> None:
    # 200 steps, not 60: the status that says step 33 lags the trainers by seconds, and a CI
    # run's kill landed after the last step (its line never written, the resumed attempt had
    # nothing left to train)
    done, durable, log = _run(job_env, "kill", steps=200)
    later = attempt_log(log, 1)
    resumed = re.search(r"resumed from in-memory snapshot step_(\d+)", later)
    assert resumed, later[-3000:]
    step, logged = int(resumed.group(1)), max(losses(log[:log.index(later)]))
    # a step's snapshot is written before its line: a kill between the two (the line's
    # all-reduce fails) leaves a snapshot of a step the log never showed (a CI run: 54 vs 53)
    trained = max(logged, step)
    assert step > durable and trained - step <= 1, (step, logged)
    assert done["lostSteps"] <= trained - step, done["lostSteps"]
    badput = done["goodput"]["badputSeconds"]  # the restart loaded memory, not storage
    assert badput["memoryRestore"] > 0 and badput["snapshot"] > 0, badput
    assert badput["restore"] == 0, badput  # a fresh start looked for none: startup


def test_a_deleted_pod_s_rank_fetches_its_snapshots_back_from_its_peer_s_copy(
        job_env: Env) -> None:
    """The new pod's launcher fetches rank 1's snapshots from node 0's copy before its trainer
    starts; both ranks then resume from the newest step they both hold (the copy may be one
    snapshot behind): from memory, nothing read from the checkpoint volume."""
    # no durable checkpoint before the end (as the spare test: a newer one is rightly chosen)
    done, durable, log = _run(job_env, "delete", steps=160, every=COPY_EVERY, durable=1000)
    later = attempt_log(log, 1)
    resumed = re.search(r"resumed from in-memory snapshot step_(\d+)", later)
    assert resumed, later[-3000:]
    step, trained = int(resumed.group(1)), max(losses(log[:log.index(later)]))
    assert step > durable and trained - step < 2 * COPY_EVERY, (step, trained)
    new_pod = next(p for p in job_env.core.list_namespaced_pod(job_env.ns).items
                   if p.metadata.labels.get("hlat.dev/node-rank") == "1"
                   and p.metadata.name != f"{JOB}-a0-1")
    fetched = job_env.cluster.pod_log(job_env.ns, new_pod.metadata.name)
    assert re.search(r"snapshot replicas: fetched rank 1 step \d+ from", fetched), fetched[-3000:]
    badput = done["goodput"]["badputSeconds"]
    assert badput["memoryRestore"] > 0 and badput["restore"] == 0, badput


def test_without_copies_a_deleted_pod_takes_its_memory_and_every_rank_resumes_from_the_durable_checkpoint(
        job_env: Env) -> None:
    """memoryReplicas 0: the new pod holds no snapshot, so every rank resumes from a durable
    checkpoint (which one depends on how far the gang trained before the status showed step 33
    and the freeze landed: 160 steps leave room for it to land mid-run); lostSteps, counted
    from the snapshot at the restart, is corrected to no more than the steps since that
    checkpoint (the correction itself: test_reconcile_snapshots)."""
    done, durable, log = _run(job_env, "delete", steps=160, replicas=0)
    later = attempt_log(log, 1)
    resumed = re.search(r"resumed from checkpoint step_(\d+)", later)
    assert resumed and "in-memory snapshot" not in later, later[-3000:]
    step = int(resumed.group(1))
    assert step % durable == 0 and step >= durable, step
    # the checkpoint proves its step trained: that step's line comes after its save, and a
    # CI run deleted the pod between the two (step_50 resumed, step 49 the last line)
    trained = max(max(losses(log[:log.index(later)])), step)
    assert 0 <= done["lostSteps"] <= trained - step, (done["lostSteps"], trained, step)
    badput = done["goodput"]["badputSeconds"]
    assert badput["memoryRestore"] == 0 and badput["restore"] > 0, badput


def test_a_lost_node_s_spare_fetches_its_rank_s_snapshots_from_the_peer_s_copy(
        job_env: Env) -> None:
    """spareNodes 1, snapshots and their copies every COPY_EVERY steps: rank 1's node goes down
    (kubelet and processes stopped), its peer reports it, the warm spare takes rank 1 and its
    launcher fetches rank 1's snapshots from node 0's copy before its trainer starts. Both ranks
    resume from memory, from the newest snapshot or the one before (the copy may lag one): no
    checkpoint is loaded from the volume (the engine lists it for its newest step, and reads
    nothing of it). One step lost with snapshots every step: bench_recovery's
    node-down:InPlace+spare+memory."""
    spec = tiny_spec(steps=160, restartStrategy="InPlace", spareNodes=1, heartbeat={
        "startupTimeoutSeconds": 120, "timeoutSeconds": 60})  # the node is found lost first
    # no durable checkpoint before the end: one newer than the fault's snapshot would rightly
    # be chosen over it (a CI run: the fault landed at step 50-52, between step_50's save and
    # the copy of step 52)
    spec["checkpoint"].update({"interval": 1000, "memoryInterval": COPY_EVERY})
    job_env.create(spec)
    node = ""
    try:
        with TrainerCensus(job_env) as census:
            job_env.wait("a few snapshots, and a ready spare", lambda s: (
                (s.get("progress") or {}).get("step", 0) >= 5 * COPY_EVERY
                and (s.get("spares") or {}).get("ready") == 1), 240)
            node = job_env.core.read_namespaced_pod(f"{JOB}-a0-1", job_env.ns).spec.node_name
            faults.node_down(job_env.cluster.config, node)
            done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    finally:
        if node:
            faults.node_up(job_env.cluster.config, node)
    assert census.most == 1, census.worst
    assert done["spares"]["promoted"] == 1 and done["lastFailure"]["reason"] == "NodeLost", done
    log, spare = (job_env.cluster.pod_log(job_env.ns, f"{JOB}-{p}") for p in ("a0-0", "s0"))
    assert re.search(r"snapshot replicas: fetched rank 1 step \d+ from", spare), spare[-3000:]
    later = attempt_log(log, 1)
    resumed = re.search(r"resumed from in-memory snapshot step_(\d+)", later)
    assert resumed, later[-3000:]
    step, trained = int(resumed.group(1)), max(losses(log[:log.index(later)]))
    assert step >= COPY_EVERY and trained - step < 2 * COPY_EVERY, (step, trained)
    assert f"resumed from in-memory snapshot step_{step}" in spare, spare[-3000:]
    assert "resumed from checkpoint" not in later + spare
    seen = losses(log)
    assert max(seen) == 160
    for at, values in seen.items():  # trained again: the same numbers
        assert all(v == values[0] for v in values), (at, values)
    badput = done["goodput"]["badputSeconds"]
    assert badput["memoryRestore"] > 0 and badput["restore"] == 0, badput


TORN_COPY_EVERY = 40
"""memoryInterval of the torn-copy test: 40 steps take 3.6 s or more on the rig, longer than
the 2 s a copy is slowed to, so each copy lands before the next snapshot is written."""


def _snapshot_root(env: Env, pod: str) -> Path:
    """The pod's snapshot directory (HLAT_SNAPSHOT_DIR, from its trainer's environment), as
    seen from here: through its launcher's root (/dev/shm is the pod's own, in the container's
    mount namespace)."""
    def root() -> str | None:
        for pid in faults.trainer_pids(env.cluster.config, env.ns, pod):
            with contextlib.suppress(OSError):
                for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    if item.startswith(b"HLAT_SNAPSHOT_DIR="):
                        return item.split(b"=", 1)[1].decode()
        return None
    inside = wait_for(root, 60, f"{pod}'s trainer and its snapshot directory")
    launcher = container_pid(env.cluster.config, env.ns, pod)
    return Path(f"/proc/{launcher}/root") / inside.lstrip("/")


def test_a_node_lost_mid_copy_leaves_its_peer_whole_copies_only_and_the_spare_resumes_from_the_last(
        job_env: Env) -> None:
    """Rank 1's copies to node 0 slowed to 2 s each (a kernel shaper on its pod's traffic to
    the replica port); its node goes down while node 0 is partway through the copy of step M.
    Node 0 then holds a torn copy of M (a temporary file) and whole ones of M - 40 and before;
    the spare fetches only the whole ones, and both ranks resume from M - 40, the newest step
    each holds whole (rank 0 its own M - 40, rank 1 the copy), never from the torn M; the steps
    trained again repeat the first attempt's losses."""
    steps = 6 * TORN_COPY_EVERY
    spec = tiny_spec(steps=steps, restartStrategy="InPlace", spareNodes=1, heartbeat={
        "startupTimeoutSeconds": 120, "timeoutSeconds": 60})  # the node is found lost first
    spec["checkpoint"].update({"interval": 1000, "memoryInterval": TORN_COPY_EVERY})
    job_env.create(spec)
    pod0, pod1 = f"{JOB}-a0-0", f"{JOB}-a0-1"
    config = job_env.cluster.config
    node, torn = "", -1
    try:
        with TrainerCensus(job_env) as census:
            job_env.wait("a ready spare", lambda s: (s.get("spares") or {}).get("ready") == 1
                         and s.get("phase") == "Running", 240)
            own = replica.own_dir(_snapshot_root(job_env, pod1), JOB, 1)
            held = replica.replica_dir(_snapshot_root(job_env, pod0), JOB, 1)
            first = wait_for(lambda: sorted(own.glob("step_*.pt")), 120,
                             f"rank 1's first snapshot in {own}")
            size = first[0].stat().st_size
            faults.slow_port(config, job_env.ns, pod1, REPLICA_PORT, max(size // 2, 1))

            def mid_copy() -> int | None:
                """Step M while node 0 has part of M's copy and all of M - 40's."""
                for partial in held.glob("step_*.tmp"):
                    step = int(partial.name.split(".")[0].removeprefix("step_"))
                    with contextlib.suppress(FileNotFoundError):
                        if (partial.stat().st_size > 0 and step > TORN_COPY_EVERY and
                                (held / f"step_{step - TORN_COPY_EVERY}.pt").exists()):
                            return step
                return None
            torn = wait_for(mid_copy, 180, f"a copy of rank 1 in progress in {held}",
                            interval=0.02)
            node = job_env.core.read_namespaced_pod(pod1, job_env.ns).spec.node_name
            faults.node_down(config, node)
            with contextlib.suppress(FileNotFoundError):  # a whole copy is as big as the file
                landed = (held / f"step_{torn}.pt").stat().st_size
                assert landed != size, "the copy completed before the fault"
            done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    finally:
        if node:
            faults.node_up(config, node)
        with contextlib.suppress(Exception):
            faults.unslow(config, job_env.ns, pod1)
    assert census.most == 1, census.worst
    assert done["spares"]["promoted"] == 1 and done["lastFailure"]["reason"] == "NodeLost", done
    log, spare = (job_env.cluster.pod_log(job_env.ns, f"{JOB}-{p}") for p in ("a0-0", "s0"))
    whole = torn - TORN_COPY_EVERY
    print(f"node 1 lost mid-copy of rank 1 step {torn} ({size} bytes a copy, slowed to 2 s)")
    # the holder gave the cut copy up (its connection fell silent) and kept the whole ones
    wait_for(lambda: "snapshot replicas: a request failed" in job_env.cluster.pod_log(
        job_env.ns, pod0), 30, "node 0's launcher to give the cut copy up")
    fetched = re.search(r"snapshot replicas: fetched rank 1 step (\d+) from", spare)
    assert fetched and int(fetched.group(1)) == whole, (torn, spare[-3000:])
    later = attempt_log(log, 1)
    assert f"resumed from in-memory snapshot step_{whole}" in later, (torn, later[-3000:])
    assert f"resumed from in-memory snapshot step_{whole}" in spare, (torn, spare[-3000:])
    seen = losses(log)
    assert max(seen) == steps and len(seen[torn]) == 2, (torn, sorted(seen)[-3:])
    for at, values in seen.items():  # trained again: the same numbers
        assert all(v == values[0] for v in values), (at, values)
    badput = done["goodput"]["badputSeconds"]
    assert badput["memoryRestore"] > 0 and badput["restore"] == 0, badput
