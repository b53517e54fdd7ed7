"""Saving and resuming the whole training state in the contract's layout.

`<dir>/<job>/step_<N>/` holds the state after N optimizer steps; it is complete if and only if
`step_<N>/done` exists (hlat_api.layout). The write order makes a crash at any point harmless:
the state goes to a temporary file, is fsynced and renamed, then `meta.json`, and `done` last;
a directory without `done` is never loaded and is removed at the next start. On resume the
newest complete checkpoint is loaded; one that cannot be read (truncated, corrupt) is skipped
with a warning and the next older complete one is used. Retention keeps the newest `keep`
complete checkpoints and deletes `done` first, so a purge cut short never leaves a half-deleted
checkpoint that looks complete.

This is the single-process, synchronous checkpointer; the sharded asynchronous one
(torch.distributed.checkpoint) keeps the same layout and the same rules.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from hlat_api.layout import DONE, latest_complete, list_checkpoints, step_dir

log = logging.getLogger(__name__)
STATE_FILE = "state.pt"
META_FILE = "meta.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpointer:
    def __init__(self, root: str | Path, job: str, keep: int) -> None:
        self.root, self.job, self.keep = Path(root), job, keep

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Write `state` as step_<step>; returns the seconds the caller was blocked."""
        start = time.perf_counter()
        target = step_dir(self.root, self.job, step)
        if target.exists():
            shutil.rmtree(target)  # an incomplete leftover of a crashed attempt
        target.mkdir(parents=True)
        _write_durably(target / STATE_FILE, lambda f: torch.save(state, f))
        meta = {"step": step, "time": time.time(), "format": "torch.save/v1"}
        _write_durably(target / META_FILE, lambda f: f.write(json.dumps(meta).encode()))
        _write_durably(target / DONE, lambda f: f.write(b""))
        _fsync_dir(target)
        self.purge()
        return time.perf_counter() - start

    def purge(self) -> None:
        """Keep the newest `keep` complete checkpoints; `done` goes first when deleting."""
        complete = [e for e in list_checkpoints(self.root, self.job) if e.complete]
        for entry in complete[: -self.keep]:
            (entry.path / DONE).unlink(missing_ok=True)
            shutil.rmtree(entry.path, ignore_errors=True)

    def remove_incomplete(self) -> list[Path]:
        """Delete step directories without `done` (left by a crash mid-save)."""
        removed = []
        for entry in list_checkpoints(self.root, self.job):
            if not entry.complete:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
        return removed

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest readable complete checkpoint as (step, state), or None to start fresh."""
        for entry in reversed(list_checkpoints(self.root, self.job)):
            if not entry.complete:
                log.warning("checkpoint %s has no `done` marker: ignoring it", entry.path)
                continue
            try:
                state = torch.load(entry.path / STATE_FILE, map_location="cpu", weights_only=True)
            except Exception as err:  # any unreadable file means: use an older one
                log.warning("checkpoint %s is unreadable (%s): trying an older one", entry.path, err)
                continue
            return entry.step, state
        return None

    def latest_step(self) -> int | None:
        entry = latest_complete(self.root, self.job)
        return entry.step if entry else None
