"""A job with in-memory snapshots (checkpoint.memoryInterval), decided with a fake clock: the
work a restart in place loses is counted from the snapshot every worker holds, corrected by
where the next attempt says it resumed, and a run that makes progress only in memory is not
failed for making none."""

from __future__ import annotations

from opfakes import World, raw_spec
from test_reconcile_inplace import restart


def snapshot_world(**over: object) -> World:
    w = World(raw_spec(**{"faultTolerance.restartStrategy": "InPlace",
                          "checkpoint.memoryInterval": 1, **over}))
    w.until("Running")
    return w


def restarting(w: World) -> bool:
    return any(c.type == "Restarting" and c.status == "True" for c in w.status.conditions)


def crash(w: World, rank: int) -> int:
    """Rank `rank`'s trainer SIGKILLed, and the pass that sees it; returns the attempt hit."""
    hit = w.status.attempt
    w.trainer_exit(rank, 137)
    w.step()
    return hit


def test_a_trainer_crash_loses_the_steps_since_the_snapshot_every_worker_holds() -> None:
    w = snapshot_world()
    w.beat(27, checkpoint_step=20, snapshot_step=26)  # a step in flight past the snapshot
    w.step()
    hit = crash(w, 1)
    assert w.status.restarts.total == 1 and restarting(w)
    assert w.status.lost_steps == 1
    assert w.status.goodput.lost_work_seconds == 0  # counted once the next attempt confirms
    restart(w, hit)
    w.beat(26, "starting", resumed_step=26)
    w.step()
    assert w.status.lost_steps == 1  # it resumed where the restart counted from
    assert w.status.goodput.lost_work_seconds == 0.5


def test_an_attempt_that_resumed_from_the_durable_checkpoint_counts_the_steps_back_to_it(
) -> None:
    """A pod lost with its memory (or a torn snapshot): the next attempt resumes from the
    durable step_20, so steps 21 to 27 were lost, not 27 alone."""
    w = snapshot_world()
    w.beat(27, checkpoint_step=20, snapshot_step=26)
    w.step()
    hit = crash(w, 0)
    restart(w, hit)
    w.beat(20, "starting", resumed_step=20)
    w.step()
    assert w.status.lost_steps == 7
    assert w.status.goodput.lost_work_seconds == 3.5
    w.beat(24, resumed_step=20)
    w.step()
    assert w.status.lost_steps == 7  # counted once


def test_faults_between_durable_checkpoints_are_progress_when_the_snapshots_move_on() -> None:
    """noProgressRestarts 1: three trainer crashes inside one durable interval, each after the
    snapshots moved past where its attempt resumed, do not fail the job."""
    w = snapshot_world(**{"faultTolerance.noProgressRestarts": 1,
                          "faultTolerance.maxRestarts": 10})
    resumed = 0
    for at in (5, 9, 13):
        w.beat(at, checkpoint_step=None, snapshot_step=at, resumed_step=resumed)
        w.step()
        hit = crash(w, 1)
        assert restarting(w), w.status.conditions
        restart(w, hit)
        resumed = at
    w.beat(resumed, "starting", resumed_step=resumed)
    w.step()
    assert w.status.phase != "Failed" and w.status.restarts.total == 3


def test_faults_with_no_snapshot_newer_than_the_attempt_s_start_are_no_progress() -> None:
    w = snapshot_world(**{"faultTolerance.noProgressRestarts": 1,
                          "faultTolerance.maxRestarts": 10})
    w.beat(5, snapshot_step=5, resumed_step=0)
    w.step()
    hit = crash(w, 1)
    restart(w, hit)
    for _ in range(2):  # resumed from 5, crashed before the next snapshot
        w.beat(5, snapshot_step=5, resumed_step=5)
        w.step()
        hit = crash(w, 1)
        if w.status.phase == "Failed":
            break
        restart(w, hit)
    assert w.status.phase == "Failed"
    assert "without a new complete checkpoint" in (w.status.conditions[-1].message or "") or any(
        "noProgressRestarts" in (c.message or "") for c in w.status.conditions)


def test_lost_work_only_grows_when_the_next_attempt_resumed_past_the_count() -> None:
    """A snapshot completed after the restart's last look: the next attempt resumed from step
    27, so nothing was lost. lostSteps (a gauge) goes back to 0; lostWorkSeconds, which the
    counter hlat_job_lost_work_seconds_total follows and which can never go back, never
    counted the step at all."""
    w = snapshot_world()
    w.beat(27, checkpoint_step=20, snapshot_step=26)
    w.step()
    hit = crash(w, 1)
    assert w.status.lost_steps == 1
    seen = [w.status.goodput.lost_work_seconds]
    restart(w, hit)
    w.beat(27, "starting", resumed_step=27)
    w.step()
    seen.append(w.status.goodput.lost_work_seconds)
    assert w.status.lost_steps == 0 and seen == [0, 0], seen


def test_a_restart_whose_attempt_never_reported_keeps_its_lost_work_as_counted() -> None:
    """Two restarts, the first attempt after the fault dead before it said where it resumed:
    the first restart's step stays counted when the second is made."""
    w = snapshot_world()
    w.beat(27, checkpoint_step=20, snapshot_step=26)
    w.step()
    hit = crash(w, 1)
    restart(w, hit)
    w.trainer_exit(1, 137)  # before any report of the new attempt
    w.step()
    assert w.status.restarts.total == 2
    assert w.status.goodput.lost_work_seconds == 0.5, w.status.goodput
