"""Goodput end to end: what `status.goodput` says against what the trainers' logs show.

A 2-node CPU job with asynchronous checkpoints whose writes take 2 s (so saves block and the
final write is waited for), a worker SIGKILLed mid-run, trained to the end. The test is the
oracle, built from what it can see without the operator's help: each trainer's per-step JSON
lines (wall time, step time, data wait, checkpoint blocking; which steps an earlier attempt
had logged), the trainer's own log lines, and its own stopwatch on the job's status (polled
every 0.2 s): when it first showed each phase and each attempt. Kubernetes timestamps have a
resolution of 1 s, so the stopwatch is used instead where a cause starts or ends at a gang's
creation. A gang is created in the pass that writes its attempt to the status, with that write
first and the pods last (after the service, the config map, the RBAC objects, the budget and
the leases): the operator's clock for the attempt starts at that pass, so the stopwatch starts
it where the status first shows the attempt, not where it first sees a pod. Under load those
writes take seconds, which the pod's sighting would move from pending to nothing (wall too short).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from e2e_env import JOB, Env, after_a_fresh_beat, attempt_log, metric_lines
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed import faults

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

OPERATOR_ENV = {
    "HLAT_OPERATOR_HEARTBEAT_PERIOD_SECONDS": "1",
    "HLAT_OPERATOR_STATUS_INTERVAL_SECONDS": "1",
}
WRITE_DELAY = 2.0


class Stopwatch:
    """When this test first saw each phase of the job and each attempt (wall clock)."""

    def __init__(self, env: Env) -> None:
        self.env, self.attempts, self.phases = env, {}, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        custom = self.env.custom
        while not self._stop.is_set():
            now = time.time()
            try:
                job = custom.get_namespaced_custom_object("hlat.dev", "v1alpha1", self.env.ns,
                                                          "pretrainjobs", self.env.name)
            except ApiException:  # not created yet
                job = {}
            status = job.get("status") or {}
            if status.get("startTime"):  # the first gang's pass wrote it (attempt 0 or later)
                self.attempts.setdefault(status.get("attempt", 0), now)
            phase = status.get("phase")
            if phase and (not self.phases or self.phases[-1][0] != phase):
                self.phases.append((phase, now))
            self._stop.wait(0.2)

    def __enter__(self) -> Stopwatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def first(self, phase: str) -> float:
        return next(t for p, t in self.phases if p == phase)


def steps_done(env: Env, pod: str) -> int:
    """The HLAT_STEPS_DONE the operator gave a pod."""
    spec = client.CoreV1Api(env.cluster.admin_api()).read_namespaced_pod(pod, env.ns).spec
    trainer = next(c for c in spec.containers if c.name == "trainer")
    return int(next(e.value for e in trainer.env if e.name == "HLAT_STEPS_DONE"))


def records(log: str) -> list[dict[str, Any]]:
    return metric_lines(log)


def logged_at(log: str, pattern: str) -> float:
    """Wall time of the trainer's first log line matching `pattern` (its asctime, ms)."""
    m = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*" + pattern, log, re.M)
    assert m, f"no log line matching {pattern!r}"
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def kill_after_a_fresh_beat(env: Env, pod: str, interval: int) -> None:
    """SIGKILL `pod` right after rank 0's Lease carried a new step well inside a checkpoint
    interval: the steps trained since the last report a dead worker never sent are at most
    what fits in the poll (a heartbeat period is the bound the accounting documents), and rank
    0's last report is of a step, not of a save in progress. A report made during step N's
    save counts step N (its line is not written yet) but not the save: the logs, which this
    oracle reads, cannot tell how much of that save was reported."""
    after_a_fresh_beat(env, f"{JOB}-a0-0", interval,
                       lambda: faults.kill(env.cluster.config, env.ns, pod))


@pytest.fixture
def stopwatch(job_env: Env) -> Iterator[Stopwatch]:
    with Stopwatch(job_env) as watch:
        yield watch


def _training(job_env: Env, strategy: str) -> int:
    """Create the job and wait for its first checkpoint; returns the interval. Checkpoints
    every 40 steps (1 to 2 s of training here): writes of 2 s still make the next save wait,
    and rank 0 reports from inside an interval often enough to kill after a fresh beat. (At 20
    steps, 0.5 s of training on an idle machine, against 1.5 s blocked in each save: rank 0's
    renewals, one a second, missed every training window of a run.)"""
    spec = tiny_spec(steps=200, restartStrategy=strategy)
    spec["checkpoint"].update({"async": True, "interval": 40})
    spec["train"]["logInterval"] = 1
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "HLAT_FAULT_CHECKPOINT_WRITE_DELAY_SECONDS", "value": str(WRITE_DELAY)}]}]}}
    job_env.create(spec)
    job_env.wait("the first checkpoint", lambda s: s.get("phase") == "Running"
                 and (s.get("latestCheckpoint") or {}).get("step", 0) >= 40, 180)
    return int(spec["checkpoint"]["interval"])


def test_goodput_in_status_matches_the_trainers_logs(job_env: Env, stopwatch: Stopwatch
                                                     ) -> None:
    kill_after_a_fresh_beat(job_env, f"{JOB}-a0-1", _training(job_env, "RecreateGang"))
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    time.sleep(0.5)  # the stopwatch's last poll
    assert done["attempt"] == 1 and done["restarts"]["total"] == 1
    g, b = done["goodput"], done["goodput"]["badputSeconds"]
    first, second = records(job_env.pod_log(0, 0)), records(job_env.pod_log(1, 0))
    log0, log1 = job_env.pod_log(0, 0), job_env.pod_log(1, 0)
    # the steps the operator knew were done when it created the second gang (the last step a
    # heartbeat of the first reported): steps the first gang trained after that report died
    # with it unreported (detection), and the second gang trains them as new work
    done_before = steps_done(job_env, f"{JOB}-a1-0")
    assert done_before <= max(r["step"] for r in first)
    reported = [r for r in first if r["step"] <= done_before]

    # each step's time less its data wait (the JSON line's stepSeconds excludes saves)
    def work(rs: list[dict[str, Any]]) -> float:
        return sum(r["stepSeconds"] - r["dataWaitSeconds"] for r in rs)

    productive = work(reported) + work([r for r in second if r["step"] > done_before])
    recompute = work([r for r in second if r["step"] <= done_before])
    checkpoint = sum(r.get("checkpointBlockingSeconds", 0.0) for r in reported + second)
    data_wait = sum(r["dataWaitSeconds"] for r in reported + second)
    created = [stopwatch.attempts[a] for a in (0, 1)]  # the passes that created the gangs
    wall = stopwatch.first("Succeeded") - created[0]
    restarting = stopwatch.first("Restarting")
    detection = restarting - reported[-1]["time"]
    between = created[1] - restarting  # teardown + backoff
    # pending + startup + restore: gang created -> the first step began (its line's time less
    # its step time)
    before_steps = sum(rs[0]["time"] - rs[0]["stepSeconds"] - c
                       for rs, c in ((first, created[0]), (second, created[1])))
    finished = logged_at(log1, "finished at step")
    final_wait = finished - second[-1]["time"]
    exit_seen = stopwatch.first("Succeeded") - finished  # processes exit, the operator sees it

    shown = {
        "ratio": (g["ratio"], productive / wall),
        "wall": (g["wallSeconds"], wall),
        "productive": (g["productiveSeconds"], productive),
        "recompute": (b["recompute"], recompute),
        "checkpoint": (b["checkpoint"], checkpoint),
        "dataWait": (b["dataWait"], data_wait),
        "detection": (b["detection"], detection),
        "teardown+backoff": (b["teardown"] + b["backoff"], between),
        "pending+startup+restore+compile": (
            b["pending"] + b["startup"] + b["restore"] + b["compile"], before_steps),
        "finalCheckpoint": (b["finalCheckpoint"], final_wait),
        "other": (b["other"], exit_seen),
    }
    print(json.dumps({"shown": shown, "goodput": g}))  # status vs logs, in the output
    assert g["ratio"] == pytest.approx(productive / wall, rel=0.02), shown
    for cause, (status, logs) in shown.items():
        if cause != "ratio":
            assert abs(status - logs) <= 2.0, (cause, shown)
    # what the logs show happened, happened: the kill cost work, the saves blocked, the final
    # write was waited for, and nothing is left unexplained
    assert recompute > 0 and b["recompute"] > 0 and b["detection"] > 0
    assert b["finalCheckpoint"] >= WRITE_DELAY - 0.5 and b["checkpoint"] > 0
    assert b["unreported"] == 0
    assert g["lostWorkSeconds"] > 0
    total = g["productiveSeconds"] + sum(b.values())
    assert total == pytest.approx(g["wallSeconds"], abs=0.05)
    assert log0 and resumed(log1)


def resumed(log: str) -> bool:
    return "resumed from checkpoint step_" in log


def test_goodput_after_an_in_place_restart_matches_the_trainers_logs(job_env: Env) -> None:
    """The same oracle for the product's default restart, InPlace: node rank 1's container
    SIGKILLed (the pod fails and only it is replaced; rank 0's trainer restarts in place). Rank
    0's pod is kept: its one log holds both attempts, and each JSON line says whether its step
    was work done again (`recomputed`). Productive time, the work done again, the saves and the
    data wait in status are the logs' figures."""
    interval = _training(job_env, "InPlace")
    config = job_env.cluster.config
    after_a_fresh_beat(job_env, f"{JOB}-a0-0", interval,
                       lambda: faults.kill(config, job_env.ns, f"{JOB}-a0-1"))
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    assert done["attempt"] == 1 and done["restarts"]["inPlace"] == 1, done["restarts"]
    g, b = done["goodput"], done["goodput"]["badputSeconds"]
    log = job_env.pod_log(0, 0)
    later = attempt_log(log, 1)
    assert later, "rank 0's pod holds no second attempt"
    first, second = records(log[:log.index(later)]), records(later)
    done_before = max((r["step"] for r in second if r["recomputed"]),
                      default=second[0]["step"] - 1)
    reported = [r for r in first if r["step"] <= done_before]

    def work(rs: list[dict[str, Any]]) -> float:
        return sum(r["stepSeconds"] - r["dataWaitSeconds"] for r in rs)

    productive = work(reported) + work([r for r in second if r["step"] > done_before])
    shown = {
        "productive": (g["productiveSeconds"], productive),
        "recompute": (b["recompute"], work([r for r in second if r["step"] <= done_before])),
        "checkpoint": (b["checkpoint"], sum(r.get("checkpointBlockingSeconds", 0.0)
                                            for r in reported + second)),
        "dataWait": (b["dataWait"], sum(r["dataWaitSeconds"] for r in reported + second)),
    }
    print(json.dumps({"shown": shown, "goodput": g}))
    for cause, (status, logs) in shown.items():
        assert abs(status - logs) <= 2.0, (cause, shown)
    assert b["unreported"] == 0
    assert g["productiveSeconds"] + sum(b.values()) == pytest.approx(g["wallSeconds"], abs=0.05)
