"""Progress, checkpoints, uptime, goodput and lost steps: what a job has achieved, from what
was observed.

Pure functions of heartbeats, the previous figures and the clock, used by `reconcile.decide`.
Time is accounted from the previous pass's `accounted_at` to `now`, in the state the previous
pass left the job in; each pass's figures are written with the status they belong to, so a
replayed pass (its write refused) or an operator restart neither loses nor counts time twice.

Uptime (the paper's Table 1 measure): running seconds are the time spent in phase Running;
down seconds the time in Pending or Restarting after the job first ran; Suspended time is
neither. ratio = running / (running + down).

Goodput (Google's ML Goodput measure): productive seconds over wall seconds since the first
gang was created, Suspended time excluded. The wall clock is split three ways:
- Restarting: teardown until the old gang is gone, then backoff.
- An attempt's window (Pending and Running): node rank 0's trainer reports its seconds per
  activity (`hlat_api.heartbeat.Activity`, up to its last report). The window's time before the
  trainer's clock began is pending, fixed at its first report (the window then, less what it
  reported and the time since its report); the rest is not reported yet (`unreported`). When
  the attempt ends the rest gets its cause: detection after a fault (the last report to the
  operator acting on it), other otherwise.
- Attempts that ended are folded into `settled`, in the same status write as the phase change
  that ended them; the running attempt's ledger (`current`) is recomputed from its latest
  report every pass.
- Steps an attempt trained after its last report are in the time its end was charged to. When
  the next attempt resumes from a state that holds them (an in-memory snapshot taken since),
  its trainer reports their seconds (`carriedSeconds`, from the state), and they move from that
  cause to productive, once. Steps the next attempt trains again count there (`recompute` up to
  the last step reported, productive after).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from hlat_api.heartbeat import STARTING_PHASES, Activity, Heartbeat
from hlat_api.status import (
    AttemptLedger,
    Badput,
    Breakdown,
    CheckpointRef,
    Goodput,
    Phase,
    Progress,
    Uptime,
)

Bucket = Literal["attempt", "teardown", "backoff", "resize"]
"""Where the time since the previous pass goes: the running attempt's window, or the restart
between two attempts (a planned resize's teardown is `resize`)."""
EndCause = Literal["detection", "other"]
TRAINER_CAUSES = tuple(k for k in Activity.model_fields if k != "productive")



def progress_of(beats: list[Heartbeat | None], total_steps: int | None = None,
                previous: Progress | None = None) -> Progress | None:
    """The gang's progress from its workers' heartbeats (`beats[0]`: rank 0's, whose loss and
    throughput are reported when it has any); None until one of them has resumed training, so
    that a restarted job is not shown back at step 0. With `total_steps`: the summary and ETA
    `kubectl get pj` shows. The validation loss is the latest any gang reported: `previous`'s
    until this gang evaluates (a gang resumed after the last evaluation, from the final
    checkpoint say, reports none)."""
    live = [b for b in beats if b is not None and b.phase not in STARTING_PHASES]
    if not live:
        return None
    first = beats[0]
    lead = first if first is not None and any(b is first for b in live) else max(
        live, key=lambda b: b.step)
    step = max(b.step for b in live)
    progress = Progress(
        step=step,
        tokens=max(b.tokens for b in live),
        loss=lead.loss,
        tokens_per_second=lead.tokens_per_second,
        loss_text=None if lead.loss is None else f"{lead.loss:.4g}",
    )
    evaluated = max((b for b in live if b.validation_loss is not None),
                    key=lambda b: b.validation_step or 0, default=None)
    if evaluated is not None and evaluated.validation_loss is not None:
        progress.validation_loss = evaluated.validation_loss
        progress.validation_step = evaluated.validation_step
        progress.validation_loss_text = f"{evaluated.validation_loss:.4g}"
    elif previous is not None and previous.validation_loss is not None:
        progress.validation_loss = previous.validation_loss
        progress.validation_step = previous.validation_step
        progress.validation_loss_text = previous.validation_loss_text
    if total_steps:
        progress.total_steps = total_steps
        progress.summary = f"{step}/{total_steps} ({100 * step / total_steps:.1f}%)"
        if lead.step_seconds is not None:
            progress.eta_seconds = round(max(0, total_steps - step) * lead.step_seconds, 1)
    return progress


def newer_checkpoint(beats: list[Heartbeat | None], known: CheckpointRef | None,
                     stamp: str) -> CheckpointRef | None:
    """A checkpoint newer than `known` that a resumed worker reports complete, else None."""
    steps = [b.checkpoint_step for b in beats
             if b is not None and b.phase not in STARTING_PHASES and b.checkpoint_step is not None]
    if steps and max(steps) > (known.step if known else -1):
        return CheckpointRef(step=max(steps), time=stamp)
    return None


def uptime_after(old: Uptime, old_phase: Phase | None, since: datetime | None,
                 now: datetime) -> Uptime:
    """`old` plus the time from `since` to `now` spent in `old_phase`."""
    running, down = old.running_seconds, old.down_seconds
    if since is not None and now > since:
        dt = (now - since).total_seconds()
        if old_phase == "Running":
            running += dt
        elif old_phase in ("Pending", "Restarting") and running > 0:
            down += dt
    total = running + down
    return Uptime(
        running_seconds=round(running, 3),
        down_seconds=round(down, 3),
        ratio=round(running / total, 6) if total > 0 else None,
    )


def lost_steps(steps: list[int], checkpoint: int) -> int:
    """Steps an attempt computed past the checkpoint the next attempt resumes from."""
    return max(0, max(steps, default=0) - max(checkpoint, 0))


def _add(badput: Badput, **seconds: float) -> Badput:
    values = badput.model_dump()
    for cause, value in seconds.items():
        values[cause] += value
    return Badput(**{k: round(v, 3) for k, v in values.items()})


def _attempt_parts(ledger: AttemptLedger) -> tuple[float, dict[str, float], float]:
    """(productive, badput by cause, unreported) of an attempt so far."""
    reported = ledger.reported or Activity()
    pending = ledger.pending_seconds or 0.0
    causes = {cause: getattr(reported, cause) for cause in TRAINER_CAUSES}
    causes["pending"] = pending
    rest = max(0.0, ledger.window_seconds - pending - reported.total())
    return reported.productive, causes, rest


def _fold(settled: Breakdown, ledger: AttemptLedger, end: EndCause) -> Breakdown:
    """An ended attempt's figures, final: its unreported rest goes to `end` (all of it to
    pending when its trainer never reported: nothing ran that anyone saw)."""
    productive, causes, rest = _attempt_parts(ledger)
    if ledger.reported is None:
        causes["pending"] += rest
    else:
        causes[end] = causes.get(end, 0.0) + rest
    return Breakdown(productive=round(settled.productive + productive, 3),
                     badput=_add(settled.badput, **causes))


def _credit(settled: Breakdown, seconds: float) -> tuple[Breakdown, float]:
    """Steps an ended attempt trained after its last report, which the next one resumed from
    (a snapshot taken since): their time, charged to the attempt's end (detection, else
    other), is productive. Returns the seconds moved: at most what those causes hold."""
    taken: dict[str, float] = {}
    for cause in ("detection", "other"):
        taken[cause] = min(getattr(settled.badput, cause), seconds - sum(taken.values()))
    moved = sum(taken.values())
    return Breakdown(productive=round(settled.productive + moved, 3),
                     badput=_add(settled.badput, **{k: -v for k, v in taken.items()})), moved


def goodput_after(old: Goodput, bucket: Bucket | None, since: datetime | None, now: datetime,
                  attempt: int, lead: Heartbeat | None, end: EndCause | None = None,
                  lost_work_seconds: float = 0.0, checkpoint_at: datetime | None = None,
                  max_report_age: float = 30.0, straggler_share: float = 0.0,
                  straggler_seconds: float = 0.0,
                  training_nodes: tuple[int, int] | None = None) -> Goodput:
    """`old` plus the time from `since` to `now` spent in `bucket`, with node rank 0's latest
    report (`lead`, of the running `attempt`); `end`: the attempt ended in this pass, and the
    cause of its unreported rest. `max_report_age` bounds how old the report is taken to be
    (its `progress_time` is the worker's clock: a clock off by a minute must not move a minute
    between causes). `straggler_share`: the share of the attempt's time since `since` a slow
    node cost (its compute over the others' median, per step), moved from productive to the
    `straggler` cause (it is in the trainer's productive steps; only the operator compares
    nodes); `straggler_seconds`: moved as well, before that (a node's window, on the pass that
    flags it). `training_nodes`: (nodes trained on, spec.nodes) when the time from `since` was
    spent Running: the capacity fraction's node-seconds."""
    g = old.model_copy(deep=True)
    dt = (now - since).total_seconds() if since is not None and now > since else 0.0
    if training_nodes is not None:
        g.node_seconds = round(g.node_seconds + dt * training_nodes[0], 3)
        g.desired_node_seconds = round(g.desired_node_seconds + dt * training_nodes[1], 3)
    g.capacity = (round(g.node_seconds / g.desired_node_seconds, 6)
                  if g.desired_node_seconds > 0 else None)
    current = g.current
    if current is not None and current.attempt != attempt:  # ended unseen: fold it as it was
        g.settled, current = _fold(g.settled, current, "other"), None
    if bucket is not None:
        g.wall_seconds = round(g.wall_seconds + dt, 3)
        if bucket == "attempt":
            current = current or AttemptLedger(attempt=attempt)
            current.window_seconds = round(current.window_seconds + dt, 3)
            if straggler_share > 0 or straggler_seconds > 0:  # never more than trained
                trained = g.settled.productive + (
                    current.reported.productive if current.reported is not None else 0.0)
                lost = min(dt * min(straggler_share, 1.0) + max(0.0, straggler_seconds),
                           max(0.0, trained))
                g.settled = Breakdown(productive=round(g.settled.productive - lost, 3),
                                      badput=_add(g.settled.badput, straggler=lost))
        else:
            g.settled = Breakdown(productive=g.settled.productive,
                                  badput=_add(g.settled.badput, **{bucket: dt}))
    if lead is not None and lead.activity is not None:
        current = current or AttemptLedger(attempt=attempt)
        current.reported = lead.activity
        carried = lead.carried_seconds or 0.0
        if carried > current.carried_seconds:
            g.settled, moved = _credit(g.settled, carried - current.carried_seconds)
            current.carried_seconds = round(current.carried_seconds + moved, 3)
        if current.pending_seconds is None:
            reported_at = lead.progress_time or now
            tail = min(max(0.0, (now - reported_at).total_seconds()), max_report_age)
            current.pending_seconds = round(
                max(0.0, current.window_seconds - lead.activity.total() - tail), 3)
    if end is not None and current is not None:
        g.settled, current = _fold(g.settled, current, end), None
    g.current = current
    productive, badput, unreported = g.settled.productive, g.settled.badput, 0.0
    if current is not None:
        more, causes, unreported = _attempt_parts(current)
        productive += more
        badput = _add(badput, **causes, unreported=unreported)
    g.productive_seconds = round(productive, 3)
    g.badput_seconds = badput
    g.ratio = round(productive / g.wall_seconds, 6) if g.wall_seconds > 0 else None
    g.lost_work_seconds = round(g.lost_work_seconds + lost_work_seconds, 3)
    g.checkpoint_age_seconds = (round(max(0.0, (now - checkpoint_at).total_seconds()), 1)
                                if checkpoint_at is not None else None)
    return g
