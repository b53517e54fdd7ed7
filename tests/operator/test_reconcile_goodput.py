"""Goodput accounting: decide() on a fake clock with a scripted trainer, against a stopwatch.

The script is the issue's replay: a gang starts, trains 100 s, a worker is killed, the new gang
compiles for 1,200 s, recomputes, trains 100 s and finishes. Uptime calls that about 99% up;
goodput must say how little of it trained, and where the rest went, cause by cause, whether
or not the operator was stopped, restarted or crashed mid-pass along the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from opfakes import World, raw_spec

from hlat_api.heartbeat import Activity, lease_name
from hlat_api.status import Goodput
from hlat_operator import accounting
from hlat_operator.observe import ObservedLease
from hlat_operator.reconcile import CreateObject


@dataclass
class Trainer:
    """Node rank 0's ledger, as hlat_trainer.ledger keeps it: each second to one activity."""

    seconds: dict[str, float] = field(default_factory=dict)

    def spend(self, activity: str, dt: float = 1.0) -> None:
        self.seconds[activity] = self.seconds.get(activity, 0.0) + dt

    def activity(self) -> Activity:
        return Activity(**self.seconds)


PLAN = [("startup", 5), ("productive", 100), ("kill", 0),
        ("startup", 5), ("compile", 1200), ("restore", 3), ("recompute", 10),
        ("productive", 100), ("finish", 0)]  # fmt: skip


@dataclass
class Run:
    world: World
    stopwatch: dict[str, float]
    """What the script knows each second was spent on (pending: pods created, no trainer)."""


def replay(operator_down: tuple[tuple[float, float], ...] = (), crash_every: int = 0) -> Run:
    """Run PLAN second by second. `operator_down`: (from, to) seconds with no operator pass;
    `crash_every`: every n-th pass applies only its first action (the state annotation), as
    an operator killed between its two writes."""
    w = World(raw_spec(**{"faultTolerance.backoff.initialSeconds": 4}))
    plan = list(PLAN)
    trainer: Trainer | None = None
    trained = -1  # the last attempt a trainer started in
    stopwatch: dict[str, float] = {}
    t, passes, step = 0.0, 0, 0
    while w.status.phase != "Succeeded":
        assert t < 3000, f"stuck in {w.status.phase}"
        w.schedule()
        running = w.status.phase in ("Pending", "Running") and any(
            p.attempt == w.status.attempt and p.phase == "Running" for p in w.pods.values())
        if running and w.status.attempt > trained:
            trainer, trained = Trainer(), w.status.attempt
        if trainer is not None and plan:
            what, left = plan[0]
            if what == "kill":
                plan.pop(0)
                w.fail(1)
                trainer = None
            elif what == "finish":
                plan.pop(0)
                w.beat(step, "finished", activity=trainer.activity(), progress_time=w.now)
                w.succeed_all()
            else:
                trainer.spend(what)
                step += what in ("productive", "recompute")
                plan[0] = (what, left - 1)
                if left - 1 <= 0:
                    plan.pop(0)
                w.beat(step, "compiling" if what == "compile" else "training",
                       activity=trainer.activity(), progress_time=w.now)
        up = not any(a <= t < b for a, b in operator_down)
        if up:
            passes += 1
            w.step(crash_after=1 if crash_every and passes % crash_every == 0 else None)
        w.advance(1)
        t += 1
    # the stopwatch: the plan's own seconds (pending, detection, teardown, backoff are what
    # the operator's clock saw outside them)
    for what, seconds in PLAN:
        if seconds:
            stopwatch[what] = stopwatch.get(what, 0) + seconds
    return Run(w, stopwatch)


def parts(g: Goodput) -> float:
    return g.productive_seconds + sum(g.badput_seconds.model_dump().values())


def test_goodput_tells_how_little_trained_where_uptime_says_almost_all() -> None:
    run = replay()
    s = run.world.status
    g = s.goodput
    assert s.uptime.ratio is not None and s.uptime.ratio > 0.98
    assert g.productive_seconds == pytest.approx(200, abs=1)
    assert g.ratio == pytest.approx(200 / g.wall_seconds, abs=1e-3)
    assert g.ratio is not None and g.ratio < 0.15
    b = g.badput_seconds
    assert b.compile == pytest.approx(1200, abs=1)
    assert b.startup == pytest.approx(10, abs=1)
    assert b.restore == pytest.approx(3, abs=1)
    assert b.recompute == pytest.approx(10, abs=1)
    # the operator's own intervals: the kill is seen at the next pass, the gang goes at once,
    # then the 4 s backoff; pending is the time before each trainer began (scheduling)
    assert 0 < b.detection <= 2
    assert b.backoff == pytest.approx(4, abs=1)
    assert b.pending <= 3 and b.unreported == 0
    assert parts(g) == pytest.approx(g.wall_seconds, abs=0.01)
    assert g.current is None  # every attempt settled
    # a finished job's figures are final
    frozen = g
    run.world.advance(600)
    run.world.step()
    assert run.world.status.goodput == frozen


def test_an_operator_stopped_or_crashing_mid_pass_neither_loses_nor_double_counts() -> None:
    steady = replay().world.status.goodput
    bumpy = replay(operator_down=((30, 90), (400, 460)), crash_every=7).world.status.goodput
    assert bumpy.wall_seconds == pytest.approx(steady.wall_seconds, abs=1)
    assert bumpy.productive_seconds == pytest.approx(steady.productive_seconds, abs=0.01)
    b, a = bumpy.badput_seconds, steady.badput_seconds
    for cause in ("startup", "compile", "restore", "recompute"):
        assert getattr(b, cause) == pytest.approx(getattr(a, cause), abs=0.01), cause
    assert parts(bumpy) == pytest.approx(bumpy.wall_seconds, abs=0.01)


def test_a_kill_unseen_for_a_minute_is_detection_not_training() -> None:
    """The operator is down when the worker dies: the minute until it acts is detection."""
    run = replay(operator_down=((104, 164),))
    b = run.world.status.goodput.badput_seconds
    assert b.detection == pytest.approx(60, abs=3)
    assert run.world.status.goodput.productive_seconds == pytest.approx(200, abs=1)


def test_a_replayed_pass_folds_an_ended_attempt_once() -> None:
    """The pass that ends an attempt, decided twice from the same status (its write was
    refused), settles the attempt once."""
    w = World(raw_spec())
    w.until("Running")
    trainer = Trainer()
    for _ in range(30):
        trainer.spend("productive")
        w.beat(1, activity=trainer.activity(), progress_time=w.now)
        w.step()
        w.advance(1)
    w.fail(0)
    first, again = w.decide(), w.decide()
    assert first.status.goodput == again.status.goodput
    w.step()
    assert w.status.phase == "Restarting"
    assert w.status.goodput.settled.productive == pytest.approx(30, abs=0.01)
    w.step()
    assert w.status.goodput.settled.productive == pytest.approx(30, abs=0.01)


def test_time_the_trainer_has_not_reported_is_provisional_until_it_does() -> None:
    """Before the first report the attempt's time is unreported; the report turns it into
    pending (before the trainer's clock began) and what the trainer says it spent."""
    w = World(raw_spec())
    w.until("Running")
    for _ in range(10):
        w.step()
        w.advance(1)
    early = w.status.goodput
    assert early.badput_seconds.unreported > 0 and early.productive_seconds == 0
    trainer = Trainer()
    trainer.spend("startup", 8)
    w.beat(0, "starting", activity=trainer.activity(), progress_time=w.now)
    g = w.step().status.goodput  # what the metrics see (the status is written at its interval)
    assert g.badput_seconds.startup == 8
    assert g.badput_seconds.unreported == pytest.approx(0, abs=0.01)
    assert g.badput_seconds.pending == pytest.approx(g.wall_seconds - 8, abs=0.01)


def test_lost_work_is_lost_steps_at_the_step_time_of_the_fault() -> None:
    w = World(raw_spec(**{"checkpoint.interval": 20}))
    w.until("Running")
    w.beat(25, activity=Activity(productive=12.5), progress_time=w.now, checkpoint_step=20,
           step_seconds=0.5)
    w.step()
    w.fail(0)
    w.step()
    assert w.status.lost_steps == 5
    assert w.status.goodput.lost_work_seconds == pytest.approx(2.5)


def test_goodput_after_is_pure_arithmetic_on_the_buckets() -> None:
    """The rules on their own: time goes to the bucket the previous pass left."""
    from datetime import UTC, datetime, timedelta

    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    g = accounting.goodput_after(Goodput(), "teardown", t0, t0 + timedelta(seconds=3), 0, None)
    g = accounting.goodput_after(g, "backoff", t0, t0 + timedelta(seconds=5), 1, None)
    g = accounting.goodput_after(g, None, t0, t0 + timedelta(seconds=100), 1, None)  # suspended
    assert g.wall_seconds == 8 and g.badput_seconds.teardown == 3
    assert g.badput_seconds.backoff == 5 and g.ratio == 0


def test_a_new_gang_waiting_for_nodes_is_pending_whatever_the_old_gang_reported() -> None:
    """The new gang's pods wait 20 s for nodes: pending, not time the old trainer reported
    (whose last Lease the operator still reads in the pass that creates the new gang)."""
    w = World(raw_spec(**{"faultTolerance.backoff.initialSeconds": 1}))
    w.until("Running")
    trainer = Trainer()
    for _ in range(30):
        trainer.spend("productive")
        w.beat(1, activity=trainer.activity(), progress_time=w.now)
        w.step()
        w.advance(1)
    w.fail(0)
    while w.status.attempt == 0:
        w.step()
        w.advance(1)
    for _ in range(20):  # no node for the new gang
        w.step()
        w.advance(1)
    w.schedule()
    fresh = Trainer()
    fresh.spend("startup", 2)
    w.beat(1, "starting", activity=fresh.activity(), progress_time=w.now)
    g = w.step().status.goodput
    assert g.current is not None and g.current.attempt == 1
    assert g.current.pending_seconds == pytest.approx(20, abs=1.5)
    assert g.badput_seconds.startup == 2 and g.productive_seconds == 30


@pytest.mark.parametrize("skew", [-60.0, 60.0])
def test_a_worker_clock_a_minute_off_moves_at_most_a_few_heartbeats_between_causes(
        skew: float) -> None:
    from datetime import timedelta

    w = World(raw_spec())
    w.until("Running")
    for _ in range(20):
        w.step()
        w.advance(1)
    trainer = Trainer()
    trainer.spend("startup", 5)
    w.beat(0, "starting", activity=trainer.activity(),
           progress_time=w.now + timedelta(seconds=skew))
    g = w.step().status.goodput
    assert g.current is not None and g.current.pending_seconds is not None
    exact = g.current.window_seconds - 5
    bound = 3 * w.settings.heartbeat_period_seconds
    assert abs(g.current.pending_seconds - exact) <= bound


def test_a_beat_after_the_fold_does_not_move_the_next_gang_s_recompute_boundary() -> None:
    """The surviving worker of a broken gang may report once more after its attempt's time was
    folded: the next gang's HLAT_STEPS_DONE stays the step that ledger counted as trained
    (steps past it were charged to detection, and the new gang trains them as new work)."""
    w = World(raw_spec(**{"faultTolerance.backoff.initialSeconds": 0}))
    w.until("Running")
    w.beat(10)
    w.step()
    lead = lease_name(w.pod_of(0).name)
    w.fail(1)
    w.step()
    assert w.status.phase == "Restarting"
    # node rank 0, terminating but still alive, reports two more steps
    beat = w.leases[lead].heartbeat
    assert beat is not None
    w.leases[lead] = ObservedLease(lead, w.now, beat.model_copy(update={"step": 12}))
    created: list[dict[str, Any]] = []
    for _ in range(120):
        w.advance(1)
        w.schedule()
        created += [a.obj for a in w.step().actions
                    if isinstance(a, CreateObject) and a.obj["kind"] == "Pod"]
        if created:
            break
    assert created, "no new gang"
    env = {e["name"]: e.get("value") for e in created[0]["spec"]["containers"][0]["env"]}
    assert env["HLAT_STEPS_DONE"] == "10"


def _next_gang_env(w: World) -> dict[str, str | None]:
    """Passes a second apart until the next gang's pods are created: their trainer's env."""
    for _ in range(60):
        w.advance(1)
        w.schedule()
        created = [a.obj for a in w.step().actions
                   if isinstance(a, CreateObject) and a.obj["kind"] == "Pod"]
        if created:
            return {e["name"]: e.get("value") for e in created[0]["spec"]["containers"][0]["env"]}
    raise AssertionError("no new gang")


def test_steps_trained_after_the_last_report_and_resumed_from_count_productive_once() -> None:
    """Rank 0 reports step 10 (10 s productive), trains 3 more steps and snapshots them, and
    its peer dies before the next renewal: those 3 s are charged to detection when the
    attempt ends. The next gang resumes from the snapshot of step 13 and its first beat carries
    their 3 s: they move from detection to productive, once however many passes read that
    beat, and every second is still in one cause. The gang after is told 13 were done, though
    the one before never reported a step of its own (it was compiling)."""
    w = World(raw_spec(**{"faultTolerance.backoff.initialSeconds": 0}))
    w.until("Running")
    trainer = Trainer()
    for step in range(1, 11):
        trainer.spend("productive")
        w.beat(step, activity=trainer.activity(), progress_time=w.now)
        w.step()
        w.advance(1)
    w.advance(3)  # steps 11 to 13, unreported
    w.fail(1)
    w.step()
    assert w.status.phase == "Restarting"
    detected = w.status.goodput.settled.badput.detection
    assert detected >= 3
    settled = w.status.goodput.settled.productive
    assert settled == pytest.approx(10, abs=0.01)
    assert _next_gang_env(w).get("HLAT_STEPS_DONE") == "10"
    w.schedule()
    w.advance(2)  # the new gang's start, before its first report
    resumed = Trainer()
    resumed.spend("startup")
    resumed.spend("memory_restore")
    for _ in range(5):
        # compiling its graphs (XLA): no step of its own yet, and 13 are done all the same
        w.beat(13, "compiling", activity=resumed.activity(), progress_time=w.now,
               resumed_step=13, carried_seconds=3.0)
        w.step()
        w.advance(1)
    g = w.status.goodput
    assert g.settled.productive == pytest.approx(13, abs=0.01)
    assert g.settled.badput.detection == pytest.approx(detected - 3, abs=0.01)
    assert g.productive_seconds == pytest.approx(13, abs=0.01)
    assert parts(g) == pytest.approx(g.wall_seconds, abs=0.01)
    w.fail(1)
    w.step()
    assert _next_gang_env(w).get("HLAT_STEPS_DONE") == "13"
