"""The operator end to end: the real local control plane, the real operator process, real
trainer processes (torchrun, 2 nodes on CPU) on a shared PVC.

One operator subprocess per module (`python -m hlat_operator.cli`, the rig's operator
credentials); each test has its own namespace and PVC directory. Scenarios are tiny (a few
steps of a 2-layer model, checkpoint every 2 steps, 1 s backoff) so the module stays fast.
"""

from __future__ import annotations

import time

import pytest
from e2e_env import JOB, Env, resumed_from, steps_logged
from e2e_spec import tiny_spec

from hlat_testbed import faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import OperatorProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]



# --- scenarios -----------------------------------------------------------------------------


def test_apply_runs_to_succeeded_and_uptime_matches_a_stopwatch(job_env: Env) -> None:
    job_env.create(tiny_spec(steps=6))
    job_env.wait_phase("Running", 60)
    done = job_env.wait("Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), 240)
    stop = job_env.transitions[-1][1]
    assert done["phase"] == "Succeeded", done.get("conditions")
    assert job_env.phases()[-2:] == ["Running", "Succeeded"]
    assert done["progress"]["step"] == 6
    assert done["restarts"]["total"] == 0
    assert done["latestCheckpoint"]["step"] == 6
    assert done["completionTime"] and done["startTime"]
    assert steps_logged(job_env.pod_log(0, 0))[-1] == 6  # node rank 0 logs the metrics
    # uptime: what the status says vs what this test saw (poll 0.25 s, status writes 2 s)
    watched = job_env.stopwatch_running(stop)
    running = done["uptime"]["runningSeconds"]
    assert abs(running - watched) <= 3 + 0.05 * watched, (running, watched)
    assert done["uptime"]["downSeconds"] == 0 and done["uptime"]["ratio"] == 1.0
    assert {"Created", "Running", "Completed"} <= set(job_env.events())
    assert job_env.max_gangs == 1


def test_a_sigkilled_worker_restarts_the_gang_from_the_last_checkpoint(job_env: Env) -> None:
    job_env.create(tiny_spec(steps=40))
    # timed by the trainer's log, not by the status (see `wait_saved`); frozen before the
    # kill, rank 1 holds rank 0 at its next collective
    job_env.wait_saved(4)
    faults.hang(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1")
    faults.kill(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1")
    fault_at = time.monotonic()
    restarting = job_env.wait_phase("Restarting", 30)
    assert restarting["lastFailure"]["reason"] == "Killed"
    assert restarting["lastFailure"]["exitCode"] == 137
    assert restarting["lastFailure"]["pod"] == f"{JOB}-a0-1"
    job_env.wait("attempt 1 running", lambda s: s.get("attempt") == 1
                 and s.get("phase") == "Running", 90)
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    recovered = time.monotonic() - fault_at
    assert done["progress"]["step"] == 40
    assert done["restarts"] == {"total": 1, "counted": 1}
    assert job_env.phases().count("Restarting") <= 1  # polled: a short one can pass unseen
    # step continuity: the resumed trainer starts right after a complete checkpoint, one
    # that existed when the worker was killed or later (never before the first one seen)
    log = job_env.pod_log(1, 0)
    ckpt = resumed_from(log)
    assert ckpt is not None and ckpt >= 2 and ckpt % 2 == 0, log[-2000:]
    assert steps_logged(log)[0] == ckpt + 1
    assert steps_logged(log)[-1] == 40
    up = done["uptime"]
    assert up["downSeconds"] > 0 and 0 < up["ratio"] < 1
    assert up["downSeconds"] < recovered
    assert {"Killed", "Created", "Completed"} <= set(job_env.events())
    assert job_env.max_gangs == 1


def test_a_slow_asynchronous_write_is_not_taken_for_a_hang(job_env: Env) -> None:
    """Every asynchronous write takes 8 s, twice the steady timeout: the save waiting for the
    previous write and the final write after the last step report `checkpointing`, so the
    finished job is not restarted (it was: the final write sent no phase)."""
    spec = tiny_spec(steps=6, heartbeat={"startupTimeoutSeconds": 120, "timeoutSeconds": 4})
    spec["checkpoint"].update({"async": True, "interval": 3})
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "HLAT_FAULT_CHECKPOINT_WRITE_DELAY_SECONDS", "value": "8"}]}]}}
    job_env.create(spec)
    done = job_env.wait("finished", lambda s: s.get("phase") in ("Succeeded", "Failed")
                        or s.get("restarts", {}).get("total", 0) > 0, 240)
    assert done["restarts"]["total"] == 0, done.get("lastFailure")
    assert done["phase"] == "Succeeded" and done["latestCheckpoint"]["step"] == 6


def test_a_hung_worker_is_detected_within_the_steady_timeout(job_env: Env) -> None:
    timeout = 8
    job_env.create(tiny_spec(steps=60, heartbeat={"startupTimeoutSeconds": 120,
                                                  "timeoutSeconds": timeout}))
    # past the first save: a worker frozen in one before that gets the startup timeout (how
    # long a save takes is not known yet), after it the longer of the steady timeout and the
    # longest save so far x safetyFactor (well under 8 s for this model)
    job_env.wait("training", lambda s: s.get("phase") == "Running"
                 and s.get("progress", {}).get("step", 0) >= 2 and "latestCheckpoint" in s, 180)
    pod = next(p for p in job_env.pods() if p.metadata.name == f"{JOB}-a0-1")
    node = pod.spec.node_name
    faults.hang(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1")
    hung_at = time.monotonic()
    restarting = job_env.wait_phase("Restarting", 90)
    detected = time.monotonic() - hung_at
    # not before the timeout (the hang, not something else, was seen); at most the timeout + one
    # heartbeat period (2 s) + one resync (2 s) + slack for a machine busy with other work
    assert timeout - 2 <= detected <= timeout + 2 + 2 + 12, detected
    assert restarting["lastFailure"]["reason"] == "HeartbeatTimeout"
    # blamed: the frozen worker, not its peer that waits for it in a collective, still renewing
    assert restarting["lastFailure"]["pod"] == f"{JOB}-a0-1", restarting["lastFailure"]
    assert "no heartbeat for" in restarting["lastFailure"]["message"]
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    assert done["progress"]["step"] == 60 and done["restarts"]["total"] >= 1
    new = [p for p in job_env.pods() if p.metadata.labels["hlat.dev/attempt"] != "0"]
    assert new and all(p.spec.node_name != node for p in new)
    affinity = new[0].spec.affinity.node_affinity
    term = affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[0]
    assert term.match_fields[0].operator == "NotIn" and node in term.match_fields[0].values


def test_a_lost_node_is_avoided_and_the_job_recovers_on_the_others(job_env: Env) -> None:
    job_env.create(tiny_spec(steps=40))
    job_env.wait("training", lambda s: s.get("phase") == "Running"
                 and s.get("progress", {}).get("step", 0) >= 1, 180)
    node = next(p for p in job_env.pods()
                if p.metadata.name == f"{JOB}-a0-1").spec.node_name
    faults.node_down(job_env.cluster.config, node)
    try:
        restarting = job_env.wait_phase("Restarting", 90)
        assert restarting["lastFailure"]["reason"] in ("NodeLost", "HeartbeatTimeout")
        assert restarting["lastFailure"]["node"] == node
        job_env.wait("attempt 1 running", lambda s: s.get("attempt", 0) >= 1
                     and s.get("phase") == "Running", 120)
        new = [p for p in job_env.pods() if p.metadata.labels["hlat.dev/attempt"] != "0"]
        assert new and all(p.spec.node_name != node for p in new)
        term = new[0].spec.affinity.node_affinity \
            .required_during_scheduling_ignored_during_execution.node_selector_terms[0]
        assert term.match_fields[0].operator == "NotIn" and term.match_fields[0].values == [node]
        done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
        assert done["progress"]["step"] == 40
        assert done["restarts"]["total"] == 1 and done["restarts"]["counted"] == 0
        assert job_env.max_gangs == 1
    finally:
        faults.node_up(job_env.cluster.config, node)
        job_env.cluster.wait_nodes_ready([node], timeout=60)


def _kill_when_started(env: Env, attempt: int) -> None:
    pod = f"{JOB}-a{attempt}-1"
    env.wait(f"attempt {attempt}", lambda s: s.get("attempt") == attempt
             and s.get("phase") in ("Pending", "Running"), 60)
    env.wait_process(pod)
    faults.kill(env.cluster.config, env.ns, pod)


def test_an_exhausted_restart_budget_fails_the_job_with_the_reason(job_env: Env) -> None:
    job_env.create(tiny_spec(steps=50, maxRestarts=1))
    _kill_when_started(job_env, 0)
    _kill_when_started(job_env, 1)
    done = job_env.wait("Failed", lambda s: s.get("phase") == "Failed", 60)
    failed = next(c for c in done["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BudgetExhausted"
    assert "budget of 1" in failed["message"]
    assert done["restarts"]["counted"] == 1
    time.sleep(3)
    assert not [p for p in job_env.pods() if p.status.phase in ("Pending", "Running")
                and p.metadata.deletion_timestamp is None]


def test_a_restart_loop_without_progress_fails_the_job(job_env: Env) -> None:
    job_env.create(tiny_spec(steps=50, maxRestarts=10, noProgressRestarts=1))
    _kill_when_started(job_env, 0)
    _kill_when_started(job_env, 1)
    done = job_env.wait("Failed", lambda s: s.get("phase") == "Failed", 60)
    failed = next(c for c in done["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NoProgress", failed
    assert done["restarts"]["total"] == 1


def test_an_operator_killed_mid_restart_resumes_with_one_gang(job_env: Env,
                                                               cluster: Cluster) -> None:
    job_env.create(tiny_spec(steps=30, backoff={"initialSeconds": 4, "maxSeconds": 8}))
    job_env.wait_saved(4)  # step 2 complete (by the log: the status lags)
    faults.kill(cluster.config, job_env.ns, f"{JOB}-a0-0")
    job_env.wait_phase("Restarting", 30)
    old = job_env.operator["op"]
    old.kill()  # mid-recovery: the old gang going away
    job_env.operator["op"] = OperatorProcess(cluster, old.log_path, old.namespaces,
                                             old.extra_env, old.kubeconfig).start()
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    assert done["attempt"] == 1
    assert done["restarts"] == {"total": 1, "counted": 1}
    assert done["progress"]["step"] == 30
    assert job_env.max_gangs == 1
    attempts = sorted({p.metadata.labels["hlat.dev/attempt"] for p in job_env.pods()})
    assert attempts == ["1"]
