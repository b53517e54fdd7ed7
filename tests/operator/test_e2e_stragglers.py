"""A fail-slow node end to end: one worker's trainer slowed on purpose (a SIGSTOP/SIGCONT duty
cycle, `faults.Slowdown`) while the gang trains; the operator must flag that node, and only
it, and clear the flag once it is fast again. Real operator, real trainers."""

from __future__ import annotations

import json
import statistics
import time

import pytest
from e2e_env import JOB, Env, attempt_log
from e2e_spec import tiny_spec
from kubernetes import client

from hlat_api import labels
from hlat_api.heartbeat import Heartbeat
from hlat_testbed import faults

# solo: make test runs these after the parallel suite, alone on the host. Under a second
# cluster's load the two cores' loads differ by a third for tens of seconds at a time
# (measured: the healthy node's compute 0.11-0.25 s, the slowed one's 0.18-0.31 s, the ratio
# 1.0-1.9 around a 30% pause): noise no real node, with its own cores, has
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.solo]

THRESHOLD, WINDOW = 0.2, 30.0
FLAG_WITHIN_SECONDS, FLAG_WITHIN_STEPS = 60.0, 50


def _spec(**fault_tolerance: object) -> dict[str, object]:
    """A model big enough that a step computes for tens of milliseconds on this CPU (the tiny
    one's few: a 20 ms pause cycle would hit only some of its steps), checkpoints rarer than
    the tiny spec's every 2 steps, restarted in place (the product's default)."""
    spec = tiny_spec(steps=3000, restartStrategy="InPlace", **fault_tolerance)
    spec["model"].update({"hiddenSize": 256, "layers": 4, "intermediateSize": 512})
    spec["train"].update({"globalBatch": 8, "microBatch": 4})
    spec["checkpoint"]["interval"] = 25
    return spec


def _step(status: dict[str, object]) -> int:
    progress = status.get("progress") or {}
    assert isinstance(progress, dict)
    return int(progress.get("step", 0))


def _beat(job_env: Env, attempt: int, rank: int) -> Heartbeat:
    lease = client.CoordinationV1Api(job_env.core.api_client).read_namespaced_lease(
        labels.worker_lease_name(JOB, attempt, rank), job_env.ns)
    beat = Heartbeat.from_annotations(lease.metadata.annotations)
    assert beat is not None and beat.compute_seconds and beat.sync_seconds is not None, beat
    return beat


class _Trace:
    """Both nodes' heartbeats while a test waits (printed: on a failure, the reason)."""

    def __init__(self, job_env: Env, attempt: int = 0) -> None:
        self.job_env, self.attempt, self.began = job_env, attempt, time.monotonic()
        self.last = 0.0

    def __call__(self, status: dict[str, object]) -> None:
        now = time.monotonic()
        if now - self.last < 2:
            return
        self.last = now
        try:
            beats = [_beat(self.job_env, self.attempt, rank) for rank in (0, 1)]
        except (AssertionError, client.ApiException):
            return
        print(f"[stragglers] t={now - self.began:5.1f}s step {_step(status)}: compute "
              + " ".join(f"{b.compute_seconds:.3f}" for b in beats) + "  sync "
              + " ".join(f"{b.sync_seconds:.3f}" for b in beats) + "  straggler badput "
              + str((status.get("goodput") or {}).get("badputSeconds", {}).get("straggler")))


def _straggler(status: dict[str, object]) -> dict[str, str]:
    conditions = status.get("conditions") or []
    assert isinstance(conditions, list)
    return next((c for c in conditions if c.get("type") == "Straggler"), {})


def test_a_node_slowed_by_30_percent_is_flagged_by_name_and_cleared_once_fast(job_env: Env
                                                                              ) -> None:
    """Healthy for a window first: no flag. Then node rank 1's trainer is paused 30% of the
    time: condition Straggler names its node with a slowdown over the threshold, a Warning
    event says so; once it runs freely again the condition turns False."""
    job_env.create(_spec(stragglers={"threshold": THRESHOLD, "windowSeconds": WINDOW}))
    job_env.wait("training", lambda s: any(c.get("type") == "Ready" and c["status"] == "True"
                                           for c in s.get("conditions") or []), 180)
    healthy_until = time.monotonic() + WINDOW + 10  # a whole window with no slowdown: no flag
    while time.monotonic() < healthy_until:
        status = job_env.status()
        assert _straggler(status).get("status") != "True", _straggler(status)
        assert status.get("phase") == "Running", status.get("conditions")
        time.sleep(1)
    victim = f"{JOB}-a0-1"
    node = job_env.core.read_namespaced_pod(victim, job_env.ns).spec.node_name
    with faults.Slowdown(job_env.cluster.config, job_env.ns, victim, fraction=0.3,
                         apart=[f"{JOB}-a0-0"]):
        began, first, trace = time.monotonic(), _step(job_env.status()), _Trace(job_env)
        flagged = job_env.wait("Straggler=True", lambda s: trace(s) or _straggler(s).get(
            "status") == "True", WINDOW + 90)
        latency, steps = time.monotonic() - began, _step(flagged) - first
        slow, healthy = _beat(job_env, 0, 1), _beat(job_env, 0, 0)
    # where the time goes, per node: the slow one computes longer, the healthy one waits for it
    # in the gradient sync
    print(f"[stragglers] heartbeats: slow node compute {slow.compute_seconds:.3f}s sync "
          f"{slow.sync_seconds:.3f}s, healthy node compute {healthy.compute_seconds:.3f}s sync "
          f"{healthy.sync_seconds:.3f}s")
    assert slow.compute_seconds > healthy.compute_seconds
    assert slow.sync_seconds < healthy.sync_seconds
    message = _straggler(flagged)["message"]
    print(f"[stragglers] 30% slowdown flagged {latency:.0f}s and {steps} steps after it began "
          f"(window {WINDOW:.0f}s): {message}")
    # the bound: within 60 s or 50 steps, whichever is later
    assert latency <= FLAG_WITHIN_SECONDS or steps <= FLAG_WITHIN_STEPS, (latency, steps)
    assert message.startswith(f"node {node} takes "), message
    ratio = float(message.split(" takes ", 1)[1].split("x", 1)[0])
    assert ratio > 1 + THRESHOLD, message
    assert ("Straggler", message) in job_env.event_messages()
    cleared = job_env.wait("Straggler=False", lambda s: _straggler(s).get("status") == "False",
                           90)
    assert _straggler(cleared)["reason"] == "NoStraggler"
    assert cleared["restarts"]["total"] == 0  # a slow node is not a fault
    job_env.delete()


def _median_step_seconds(job_env: Env, pod: str, attempt: int, after_step: int, steps: int
                         ) -> float:
    """The median step time of rank 0's next `steps` logged steps after `after_step`."""
    def logged() -> list[float]:
        log = attempt_log(job_env.cluster.pod_log(job_env.ns, pod), attempt)
        return [float(d["stepSeconds"]) for d in map(json.loads, (
            line for line in log.splitlines() if line.startswith("{") and '"stepSeconds"' in line))
            if d["step"] > after_step][:steps]
    job_env.wait(f"{steps} steps logged after step {after_step}",
                 lambda _: len(logged()) >= steps, 120)
    return statistics.median(logged())


def test_replace_moves_a_slow_node_s_rank_to_the_warm_spare(job_env: Env) -> None:
    """action Replace, one warm spare: node rank 1's trainer slowed by 30% is flagged, and at
    the next checkpoint its rank moves to the spare (an in-place restart using no budget, the
    node avoided); the condition clears (the new gang's nodes compute within the threshold). Its step time against the healthy baseline is printed, not asserted: on this VM
    identical runs differ by up to a quarter (bench_stragglers' Replace rounds measure it)."""
    job_env.create(_spec(spareNodes=1, stragglers={
        "action": "Replace", "threshold": THRESHOLD, "windowSeconds": WINDOW}))
    job_env.wait("the spare ready", lambda s: (s.get("spares") or {}).get("ready") == 1,
                 180)
    lead = f"{JOB}-a0-0"
    faults.wait_standbys_idle()
    healthy = _median_step_seconds(job_env, lead, 0, _step(job_env.status()), 30)
    victim = f"{JOB}-a0-1"
    node = job_env.core.read_namespaced_pod(victim, job_env.ns).spec.node_name
    with faults.Slowdown(job_env.cluster.config, job_env.ns, victim, fraction=0.3,
                         apart=[f"{JOB}-a0-0"]):
        began, trace = time.monotonic(), _Trace(job_env)
        moved = job_env.wait("the move", lambda s: trace(s) or s.get("attempt", 0) >= 1,
                             WINDOW + 120)
        latency = time.monotonic() - began
    failure = moved["lastFailure"]
    assert failure["reason"] == "Straggler" and failure["node"] == node, failure
    assert moved["restarts"]["counted"] == 0
    assert node in [a["node"] for a in moved["avoidedNodes"]]
    # measured as the baseline was: the gang training, a new warm spare started and idle
    job_env.wait("attempt 1 trains beside a ready spare", lambda s: s.get(
        "attempt") == 1 and (s.get("spares") or {}).get("ready") == 1 and any(
        c.get("type") == "Ready" and c["status"] == "True" for c in s.get("conditions") or []),
        180)
    spare = job_env.core.read_namespaced_pod(f"{JOB}-s0", job_env.ns)
    assert spare.metadata.labels["hlat.dev/node-rank"] == "1" and spare.spec.node_name != node
    # and the new attempt's warm standbys (one per pod, importing torch for the next restart)
    # idle again, as they were before: on the rig they share the workers' two cores
    faults.wait_standbys_idle()
    after = _median_step_seconds(job_env, lead, 1, _step(job_env.status()), 30)
    print(f"[stragglers] Replace: moved {latency:.0f}s after the slowdown began; median step "
          f"time healthy {healthy:.3f}s, after the move {after:.3f}s "
          f"({after / healthy:.2f}x; {failure['message']})")
    # no straggler left: the new gang's nodes compute within the threshold of each other
    cleared = job_env.wait("Straggler=False", lambda s: _straggler(s).get("status") == "False",
                           60)
    assert _straggler(cleared)["reason"] == "NoStraggler"
    status = job_env.status()
    assert status["restarts"]["total"] == 1 and status["restarts"]["counted"] == 0
    job_env.delete()
