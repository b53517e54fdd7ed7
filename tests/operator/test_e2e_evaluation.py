"""Evaluation jobs on durable checkpoints (spec.evaluation, issue 33) on the local cluster: a
real Job controller runs a batch/v1 Job per due checkpoint of a 2-node job, our kubelet runs
its evaluator beside the `hlat-eval --hold` sidecar, and the operator (with the chart's RBAC)
reads the result from the evaluator's termination message into status.

Checkpoints here come several a second with checkpoint.keep 1, far faster than a pod starts:
without the trainer's hold (`hlat_api.layout.hold_ahead`) and the sidecar's, retention deletes
each before its evaluator reads it. A failing evaluator is reported, retried within its budget,
and never touches the training.
"""

from __future__ import annotations

import json

import pytest
from e2e_env import Env
from e2e_spec import tiny_spec
from kubernetes import client

from hlat_api import labels
from hlat_testbed import faults

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HELD_OUT = {"path": "/fsx/data/sample/held-out", "interval": 20, "batches": 2}


def _settled(status: dict[str, object], count: int) -> bool:
    entries = status.get("evaluations") or []
    assert isinstance(entries, list)
    return len(entries) >= count and all(e.get("phase") != "Running" for e in entries)


def test_each_due_checkpoint_is_evaluated_by_a_job_and_keep_waits_for_it(job_env: Env) -> None:
    spec = tiny_spec(steps=60)
    spec["checkpoint"].update(interval=10, keep=1)
    spec["eval"] = HELD_OUT
    spec["evaluation"] = {"every": 2, "retries": 0, "deadlineSeconds": 300}
    job_env.create(spec)
    done = job_env.wait_trained()
    assert done["phase"] == "Succeeded" and done["restarts"]["total"] == 0
    status = job_env.wait("three evaluations settled", lambda s: _settled(s, 3), 300)
    entries = status["evaluations"]
    tokens_per_step = spec["train"]["globalBatch"] * spec["data"]["seqLen"]
    assert [(e["step"], e["tokens"]) for e in entries] == [
        (s, s * tokens_per_step) for s in (20, 40, 60)]
    failed = [e for e in entries if e["phase"] != "Succeeded"]
    assert not failed, failed  # a checkpoint deleted before its evaluator read it fails here
    assert all(set(e["results"]) == {"validationLoss"} for e in entries)
    # each is the loss of its own checkpoint: the run's in-loop validation loss at that step
    # (node rank 0's log; hlat-eval reads the same held-out micro-batches in one process)
    in_loop = {r["step"]: r["validationLoss"] for r in map(json.loads, (
        line for line in job_env.pod_log(0, 0).splitlines() if line.startswith('{"step"')))
        if "validationLoss" in r}
    for e in entries:
        assert e["results"]["validationLoss"] == pytest.approx(in_loop[e["step"]], rel=1e-4), e
    assert status["progress"]["validationLoss"] == pytest.approx(in_loop[60], rel=1e-6)
    events = job_env.events()
    assert events.count("Evaluating") == 3 and events.count("Evaluated") == 3, events
    assert "EvaluationFailed" not in events
    # the Jobs are the job's: labelled, owned, their pods never counted as workers
    jobs = client.BatchV1Api(job_env.cluster.admin_api()).list_namespaced_job(
        job_env.ns, label_selector=f"{labels.JOB}={job_env.name}").items
    assert sorted(j.metadata.name for j in jobs) == [f"{job_env.name}-eval-{s}"
                                                    for s in (20, 40, 60)]
    assert all(j.metadata.owner_references[0].kind == "PretrainJob" for j in jobs)


def test_a_failing_evaluation_is_retried_reported_and_never_stops_the_training(
        job_env: Env) -> None:
    spec = tiny_spec(steps=400, heartbeat={"startupTimeoutSeconds": 120,
                                           "timeoutSeconds": 600})
    spec["checkpoint"].update(interval=10, keep=2)
    spec["evaluation"] = {"every": 10, "retries": 1, "deadlineSeconds": 120,
                          "command": ["/bin/sh", "-c",
                                      "echo 'lm_eval: no such task: hellaswg' >&2; exit 3"]}
    job_env.create(spec)
    job_env.wait("the first evaluation started", lambda s: bool(s.get("evaluations")), 180)
    # the gang is frozen while the evaluation fails twice: the training is Running throughout
    for rank in (0, 1):
        faults.hang(job_env.cluster.config, job_env.ns, f"{job_env.name}-a0-{rank}")
    failed = job_env.wait("the evaluation failed", lambda s: any(
        e.get("phase") == "Failed" for e in s.get("evaluations") or []), 180)
    assert failed["phase"] == "Running", failed.get("conditions")
    entry = next(e for e in failed["evaluations"] if e["phase"] == "Failed")
    assert "BackoffLimitExceeded" in entry["message"], entry
    assert "no such task: hellaswg" in entry["message"], entry  # its log's tail
    pods = job_env.core.list_namespaced_pod(
        job_env.ns, label_selector=f"{labels.STEP}={entry['step']}").items
    assert len(pods) == 2  # the first try and one retry (evaluation.retries)
    for rank in (0, 1):
        faults.resume(job_env.cluster.config, job_env.ns, f"{job_env.name}-a0-{rank}")
    done = job_env.wait_trained()
    assert done["phase"] == "Succeeded"
    assert done["restarts"]["total"] == 0 and "lastFailure" not in done
    assert "Restarting" not in job_env.phases()
    assert "EvaluationFailed" in job_env.events()
