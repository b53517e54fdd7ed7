"""A PretrainJob's life as a user sees it: created, running, finished, suspended, deadlines."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from opfakes import JOB, SETTINGS, World, at, raw_spec, stamp

from hlat_api import labels
from hlat_api.heartbeat import CHECKPOINT_REQUEST, lease_name
from hlat_api.labels import Reason
from hlat_api.status import PretrainJobStatus
from hlat_operator.observe import Observed
from hlat_operator.reconcile import (
    CreateObject,
    DeleteJob,
    DeletePod,
    PatchStatus,
    decide,
)


def _kinds(actions: list[Any]) -> list[str]:
    return [a.obj["kind"] for a in actions if isinstance(a, CreateObject)]


def test_a_new_job_gets_its_objects_and_one_pod_per_node() -> None:
    w = World()
    d = w.step()
    assert _kinds(d.actions) == [
        "Service",
        "ServiceAccount",
        "ConfigMap",
        "Role",
        "RoleBinding",  # after its Role: the API server resolves the roleRef
        "PodDisruptionBudget",
        "Lease",
        "Lease",
        "Pod",
        "Pod",
    ]
    assert sorted(w.pods) == ["tiny-a0-0", "tiny-a0-1"]
    assert w.status.phase == "Pending" and w.status.attempt == 0
    assert w.status.start_time == stamp(0)
    assert Reason.CREATED in w.reasons()


def test_status_is_written_before_any_object_is_created() -> None:
    d = World().decide()
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds.index("PatchStatus") < kinds.index("CreateObject")


def test_a_periodic_refresh_is_one_write_and_the_state_only_moves_with_a_fault() -> None:
    """Every write to the job is a watch event for every client watching it (the operator's
    own watch among them): a status refresh writes the status alone, paced by the status's
    accountedAt; the state annotation is written only when it changes, before the status."""
    w = World()
    w.run(30, step=10)
    assert w.status.phase == "Running"
    w.advance(w.settings.status_interval_seconds)
    w.beat(11)  # rank 0 moved on: the highest step reported moves with it
    kinds = [type(a).__name__ for a in w.step().actions]
    assert kinds == ["PatchStatus"]
    w.beat(12)
    assert [type(a).__name__ for a in w.step().actions] == []  # not due again yet
    w.fail(1)
    kinds = [type(a).__name__ for a in w.step().actions]
    assert "PatchState" in kinds and kinds.index("PatchState") < kinds.index("PatchStatus")
    assert w.state.high_step == 12  # written by the pass that ended the attempt


def test_running_once_every_pod_runs_then_succeeded_when_all_exit_zero() -> None:
    w = World()
    w.step()
    w.schedule()
    w.step()
    assert w.status.phase == "Running"
    assert {c.type: c.status for c in w.status.conditions}["Running"] == "True"
    w.run(30, step=60)
    w.succeed_all()
    w.step()
    assert w.status.phase == "Succeeded"
    assert w.status.completion_time is not None
    assert Reason.COMPLETED in w.reasons()
    assert w.status.restarts.total == 0


def test_pending_until_every_pod_runs() -> None:
    w = World(nodes=("node-a",))  # room for one of the two workers
    w.step()
    w.schedule()
    w.step()
    assert w.status.phase == "Pending"
    w.run(120)
    assert w.status.phase == "Pending" and w.status.restarts.total == 0


def test_succeeded_job_keeps_its_finished_pods_and_is_deleted_after_ttl() -> None:
    w = World(raw_spec(ttlSecondsAfterFinished=100))
    w.until("Running")
    w.succeed_all()
    w.step()
    assert w.status.phase == "Succeeded"
    d = w.step()
    assert not any(isinstance(a, DeletePod) for a in d.actions)
    assert d.requeue_after == pytest.approx(100, abs=1)
    w.advance(101)
    assert any(isinstance(a, DeleteJob) for a in w.step().actions)


def test_progress_comes_from_the_leases_at_a_bounded_rate() -> None:
    w = World()
    w.until("Running")
    w.beat(10, loss=3.2, tokens_per_second=5000.0)
    w.step()
    writes = w.status_writes
    for step in range(11, 20):
        w.advance(1)
        w.beat(step, loss=3.0)
        d = w.step()
        assert d.status.progress.step == step  # what metrics see: always fresh
    assert w.status_writes - writes <= 1  # what the API server sees: at most every 10 s
    w.advance(10)
    w.beat(25, loss=2.5, checkpoint_step=20)
    w.step()
    assert w.status.progress.step == 25 and w.status.progress.loss == 2.5
    assert w.status.latest_checkpoint is not None and w.status.latest_checkpoint.step == 20


def test_ready_condition_once_every_worker_trains() -> None:
    w = World()
    w.until("Running")
    w.beat(0, phase="compiling")
    w.step()
    assert {c.type: c.status for c in w.status.conditions}.get("Ready") != "True"
    w.beat(1)
    w.step()
    assert {c.type: c.status for c in w.status.conditions}["Ready"] == "True"


def test_suspend_deletes_the_pods_keeps_progress_and_resume_starts_a_new_attempt() -> None:
    w = World()
    w.until("Running")
    w.beat(20, checkpoint_step=20)
    w.step()
    w.beat(30, checkpoint_step=20)
    w.step()
    w.spec["suspend"] = True
    w.step()
    # a Ready gang is asked for a checkpoint now (step 31 or later: ten steps since 20 kept)
    # and runs on until it is complete
    assert w.status.phase == "Running" and len(w.pods) == 2
    assert {(a.name, a.annotations[CHECKPOINT_REQUEST]) for a in w.lease_patches} == {
        ("tiny-a0-0", "31"), ("tiny-a0-1", "31")}
    said = [e.message for e in w.events if e.reason == Reason.SUSPENDED]
    assert said and "checkpoint now (step 31 or later)" in said[-1], said
    w.advance(1)
    w.beat(32, checkpoint_step=20)
    w.step()
    assert w.status.phase == "Running"
    w.beat(33, checkpoint_step=32)
    w.step()
    assert w.status.phase == "Suspended"
    w.run(3)
    assert not w.pods
    assert w.status.progress.step == 33 and w.status.latest_checkpoint.step == 32  # type: ignore[union-attr]
    w.run(50)
    assert w.status.phase == "Suspended" and w.status.restarts.total == 0
    w.spec["suspend"] = False
    created = [a.obj for a in w.step().actions
               if isinstance(a, CreateObject) and a.obj["kind"] == "Pod"]
    assert w.status.phase == "Pending" and w.status.attempt == 1
    assert sorted(w.pods) == ["tiny-a1-0", "tiny-a1-1"]
    # the steps trained before the suspension are the new gang's recomputed work (the
    # highest step is written by the suspending pass: no fault moved the state)
    env = {e["name"]: e.get("value") for e in created[0]["spec"]["containers"][0]["env"]}
    assert env["HLAT_STEPS_DONE"] == "33"
    assert w.status.restarts.total == 0
    assert Reason.RESUMED in w.reasons()


def test_a_resume_waits_for_the_suspended_gang_to_be_gone() -> None:
    """A pod on a node that went NotReady lingers after the suspension deleted it: resuming
    creates nothing until it is gone, then starts the next attempt."""
    w = World()
    w.until("Running")
    node = w.pod_of(0).node
    assert node is not None
    w.node_down(node)
    w.spec["suspend"] = True
    w.step()
    assert w.status.phase == "Suspended" and [p.name for p in w.pods.values()] == ["tiny-a0-0"]
    w.spec["suspend"] = False
    w.run(3)
    assert w.status.phase == "Suspended" and sorted(w.pods) == ["tiny-a0-0"]
    w.node_up(node)
    del w.pods["tiny-a0-0"]  # its kubelet is back and confirms the deletion
    w.step()
    assert w.status.phase == "Pending" and w.status.attempt == 1
    assert sorted(w.pods) == ["tiny-a1-0", "tiny-a1-1"]


def test_a_job_created_suspended_creates_nothing() -> None:
    w = World(raw_spec(suspend=True))
    w.step()
    assert w.status.phase == "Suspended" and not w.pods and w.status.start_time is None
    w.spec["suspend"] = False
    w.step()
    assert w.status.attempt == 0 and len(w.pods) == 2


def test_suspended_time_counts_neither_up_nor_down() -> None:
    w = World()
    w.until("Running")
    w.run(20, step=5)
    w.spec["suspend"] = True
    w.step()
    w.beat(6, checkpoint_step=6)  # the checkpoint asked for at the suspension
    w.step()
    assert w.status.phase == "Suspended"
    up = w.status.uptime
    w.advance(1000)
    w.step()
    assert w.status.uptime.running_seconds == pytest.approx(up.running_seconds)
    assert w.status.uptime.down_seconds == pytest.approx(up.down_seconds)


def test_active_deadline_fails_the_job_and_stops_its_pods() -> None:
    w = World(raw_spec(activeDeadlineSeconds=60))
    w.until("Running")
    w.run(58, step=5)
    assert w.status.phase == "Running"
    w.run(3, step=6)
    assert w.status.phase == "Failed"
    fail = {c.type: c for c in w.status.conditions}["Failed"]
    assert fail.status == "True" and fail.reason == Reason.DEADLINE_EXCEEDED
    assert not w.live()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"nodes": 0}, "spec.nodes"),
        ({"instanceType": "trn9.huge"}, "spec.instanceType"),
        ({"parallelism": {"tensor": 3}}, "spec.parallelism.tensor"),
        ({"train.steps": None}, "spec.train"),
        ({"data": None}, "spec.data"),
        ({"optimizer.minLr": 1.0}, "spec.optimizer.minLr"),
        ({"bogusField": 1}, "spec.bogusField"),
        ({"image": None}, "spec.image"),
    ],
)
def test_an_invalid_spec_is_failed_with_the_field_and_reason(
    overrides: dict[str, Any], field: str
) -> None:
    w = World(raw_spec(**overrides))
    w.step()
    assert w.status.phase == "Failed" and not w.pods
    cond = {c.type: c for c in w.status.conditions}["Failed"]
    assert cond.reason == Reason.INVALID_SPEC
    assert field in cond.message
    assert w.events[-1].type == "Warning" and w.events[-1].reason == Reason.INVALID_SPEC


def test_the_operator_default_image_fills_a_missing_image() -> None:
    w = World(raw_spec(image=None), settings=SETTINGS.model_copy(update={"default_image": "img:1"}))
    w.step()
    assert w.status.phase == "Pending" and len(w.pods) == 2


def test_conditions_keep_their_transition_time_while_unchanged() -> None:
    w = World()
    w.until("Running")
    first = {c.type: c for c in w.status.conditions}["Running"].last_transition_time
    w.run(30, step=5)
    assert {c.type: c for c in w.status.conditions}["Running"].last_transition_time == first


def test_status_write_carries_the_resource_version_for_optimistic_concurrency() -> None:
    obs = Observed(job=JOB, resource_version="42")
    d = decide(raw_spec(), PretrainJobStatus(), obs, at(0), SETTINGS)
    patch = next(a for a in d.actions if isinstance(a, PatchStatus))
    assert patch.resource_version == "42"
    assert patch.status["phase"] == "Pending" and patch.status["attempt"] == 0


def test_leases_of_the_attempt_are_precreated_and_old_ones_removed() -> None:
    w = World()
    w.until("Running")
    assert set(w.leases) == {lease_name("tiny-a0-0"), lease_name("tiny-a0-1")}
    w.fail(0)
    w.step()
    assert w.status.phase == "Restarting"
    w.until("Running")
    assert set(w.leases) == {lease_name("tiny-a1-0"), lease_name("tiny-a1-1")}
    role = w.objects[("Role", labels.service_account_name("tiny"))]
    assert role["rules"][0]["resourceNames"] == ["tiny-a1-0", "tiny-a1-1"]


def test_a_sidecar_neither_keeps_a_finished_job_running_nor_its_nodes_held() -> None:
    """A plain sidecar container (not a native one) keeps the pod Running after the trainer
    exited 0: the worker is finished (the trainer container says so), the job Succeeds, and
    those pods are deleted (they hold the nodes' devices) while pods that ended are kept."""
    from hlat_operator.observe import pod_from_raw

    raw = {"metadata": {"name": "tiny-a0-0", "labels": {labels.ATTEMPT: "0",
                                                         labels.NODE_RANK: "0"}},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "log-shipper", "state": {"running": {"startedAt": "2025-01-01T00:00:00Z"}}},
               {"name": "trainer", "state": {"terminated": {"exitCode": 0,
                                                            "startedAt": "2025-01-01T00:00:00Z"}}}]}}
    pod = pod_from_raw(raw)
    assert pod.phase == "Succeeded" and pod.lingering and pod.exit_code == 0
    raw["status"]["containerStatuses"][1]["state"]["terminated"]["exitCode"] = 1
    assert pod_from_raw(raw).phase == "Failed"

    w = World(raw_spec())
    w.until("Running")
    w.succeed_all()
    first = w.pod_of(0)
    w.pods[first.name] = replace(first, lingering=True)  # rank 0's sidecar still runs
    d = w.step()
    assert w.status.phase == "Succeeded"
    w.advance(1)
    d = w.step()
    deleted = [a.name for a in d.actions if isinstance(a, DeletePod)]
    assert deleted == [first.name]  # rank 1's ended pod is kept for its logs
