"""The checkpoint layout: `<dir>/<job>/step_<N>/`, complete if and only if `step_<N>/done` exists.

The same rule neuronx-distributed's checkpoint API uses. `done` is written last, after every
shard is durable; anything without it is never loaded and may be deleted. The operator reads
this layout (latest checkpoint, progress), the trainer writes it: both import these functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DONE = "done"
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
