"""The operator end to end: the real local control plane, the real operator process, real
trainer processes (torchrun, 2 nodes on CPU) on a shared PVC.

One operator subprocess per module (`python -m hlat_operator.cli`, the rig's operator
credentials); each test has its own namespace and PVC directory. Scenarios are tiny (a few
steps of a 2-layer model, checkpoint every 2 steps, 1 s backoff) so the module stays fast.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed import faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import GROUP, PLURAL, VERSION, OperatorProcess, install_crd, venv_bin

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = "tiny"


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    install_crd(cluster.admin_api())


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sample") / "sample"
    subprocess.run([str(venv_bin("hlat-data")), "sample", "--out", str(out), "--docs", "300"],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def operator(cluster: Cluster, crd: None, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, OperatorProcess]]:
    """The module's operator, in a holder so a test can replace it (kill + start again)."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    holder = {"op": OperatorProcess(cluster, log, ["test-*"]).start()}
    yield holder
    holder["op"].stop()
    print(f"operator log: {log}")


@pytest.fixture
def job_env(cluster: Cluster, namespace: str, sample_data: Path, tmp_path: Path,
            operator: dict[str, OperatorProcess]) -> Iterator[Env]:
    fsx = tmp_path / "fsx"
    shutil.copytree(sample_data, fsx / "data" / "sample")
    cluster.create_shared_volume(namespace, "fsx", fsx)
    env = Env(cluster, namespace, fsx, operator)
    yield env
    env.delete()
    with contextlib.suppress(ApiException):
        client.CoreV1Api(cluster.admin_api()).delete_persistent_volume(f"{namespace}-fsx")


# --- helpers -------------------------------------------------------------------------------


class Env:
    """One test's job: create it, watch its status (recording phase transitions with a
    stopwatch), read its pods and logs."""

    def __init__(self, cluster: Cluster, namespace: str, fsx: Path,
                 operator: dict[str, OperatorProcess]) -> None:
        self.cluster, self.ns, self.fsx, self.operator = cluster, namespace, fsx, operator
        api = cluster.admin_api()
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.transitions: list[tuple[str, float]] = []
        self.max_gangs = 0

    def create(self, spec: dict[str, Any]) -> None:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
                "metadata": {"name": JOB}, "spec": spec}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def delete(self) -> None:
        with contextlib.suppress(ApiException):
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, JOB)

    def job(self) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.get_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, self.ns, PLURAL, JOB)
        return job

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.job().get("status") or {}
        phase = status.get("phase")
        if phase and (not self.transitions or self.transitions[-1][0] != phase):
            self.transitions.append((phase, time.monotonic()))
        self._count_gangs()
        return status

    def _count_gangs(self) -> None:
        """Attempts with a live (not terminating, not finished) pod: never more than one."""
        attempts = {p.metadata.labels.get("hlat.dev/attempt") for p in self.pods()
                    if p.metadata.deletion_timestamp is None
                    and p.status.phase in ("Pending", "Running")}
        self.max_gangs = max(self.max_gangs, len(attempts))

    def pods(self) -> list[Any]:
        return list(self.core.list_namespaced_pod(
            self.ns, label_selector=f"hlat.dev/job={JOB}").items)

    def wait(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float
             ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = self.status()
            if pred(status):
                return status
            if status.get("phase") == "Failed" and "Failed" not in what:
                pytest.fail(f"job Failed while waiting for {what}: {status.get('conditions')}")
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                             f"status: {json.dumps(status)[:1500]}; see the operator log")

    def wait_phase(self, phase: str, timeout: float) -> dict[str, Any]:
        return self.wait(f"phase {phase}", lambda s: s.get("phase") == phase, timeout)

    def phases(self) -> list[str]:
        return [p for p, _ in self.transitions]

    def stopwatch_running(self, until: float) -> float:
        """Seconds in Running by the transitions this test observed."""
        total = 0.0
        for i, (phase, t) in enumerate(self.transitions):
            end = self.transitions[i + 1][1] if i + 1 < len(self.transitions) else until
            if phase == "Running":
                total += end - t
        return total

    def pod_log(self, attempt: int, rank: int) -> str:
        return self.cluster.pod_log(self.ns, f"{JOB}-a{attempt}-{rank}")

    def wait_process(self, pod: str, timeout: float = 60) -> None:
        """Until the kubelet has started the pod's container (its pid file exists)."""
        from hlat_testbed.podfiles import container_pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                container_pid(self.cluster.config, self.ns, pod)
                return
            except Exception:
                time.sleep(0.25)
        raise AssertionError(f"pod {pod}'s process never started")

    def events(self) -> list[str]:
        evs = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={JOB}").items
        return [e.reason for e in evs]


def steps_logged(log: str) -> list[int]:
    """The steps a trainer logged (its JSON metric lines), in order."""
    out = []
    for line in log.splitlines():
        if line.startswith("{") and '"step"' in line:
            try:
                out.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                continue
    return out


def resumed_from(log: str) -> int | None:
    m = re.search(r"resumed from checkpoint step_(\d+)", log)
    return int(m.group(1)) if m else None


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
    running = job_env.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                           and (s.get("latestCheckpoint") or {}).get("step", 0) >= 2, 180)
    reached = running["progress"]["step"]
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
    assert job_env.phases().count("Restarting") == 1
    # step continuity: the resumed trainer starts right after a complete checkpoint, one
    # that existed when the worker was killed or later (never before the first one seen)
    log = job_env.pod_log(1, 0)
    ckpt = resumed_from(log)
    assert ckpt is not None and ckpt >= 2 and ckpt % 2 == 0, log[-2000:]
    assert steps_logged(log)[0] == ckpt + 1
    assert steps_logged(log)[-1] == 40
    assert ckpt >= min(reached, 2)
    up = done["uptime"]
    assert up["downSeconds"] > 0 and 0 < up["ratio"] < 1
    assert up["downSeconds"] < recovered
    assert {"Killed", "Created", "Completed"} <= set(job_env.events())
    assert job_env.max_gangs == 1


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
    job_env.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                 and (s.get("latestCheckpoint") or {}).get("step", 0) >= 2, 180)
    faults.kill(cluster.config, job_env.ns, f"{JOB}-a0-0")
    job_env.wait_phase("Restarting", 30)
    old = job_env.operator["op"]
    old.kill()  # mid-recovery: old gang going away, backoff running
    job_env.operator["op"] = OperatorProcess(cluster, old.log_path, old.namespaces).start()
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    assert done["attempt"] == 1
    assert done["restarts"] == {"total": 1, "counted": 1}
    assert done["progress"]["step"] == 30
    assert job_env.max_gangs == 1
    attempts = sorted({p.metadata.labels["hlat.dev/attempt"] for p in job_env.pods()})
    assert attempts == ["1"]
