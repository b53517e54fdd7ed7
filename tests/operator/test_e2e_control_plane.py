"""Control-plane faults end to end: the API server and etcd restarted in the middle of a job,
and a burst of 409 conflicts on the job. Neither is the workers' fault: the job must go on
with no restart, or (with a real fault inside the burst) with exactly the restarts that
happened, one gang at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from e2e_env import JOB, Env, metric_lines, report_recovery, resumed_from, steps_logged
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_api import step_dir
from hlat_testbed import controlplane, faults
from hlat_testbed.demo import GROUP, PLURAL, VERSION
from hlat_testbed.testing import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _restart_api_server_and_etcd(env: Env, down_seconds: float) -> float:
    """Stop the API server, then etcd; keep both down; start them again (etcd first).
    Returns the seconds the API server was unreachable."""
    config = env.cluster.config
    table = controlplane.processes(config)
    began = time.monotonic()
    table.stop("kube-apiserver", timeout=15)
    table.stop("etcd", timeout=15)
    time.sleep(down_seconds)
    controlplane.start_etcd(config)
    controlplane.start_apiserver(config)  # returns once /readyz answers
    return time.monotonic() - began


@pytest.fixture
def hands_back_a_working_control_plane(job_env: Env) -> Iterator[None]:
    """After the test, pass or fail: the next test's namespace must get its service account
    in the usual bound, so wait out the controllers' back-off here (it cost a CI run once)."""
    yield
    took = job_env.cluster.wait_controllers_serve_new_namespaces()
    print(f"controllers served a new namespace {took:.1f}s after the test")


@pytest.mark.usefixtures("hands_back_a_working_control_plane")
def test_the_api_server_and_etcd_restarted_mid_job_cause_no_restart(job_env: Env) -> None:
    """Down for longer than the heartbeat timeout: while the API server is away no worker can
    renew its Lease and the operator sees nothing, which is no evidence of a hang; after it is
    back the job goes on where it was, in the same gang."""
    # more steps than the test waits for: a CI run's job (0.036 s a step, alone on its core)
    # finished 1,000 steps while the API server was still away, so the outage no longer fell
    # mid-job (what a job that ends in an outage does is another case). The test watches until
    # the status, after the outage, shows training well past it, then deletes the job.
    steps = 20000
    spec = tiny_spec(steps=steps, heartbeat={"startupTimeoutSeconds": 120, "timeoutSeconds": 6})
    spec["checkpoint"]["interval"] = 25
    job_env.create(spec)
    before = job_env.wait("training", lambda s: s.get("phase") == "Running"
                          and (s.get("progress") or {}).get("step", 0) >= 10, 180)
    began = time.time()
    outage = _restart_api_server_and_etcd(job_env, down_seconds=12)
    ended = time.time()
    assert outage > 12

    def stepped_at(log: str) -> list[tuple[int, float]]:
        return [(r["step"], r["time"]) for r in metric_lines(log)]

    # the operator, back, sees the steps trained since: 5 s of training after the outage
    reached = max(step for step, _ in stepped_at(job_env.pod_log(0, 0)))
    after = job_env.wait("training reported well past the outage", lambda s: (
        (s.get("progress") or {}).get("step", 0) >= reached + 50
        and stepped_at(job_env.pod_log(0, 0))[-1][1] > ended + 5), 300)
    assert after["restarts"]["total"] == 0, after.get("lastFailure")
    assert after["phase"] == "Running" and "Restarting" not in job_env.phases()
    assert job_env.max_gangs == 1
    log = job_env.pod_log(0, 0)
    assert resumed_from(log) is None
    trained = steps_logged(log)
    assert trained == list(range(1, len(trained) + 1)), "steps repeated or skipped"
    assert before["progress"]["step"] < reached < steps
    # training went on while the API server was away, and after it came back
    times = [t for _, t in stepped_at(log)]
    assert any(began < t < ended for t in times) and max(times) > ended + 5, (began, ended)
    names = {p.metadata.name for p in job_env.pods()}
    assert names == {f"{JOB}-a0-0", f"{JOB}-a0-1"}, names


@pytest.mark.usefixtures("hands_back_a_working_control_plane")
def test_a_job_that_ends_while_the_api_server_is_away_commits_its_last_checkpoint_once_back(
        job_env: Env) -> None:
    """The run's last checkpoint is written while the API server (and etcd) are away for
    longer than the Lease's duration: rank 0 cannot show that its attempt is still the live one,
    so it holds back `done` (as for any checkpoint then) and, this one having no later one to
    commit instead, waits for a renewal before it exits. Once the API server is back the job
    ends Succeeded with its last checkpoint complete and the last step in its status, no
    restart. (Before, the trainer exited at once: Succeeded, its last checkpoint incomplete.)"""
    steps, delay = 40, 25
    spec = tiny_spec(steps=steps)
    spec["checkpoint"].update({"interval": 1000, "async": True})  # the last one only
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "HLAT_FAULT_CHECKPOINT_WRITE_DELAY_SECONDS", "value": str(delay)}]}]}}
    job_env.create(spec)
    job_env.wait("the last step reported, its checkpoint being written",
                 lambda s: (s.get("progress") or {}).get("step", 0) == steps, 180)
    config = job_env.cluster.config
    table = controlplane.processes(config)
    table.stop("kube-apiserver", timeout=15)
    table.stop("etcd", timeout=15)
    try:  # the write ends in the outage (its Lease silent for 20 s, 6 s its duration)
        wait_for(lambda: any(line in job_env.pod_log(0, 0) for line in (
            "the run's last, is written but not committed", f"finished at step {steps}")),
            delay + 60, "rank 0 through its last write")
    finally:
        controlplane.start_etcd(config)
        controlplane.start_apiserver(config)
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 180)
    assert done["restarts"]["total"] == 0, done.get("lastFailure")
    assert done["latestCheckpoint"]["step"] == steps, done.get("latestCheckpoint")
    assert done["progress"]["step"] == steps
    assert (step_dir(job_env.fsx / "checkpoints", JOB, steps) / "done").exists()
    assert "committed" in job_env.pod_log(0, 0).split("not committed")[-1]


def _conflict_burst(env: Env, stop: threading.Event, counter: list[int]) -> None:
    """Patch the job's metadata as fast as the API server takes it: every patch moves its
    resourceVersion, so the operator's status writes (which carry the version they read) lose
    with 409 again and again."""
    custom = client.CustomObjectsApi(env.cluster.admin_api())
    while not stop.is_set():
        try:
            custom.patch_namespaced_custom_object(
                GROUP, VERSION, env.ns, PLURAL, env.name,
                {"metadata": {"annotations": {"test.hlat.dev/burst": str(counter[0])}}})
            counter[0] += 1
        except ApiException:
            time.sleep(0.05)


def test_a_burst_of_conflicts_around_a_fault_counts_it_once(job_env: Env) -> None:
    """A kill in the middle of a burst of 409s: the restart is decided once and counted once,
    the job ends Succeeded with one gang at a time, and conflicts did happen."""
    # at 0.08 s a step (a worker alone on a core) 60 steps ended before the kill: the status
    # showed the first checkpoint about 50 steps late, and the burst runs 2 s first
    steps = 400
    job_env.create(tiny_spec(steps=steps))
    job_env.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                 and (s.get("latestCheckpoint") or {}).get("step", 0) >= 2, 180)
    log_path = job_env.operator["op"].log_path
    conflicts_before = log_path.read_text(errors="replace").count("stale view, deciding again")
    stop, patches = threading.Event(), [0]
    burst = threading.Thread(target=_conflict_burst, args=(job_env, stop, patches), daemon=True)
    burst.start()
    try:
        time.sleep(2)
        fault_at = time.time()
        faults.kill(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1")
        done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    finally:
        stop.set()
        burst.join(10)
    conflicts = (log_path.read_text(errors="replace").count("stale view, deciding again")
                 - conflicts_before)
    print(f"burst: {patches[0]} patches, {conflicts} passes lost to a conflict")
    assert patches[0] > 100 and conflicts >= 5, (patches[0], conflicts)
    assert done["restarts"]["total"] == 1, done["restarts"]
    assert done["lastFailure"]["reason"] == "Killed"
    assert done["progress"]["step"] == steps and job_env.max_gangs == 1
    assert resumed_from(job_env.pod_log(1, 0)) is not None
    report_recovery(job_env, "SIGKILL inside a burst of 409s", fault_at)
    restarts = [m for _, m in job_env.event_messages() if "restarting the gang" in m]
    assert len(restarts) == 1, restarts
