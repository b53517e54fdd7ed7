"""Evaluation jobs on durable checkpoints (spec.evaluation): which checkpoint gets one, the Job
that runs it, what a finished one said, and how the operator's passes start and report them
without ever touching the training."""

from __future__ import annotations

import json

import pytest
from opfakes import JOB, SETTINGS, World, raw_spec

from hlat_api import InvalidSpecError, labels, parse_spec
from hlat_api.spec import evaluation_due
from hlat_api.status import Evaluation
from hlat_operator import builders, evaluations
from hlat_operator.evaluations import ObservedEvaluation


def spec_with(**evaluation: object) -> dict[str, object]:
    return raw_spec(**{"eval": {"path": "/fsx/held-out"}, "evaluation": evaluation})


def test_every_nth_checkpoint_and_the_last_are_evaluated() -> None:
    spec = parse_spec(spec_with(every=2))  # checkpoints every 20 steps, 120 steps
    assert [s for s in range(1, 121) if evaluation_due(spec, s)] == [40, 80, 120]
    assert not evaluation_due(parse_spec(raw_spec()), 40)
    short = parse_spec({**spec_with(every=2), "train": {"globalBatch": 8, "microBatch": 4,
                                                       "steps": 100}})
    assert [s for s in range(1, 101) if evaluation_due(short, s)] == [40, 80, 100]  # the last


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
    (hold,) = pod["initContainers"]  # a native sidecar holds the checkpoint for any evaluator
    assert hold["restartPolicy"] == "Always" and hold["command"] == ["hlat-eval", "--hold"]
    assert hold["image"] == spec.image and hold["volumeMounts"] == c["volumeMounts"]
    assert job["spec"]["ttlSecondsAfterFinished"] == builders.EVALUATION_TTL_SECONDS
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
    entries = [Evaluation(step=s, job=f"tiny-eval-{s}") for s in (20, 40, 60, 80, 100)]
    seen = {
        20: ObservedEvaluation(20, "tiny-eval-20", "Succeeded",
                               json.dumps({"validationLoss": 5.5, "ok": True, "bad": "x"})),
        40: ObservedEvaluation(40, "tiny-eval-40", "Succeeded", "Traceback (most recent"),
        60: ObservedEvaluation(60, "tiny-eval-60", "Failed", "OOMKilled"),
        80: ObservedEvaluation(80, "tiny-eval-80", "Active"),
    }
    out, finished = evaluations.settle(entries, seen)
    assert [e.step for e in finished] == [20, 40, 60, 100]
    first = finished[0]
    assert first.phase == "Succeeded" and first.results == {"validationLoss": 5.5}
    assert finished[1].phase == "Failed" and "not JSON" in (finished[1].message or "")
    assert finished[2].phase == "Failed" and finished[2].message == "OOMKilled"
    assert "tiny-eval-100 is not there" in (finished[3].message or "")  # refused or deleted
    assert out[3].phase == "Running"
    again, none = evaluations.settle(out, seen)  # settled once
    assert again == out and none == []


def test_jobs_and_pods_are_read_as_the_job_controller_leaves_them() -> None:
    def job(step: int, *conditions: dict[str, str]) -> dict[str, object]:
        return {"metadata": {"name": f"tiny-eval-{step}", "labels": {labels.STEP: str(step)}},
                "status": {"conditions": [{"status": "True", **c} for c in conditions]}}

    def pod(step: int, phase: str, created: str, **terminated: object) -> dict[str, object]:
        return {"metadata": {"labels": {labels.STEP: str(step)}, "creationTimestamp": created},
                "status": {"phase": phase, "containerStatuses": [
                    {"name": "checkpoint-hold", "state": {"terminated": {"exitCode": 0}}},
                    {"name": "evaluator", "state": {"terminated": terminated}}]}}

    seen = evaluations.observe_jobs(
        [job(20, {"type": "SuccessCriteriaMet"}, {"type": "Complete"}),
         job(40, {"type": "FailureTarget"}, {"type": "Failed", "reason": "BackoffLimitExceeded",
                                             "message": "Job has reached the specified backoff "
                                                        "limit"}),
         job(60)],
        [pod(20, "Failed", "2026-01-01T00:00:00Z", exitCode=1, message="first try"),
         pod(20, "Succeeded", "2026-01-01T00:01:00Z", exitCode=0, message='{"acc": 0.5}'),
         pod(40, "Failed", "2026-01-01T00:00:00Z", exitCode=1, message="old"),
         pod(40, "Failed", "2026-01-01T00:02:00Z", exitCode=1,
             message="Traceback ...\nRuntimeError: no such task: hellaswg\n")])
    assert seen[20].state == "Succeeded" and seen[20].message == '{"acc": 0.5}'
    assert seen[40].state == "Failed"
    assert seen[40].message == ("BackoffLimitExceeded: Job has reached the specified backoff "
                                "limit; its last try exited 1: Traceback ...\nRuntimeError: no "
                                "such task: hellaswg")
    assert seen[60].state == "Active" and seen[60].name == "tiny-eval-60"


# --- the operator's passes ---------------------------------------------------------------------


def training(**evaluation: object) -> World:
    w = World(spec_with(**evaluation))
    w.until("Running", step=1)
    return w


def test_each_due_checkpoint_gets_one_job_and_its_results_reach_status_and_events() -> None:
    w = training(every=2)
    w.run(3, step=25)
    w.beat(25, checkpoint_step=20)  # not due: every 2nd checkpoint
    w.run(3, step=None)
    assert w.eval_jobs == {} and w.status.evaluations == []
    for _ in range(3):  # one Job, however many passes see the checkpoint
        w.beat(45, checkpoint_step=40)
        w.step()
    assert list(w.eval_jobs) == [40] and w.reasons().count("Evaluating") == 1
    (entry,) = w.status.evaluations
    spec = parse_spec(w.spec)
    assert (entry.step, entry.phase, entry.job) == (40, "Running", "tiny-eval-40")
    assert entry.tokens == 40 * spec.tokens_per_step
    w.end_evaluation(40, "Succeeded", json.dumps({"validationLoss": 4.25, "step": 40}))
    w.step()
    w.step()
    (entry,) = w.status.evaluations
    assert entry.phase == "Succeeded" and entry.results == {"validationLoss": 4.25, "step": 40}
    done = [e for e in w.events if e.reason == "Evaluated"]
    assert len(done) == 1 and "validationLoss 4.25" in done[0].message
    assert w.status.phase == "Running"


def test_a_failed_evaluation_is_reported_and_the_training_goes_on() -> None:
    w = training()
    w.beat(21, checkpoint_step=20)
    w.step()
    w.end_evaluation(20, "Failed", "BackoffLimitExceeded: Job has reached the specified "
                                   "backoff limit; its last try exited 1: no such task")
    w.run(5, step=22)
    (entry,) = w.status.evaluations
    assert entry.phase == "Failed" and "no such task" in (entry.message or "")
    (warning,) = [e for e in w.events if e.reason == "EvaluationFailed"]
    assert warning.type == "Warning" and "the training goes on" in warning.message
    assert w.status.phase == "Running" and w.status.restarts.total == 0
    assert w.status.last_failure is None


def test_a_refused_job_fails_its_evaluation_once_and_the_next_checkpoint_gets_one() -> None:
    w = training()
    w.refuse_jobs = True
    w.beat(21, checkpoint_step=20)
    w.run(3, step=None)
    (entry,) = w.status.evaluations
    assert entry.phase == "Failed" and "is not there" in (entry.message or "")
    assert w.reasons().count("EvaluationFailed") == 2  # the refusal, then the entry's end
    assert w.status.phase == "Running"
    w.refuse_jobs = False
    w.beat(41, checkpoint_step=40)
    w.step()
    assert list(w.eval_jobs) == [40] and [e.phase for e in w.status.evaluations] == [
        "Failed", "Running"]


def test_a_job_whose_status_write_was_lost_is_adopted_and_reported() -> None:
    w = training()
    w.beat(21, checkpoint_step=20)
    d = w.decide()
    for action in d.actions:  # the Job is made, the status write is lost
        if type(action).__name__ == "CreateObject":
            w.apply(action)
    assert list(w.eval_jobs) == [20] and w.status.evaluations == []
    w.beat(41, checkpoint_step=40)  # the next checkpoint came before the next pass
    w.step()
    assert [(e.step, e.phase) for e in w.status.evaluations] == [(20, "Running"),
                                                                 (40, "Running")]
    w.end_evaluation(20, "Succeeded", json.dumps({"validationLoss": 4.0}))
    w.step()
    assert w.status.evaluations[0].results == {"validationLoss": 4.0}


def test_the_last_checkpoint_is_evaluated_after_the_training_ends() -> None:
    w = training()
    w.beat(120, phase="finished", checkpoint_step=120)
    w.succeed_all()
    w.step()
    assert w.status.phase == "Succeeded" and list(w.eval_jobs) == [20, 40, 60, 80, 100, 120]
    w.end_evaluation(120, "Succeeded", json.dumps({"validationLoss": 3.0}))
    w.step()
    assert w.status.evaluations[-1].phase == "Succeeded"
    assert w.status.evaluations[-1].results == {"validationLoss": 3.0}


def test_status_keeps_the_newest_evaluations() -> None:
    w = training(keep=2)
    for step in (20, 40, 60):
        w.beat(step + 1, checkpoint_step=step)
        w.step()
        w.end_evaluation(step, "Succeeded", json.dumps({"validationLoss": 5.0 - step / 100}))
        w.step()
    assert [e.step for e in w.status.evaluations] == [40, 60]
    assert list(w.eval_jobs) == [20, 40, 60]  # nothing made twice when 20 left the status


def test_checkpoints_that_came_between_two_passes_each_get_one() -> None:
    """The trainer held every due checkpoint since the start (the spec never edited: its
    generation is 1), so the first pass to see checkpoint 50 evaluates 20 and 40; later, the
    checkpoints that came between two passes each get their Job."""
    w = training()
    w.beat(51, checkpoint_step=50)
    w.step()
    assert list(w.eval_jobs) == [20, 40]
    w.beat(101, checkpoint_step=100)  # 60, 80 and 100 came before the next pass saw any
    w.step()
    assert list(w.eval_jobs) == [20, 40, 60, 80, 100]
    assert [e.step for e in w.status.evaluations] == [20, 40, 60, 80, 100]
    assert w.reasons().count("Evaluating") == 5


def test_a_spec_that_gained_evaluation_evaluates_its_newest_due_checkpoint_first() -> None:
    """Its trainers did not hold the older checkpoints: retention deleted them."""
    w = training()
    w.generation = 2  # spec.evaluation added by an edit
    w.beat(51, checkpoint_step=50)
    w.step()
    assert list(w.eval_jobs) == [40]
    w.beat(81, checkpoint_step=80)
    w.step()
    assert list(w.eval_jobs) == [40, 60, 80]
