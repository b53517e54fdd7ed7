"""Voluntary disruption end to end, on the local cluster's real API server and disruption
controller: while a job runs its workers carry `karpenter.sh/do-not-disrupt` and a
PodDisruptionBudget makes the Eviction API (what `kubectl drain`, Karpenter and the cluster
autoscaler use) refuse to evict them; suspended, the budget is gone and a drain goes ahead;
resumed, it is back; finished, it is gone. A checkpoint directory on no volume is refused.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from e2e_env import JOB, Env
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_api.manifest import API_GROUP, API_VERSION

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _budget(env: Env) -> Any | None:
    policy = client.PolicyV1Api(env.cluster.admin_api())
    try:
        return policy.read_namespaced_pod_disruption_budget(env.name, env.ns)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def _wait_budget(env: Env, present: bool, timeout: float = 30) -> Any | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pdb = _budget(env)
        if (pdb is not None) == present:
            return pdb
        time.sleep(0.25)
    raise AssertionError(f"the budget is {'absent' if present else 'still there'} after "
                         f"{timeout}s (phase {env.status().get('phase')})")


def _evict(env: Env, pod: str) -> int:
    """The Eviction API as `kubectl drain` calls it; the HTTP status (201: evicted)."""
    try:
        env.core.create_namespaced_pod_eviction(pod, env.ns, client.V1Eviction(
            metadata=client.V1ObjectMeta(name=pod, namespace=env.ns)))
    except ApiException as err:
        return int(err.status)
    return 201


def _suspend(env: Env, value: bool) -> None:
    env.custom.patch_namespaced_custom_object(API_GROUP, API_VERSION, env.ns, "pretrainjobs",
                                              JOB, {"spec": {"suspend": value}})


def test_workers_are_protected_while_the_job_runs_and_released_after(job_env: Env) -> None:
    job_env.create(tiny_spec(steps=400))
    job_env.wait_phase("Running", 180)
    pods = [p for p in job_env.pods() if p.status.phase == "Running"]
    assert len(pods) == 2
    for pod in pods:
        assert pod.metadata.annotations.get("karpenter.sh/do-not-disrupt") == "true"
    pdb = _wait_budget(job_env, True)
    assert pdb.spec.min_available == 2
    assert pdb.metadata.owner_references[0].kind == "PretrainJob"  # garbage-collected with it
    # the disruption controller counts both workers and allows no eviction
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pdb = _budget(job_env)
        if pdb.status and pdb.status.expected_pods == 2 and pdb.status.current_healthy == 2:
            break
        time.sleep(0.5)
    assert pdb.status.disruptions_allowed == 0, pdb.status
    victim = f"{JOB}-a0-1"
    assert _evict(job_env, victim) == 429  # Too Many Requests: the budget refuses
    time.sleep(2)
    assert job_env.status()["phase"] == "Running" and job_env.status().get("attempt", 0) == 0
    assert victim in {p.metadata.name for p in job_env.pods()}

    # a drain that goes ahead anyway (an admin removed the budget): handled as without one,
    # a restart counted as infrastructure, and the new gang has its budget again
    client.PolicyV1Api(job_env.cluster.admin_api()).delete_namespaced_pod_disruption_budget(
        JOB, job_env.ns)
    assert _evict(job_env, victim) == 201
    status = job_env.wait("a new gang running", lambda s: s.get("attempt", 0) >= 1
                          and s.get("phase") == "Running", 180)
    assert status["restarts"]["total"] == 1 and status["restarts"].get("counted", 0) == 0
    assert _wait_budget(job_env, True).spec.min_available == 2

    # suspended: the pods go and so does the budget
    _suspend(job_env, True)
    job_env.wait_phase("Suspended", 60)
    _wait_budget(job_env, False)
    # resumed: a new gang, protected again
    _suspend(job_env, False)
    job_env.wait_phase("Running", 180)
    assert _wait_budget(job_env, True).spec.min_available == 2


def test_the_budget_is_gone_once_the_job_finishes(job_env: Env) -> None:
    job_env.create(tiny_spec(steps=8))
    job_env.wait_phase("Running", 180)
    _wait_budget(job_env, True)
    job_env.wait_phase("Succeeded", 300)
    _wait_budget(job_env, False)
    assert job_env.pods(), "finished pods are kept for their logs"


def test_a_checkpoint_directory_on_no_volume_is_refused(job_env: Env) -> None:
    spec = tiny_spec()
    spec["checkpoint"]["dir"] = "/tmp/checkpoints"
    job_env.create(spec)
    status = job_env.wait_phase("Failed", 60)
    (cond,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert cond["reason"] == "InvalidSpec", cond
    assert "spec.checkpoint.dir: /tmp/checkpoints is on no volume" in cond["message"]
    assert "spec.storage.mountPath (/fsx)" in cond["message"]
    assert not job_env.pods()
