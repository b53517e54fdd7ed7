"""The checkpoint layout: `<dir>/<job>/step_<N>/`, complete if and only if `step_<N>/done` exists.

The same rule neuronx-distributed's checkpoint API uses. `done` is written last, after every
shard is durable; anything without it is never loaded and may be deleted. The operator reads
this layout (latest checkpoint, progress), the trainer writes it: both import these functions.

A reader of a complete checkpoint (an evaluation, `hlat-eval`) keeps a file under
`step_<N>/readers/` whose modification time it refreshes at least every
`READER_REFRESH_SECONDS` while it reads, and removes it when done; retention (keep-K) deletes no
checkpoint with a reader file younger than `READER_FRESH_SECONDS` (a reader that died stops
holding it after that). Any tool can take part: `touch step_<N>/readers/<name>` in a loop.

A checkpoint due for an evaluation Job (spec.evaluation) is held from the moment it is complete
until its evaluator takes over: the trainer writes `readers/evaluation-pending` dated ahead, to
the Job's deadline (`hold_ahead`), and the Job's sidecar (`hlat-eval --hold`) removes it once
its own reader file is there. Retention never races the Job's start, however quickly the
checkpoints come; an evaluation that never starts lets go at its deadline.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

DONE = "done"
READERS = "readers"
READER_REFRESH_SECONDS = 30.0
READER_FRESH_SECONDS = 120.0
_STEP_DIR = re.compile(r"^step_(\d+)$")


def job_dir(root: str | Path, job: str) -> Path:
    return Path(root) / job


def step_dir(root: str | Path, job: str, step: int) -> Path:
    return job_dir(root, job) / f"step_{step}"


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    path: Path

    @property
    def complete(self) -> bool:
        return (self.path / DONE).is_file()


def list_checkpoints(root: str | Path, job: str) -> list[CheckpointEntry]:
    """Every `step_<N>` directory of the job, complete or not, oldest first."""
    base = job_dir(root, job)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            found.append(CheckpointEntry(int(m.group(1)), child))
    return sorted(found, key=lambda e: e.step)


def latest_complete(root: str | Path, job: str) -> CheckpointEntry | None:
    complete = [e for e in list_checkpoints(root, job) if e.complete]
    return complete[-1] if complete else None


PENDING_READER = "evaluation-pending"
"""The reader file of an evaluation that has yet to start (`hold_ahead`)."""


def hold_ahead(path: Path, until: float) -> Path:
    """Hold the checkpoint at `path` for a reader yet to come: a reader file dated `until`
    (time.time() seconds), so that it stays fresh until `READER_FRESH_SECONDS` after that."""
    mark = path / READERS / PENDING_READER
    mark.parent.mkdir(exist_ok=True)
    mark.touch()
    os.utime(mark, (until, until))
    return mark


def being_read(path: Path, now: float | None = None) -> bool:
    """Whether a reader holds the checkpoint at `path`: a file under its `readers/` modified
    less than `READER_FRESH_SECONDS` ago (`now`: time.time())."""
    now = time.time() if now is None else now
    try:
        marks = list((path / READERS).iterdir())
    except OSError:
        return False
    for mark in marks:
        try:
            if now - mark.stat().st_mtime < READER_FRESH_SECONDS:
                return True
        except OSError:  # removed meanwhile: its reader is done
            continue
    return False
