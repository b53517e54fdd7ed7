"""Progress, checkpoints, uptime and lost steps: what a job has achieved, from what was observed.

Pure functions of heartbeats, the previous figures and the clock, used by `reconcile.decide`.

Uptime (the paper's Table 1 measure): running seconds are the time spent in phase Running;
down seconds the time in Pending or Restarting after the job first ran; Suspended time is
neither. ratio = running / (running + down). Time is accounted from the previous pass's
`accounted_at` to `now`, in the phase the previous pass left the job in.
"""

from __future__ import annotations

from datetime import datetime

from hlat_api.heartbeat import Heartbeat
from hlat_api.status import CheckpointRef, Phase, Progress, Uptime

RESUMING_PHASES = ("starting", "compiling")
"""A worker in these phases has not resumed yet: it reports step 0, not the job's progress."""


def progress_of(beats: list[Heartbeat | None], total_steps: int | None = None
                ) -> Progress | None:
    """The gang's progress from its workers' heartbeats (`beats[0]`: rank 0's, whose loss and
    throughput are reported when it has any); None until one of them has resumed training, so
    that a restarted job is not shown back at step 0. With `total_steps`: the summary and ETA
    `kubectl get pj` shows."""
    live = [b for b in beats if b is not None and b.phase not in RESUMING_PHASES]
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
             if b is not None and b.phase not in RESUMING_PHASES and b.checkpoint_step is not None]
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
