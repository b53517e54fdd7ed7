"""Evaluation jobs on durable checkpoints (spec.evaluation), their pure parts: which checkpoint
gets one, the Job that runs it, and what a finished one said (WIP: not wired into reconcile)."""

from __future__ import annotations

import json

import pytest
from opfakes import JOB, SETTINGS, raw_spec

from hlat_api import InvalidSpecError, labels, parse_spec
from hlat_api.status import Evaluation
from hlat_operator import builders, evaluations
from hlat_operator.evaluations import ObservedEvaluation


def spec_with(**evaluation: object) -> dict[str, object]:
    return raw_spec(**{"eval": {"path": "/fsx/held-out"}, "evaluation": evaluation})


def test_every_nth_checkpoint_and_the_last_are_evaluated() -> None:
    spec = parse_spec(spec_with(every=2))  # checkpoints every 20 steps, 120 steps
    assert [s for s in range(1, 121) if evaluations.due(spec, s)] == [40, 80, 120]
    assert not evaluations.due(parse_spec(raw_spec()), 40)


def test_the_default_evaluator_needs_the_held_out_set() -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(raw_spec(evaluation={}))
    assert "spec.evaluation.command" in str(err.value)
    parse_spec(raw_spec(evaluation={"command": ["lm_eval", "--tasks", "hellaswag"]}))


def test_the_job_runs_on_its_own_nodes_with_the_workers_volumes_and_reports_by_message(
        ) -> None:
    spec = parse_spec(spec_with(nodeSelector={"node.kubernetes.io/instance-type": "c7i.8xlarge"},
                                resources={"cpu": "8"}, retries=3, deadlineSeconds=900))
    job = builders.build_evaluation_job(JOB, spec, 40, SETTINGS)
    worker = builders.build_worker_pod(JOB, spec, 0, 0, SETTINGS)
    assert job["kind"] == "Job" and job["metadata"]["name"] == "tiny-eval-40"
    meta_labels = job["metadata"]["labels"]
    assert meta_labels[labels.COMPONENT] == labels.EVALUATION and meta_labels[labels.STEP] == "40"
    assert job["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    assert job["spec"]["backoffLimit"] == 3 and job["spec"]["activeDeadlineSeconds"] == 900
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "c7i.8xlarge"}
    assert pod["volumes"] == worker["spec"]["volumes"]
    (c,) = pod["containers"]
    assert c["command"] == ["hlat-eval"] and c["resources"]["requests"] == {"cpu": "8"}
    assert c["terminationMessagePath"] == evaluations.RESULT_PATH
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HLAT_EVAL_STEP"] == "40" and env["HLAT_EVAL_RESULT"] == evaluations.RESULT_PATH
    assert "HLAT_HEARTBEAT_LEASE" not in env and "HLAT_NODE_RANK" not in env  # no worker's
    trainer = next(x for x in worker["spec"]["containers"] if x["name"] == "trainer")
    assert c["volumeMounts"] == trainer["volumeMounts"]


def test_a_long_job_name_makes_a_job_name_of_at_most_63_characters() -> None:
    long = "j" * 60
    names = {labels.evaluation_job_name(long, 120), labels.evaluation_job_name(long + "x", 120)}
    assert len(names) == 2 and all(len(n) <= 63 and n.endswith("-eval-120") for n in names)


def test_a_finished_job_settles_its_entry_with_its_numbers_or_says_why_not() -> None:
    entries = [Evaluation(step=s, job=f"tiny-eval-{s}") for s in (20, 40, 60, 80)]
    seen = {
        20: ObservedEvaluation(20, "tiny-eval-20", "Succeeded",
                               json.dumps({"validationLoss": 5.5, "ok": True, "bad": "x"})),
        40: ObservedEvaluation(40, "tiny-eval-40", "Succeeded", "Traceback (most recent"),
        60: ObservedEvaluation(60, "tiny-eval-60", "Failed", "OOMKilled"),
        80: ObservedEvaluation(80, "tiny-eval-80", "Active"),
    }
    out, finished = evaluations.settle(entries, seen, keep=3)
    assert [e.step for e in out] == [40, 60, 80]  # the newest 3
    assert [e.step for e in finished] == [20, 40, 60]
    first = finished[0]
    assert first.phase == "Succeeded" and first.results == {"validationLoss": 5.5}
    assert finished[1].phase == "Failed" and "not JSON" in (finished[1].message or "")
    assert finished[2].phase == "Failed" and finished[2].message == "OOMKilled"
    assert out[-1].phase == "Running"
    again, none = evaluations.settle(out, seen, keep=3)  # settled once
    assert again == out and none == []
