"""Sharded, asynchronous checkpoints in the contract's layout, with torch.distributed.checkpoint.

`<dir>/<job>/step_<N>/` holds the state after N optimizer steps; it is complete if and only if
`step_<N>/done` exists (hlat_api.layout), and `done` is written by global rank 0 only after
DCP's collective save has finished on every rank (every shard written and fsynced, the
metadata written last by the coordinator). So a crash at any point before that, on any rank,
leaves a directory that is never loaded and is removed at the next start.

Design choices:
- Every rank writes its own shards (DTensor shards of tensor-parallel weights, its ZeRO-1
  optimizer partition, its data-parallel stream's loader position, its RNG); DCP de-duplicates
  what data-parallel replicas hold in common, so replicated weights are written once.
- Asynchronous mode: `save` returns once DCP has started staging the state into host memory
  on its staging thread; the copy runs while the next step computes its gradients, and the
  engine calls `wait_staged` before the optimizer update changes any of the state (the time
  it waits there is the save's blocking too, charged as checkpoint time). One stager serves
  the whole run: its host buffers (pinned where CUDA is present) are allocated at the first
  save and refilled in place at every later one, so a save costs one copy into memory it
  already has, not an allocation of the whole state (the price: one staged copy of the state
  stays in host memory). The write runs on
  DCP's background thread over a separate gloo group (its collectives must not interleave
  with training's). Rank 0 writes `done` and
  purges old checkpoints from the future's completion callback, so a checkpoint is committed
  as soon as it is durable. A new save first waits for the previous one.
- Resume: the newest complete checkpoint that loads; if it cannot be read (truncated or corrupt
  files despite `done`), a warning and the next older one. DCP loads in place into the state
  the trainer built, and its collectives make every rank see the same outcome. If every
  complete checkpoint fails, the trainer stops with an error rather than train from partially
  overwritten weights.
- Retention keeps the newest `keep` complete checkpoints and deletes `done` first, so a purge
  cut short never leaves a half-deleted checkpoint that looks complete. An older one that a
  reader holds (`hlat_api.layout.being_read`: an evaluation) is kept until its reader is done.
  The neuron-xla stack's checkpoints, which NxD writes, are purged the same way
  (`purge_checkpoints`, from ManagedEngine): NxD's own `num_kept_ckpts` knows nothing of
  readers, so it is not used.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from hlat_api.layout import (
    DONE,
    READERS,
    CheckpointEntry,
    being_read,
    hold_ahead,
    latest_complete,
    list_checkpoints,
    step_dir,
)
from hlat_trainer.errors import UserError, first_line

log = logging.getLogger(__name__)
META_FILE = "hlat.json"
# Fault injection for tests and drills: delay every rank's shard writes by this many seconds,
# so a process can be killed while an asynchronous save is in flight.
WRITE_DELAY_ENV = "HLAT_FAULT_CHECKPOINT_WRITE_DELAY_SECONDS"


class _DelayedWriter(FileSystemWriter):
    def __init__(self, path: Path, delay: float) -> None:
        super().__init__(path)
        self.delay = delay

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(self.delay)
        return super().write_data(plan, planner)


def write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_bytes(state: dict[str, Any]) -> int:
    """The bytes of the tensors this rank holds in `state` (a DTensor's local shard): what its
    save has to write at most (DCP writes a replicated tensor once, on one rank)."""
    total = 0
    for leaf in tree_leaves(state):
        if isinstance(leaf, torch.Tensor):
            local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
            total += local.numel() * local.element_size()
    return total


def _innermost(err: BaseException) -> str:
    """The last line of an error's text: for DCP's CheckpointException, which lists each
    rank's traceback, the exception that failed the write."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__


def volume_full(root: Path, step: int, needed: int, err: BaseException) -> OSError | None:
    """A save that failed on a full volume, said so: None if the volume has room.

    torch.save reports a disk that fills during its write as "unexpected pos N vs M"
    (inline_container.cc) rather than ENOSPC, depending on which write hits the full disk; a
    user reading that would not know the volume is full. So the volume's free space decides:
    less than this rank's state, or the OS's own ENOSPC anywhere in DCP's report."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return None
    if usage.free >= needed and os.strerror(errno.ENOSPC) not in str(err):
        return None
    return OSError(
        errno.ENOSPC,
        f"{os.strerror(errno.ENOSPC)}: checkpoint step_{step} could not be written, the "
        f"checkpoint volume {root} has "
        f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB, this rank's "
        f"state is {needed / 2**20:.1f} MiB (free space on it, lower checkpoint.keep, or grow "
        f"the volume); DCP said: {_innermost(err)}")


T = TypeVar("T")


def load_newest(root: Path, job: str, load: Callable[[CheckpointEntry], T | None]) -> T | None:
    """The newest complete checkpoint that `load` manages to load (it returns None, having
    said why, for one it cannot read), trying older ones in turn; None when there is no
    complete checkpoint. When there are some and none loads, a UserError naming them: starting
    over at step 1 would silently throw the run away (and the next saves would purge them).
    Both engines resume through here."""
    failed = []
    for entry in reversed(list_checkpoints(root, job)):
        if not entry.complete:
            continue
        loaded = load(entry)
        if loaded is not None:
            return loaded
        failed.append(str(entry.path))
    if failed:
        raise UserError(
            f"no complete checkpoint of job {job} could be loaded ({', '.join(failed)} are "
            "unreadable): move them aside to start over, or restore them"
        )
    return None


def purge_checkpoints(root: Path, job: str, keep: int, held: set[int]) -> None:
    """Keep the newest `keep` complete checkpoints of `job`; `done` goes first when deleting.
    One being read (`hlat_api.layout.being_read`: an evaluation) is kept until its reader is
    done; the next purge after that deletes it. `held`: the steps kept so far for a reader
    (each is said once). Run by the coordinator only."""
    complete = [e for e in list_checkpoints(root, job) if e.complete]
    for entry in complete[:-keep]:
        if being_read(entry.path):
            if entry.step not in held:
                held.add(entry.step)
                log.info("checkpoint %s is being read (%s): kept past checkpoint.keep "
                         "until its reader is done", entry.path, entry.path / READERS)
            continue
        held.discard(entry.step)
        (entry.path / DONE).unlink(missing_ok=True)
        shutil.rmtree(entry.path, ignore_errors=True)


def remove_incomplete(root: Path, job: str, coordinator: bool,
                      group: dist.ProcessGroup | None = None) -> list[Path]:
    """Rank 0 deletes step directories without `done` (left by a crash mid-save); a barrier,
    so that no rank looks for checkpoints while they are being removed."""
    removed = []
    if coordinator:
        for entry in list_checkpoints(root, job):
            if not entry.complete:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    dist.barrier(group=group)
    return removed


class Checkpointer:
    def __init__(self, root: str | Path, job: str, keep: int, *, async_: bool,
                 rank: int = 0, meta: dict[str, Any] | None = None) -> None:
        self.root, self.job, self.keep, self.async_ = Path(root), job, keep, async_
        self._held: set[int] = set()  # steps purge kept for a reader (said once each)
        self.rank = rank
        self.meta = meta or {}
        """Extra fields for each checkpoint's hlat.json (the saving layout)."""
        self.pending: tuple[Future[Any], threading.Event] | None = None
        """The in-flight asynchronous write, and the event its commit callback sets."""
        self.committed: int | None = None
        self.longest_write = 0.0
        """Longest asynchronous save so far, from its start to its commit (seconds)."""
        self._lock = threading.Lock()
        self.fenced: Callable[[], bool] | None = None
        """Asked before marking a checkpoint complete: True when this trainer's attempt is over
        (the heartbeat's `fenced_now`); a fenced trainer's checkpoints never get `done`."""
        self.hold_for: Callable[[int], float] | None = None
        """Seconds a newly complete checkpoint of this step is held for an evaluation that
        has yet to start (0: none; `hlat_api.layout.hold_ahead`)."""
        self.withheld: int | None = None
        """The newest checkpoint written whole whose `done` `fenced` held back (rank 0), until
        a later one commits or `commit_withheld` does: the last one of a run must not be lost
        to an API server that was away as it ended."""
        # background saves talk over their own group, apart from training's collectives
        self.group: dist.ProcessGroup | None = None
        self.stager: DefaultStager | None = None
        """Host buffers the state is staged into, kept from save to save (see the module)."""
        if async_:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)
            self.group = group
            cuda = torch.cuda.is_available()
            # staging on the stager's thread: `wait_staged` before the state changes
            self.stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                use_non_blocking_copy=False))
        self.staging: Future[Any] | None = None
        """The in-flight save's copy of the state into the stager's buffers."""

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # --- save ---------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Checkpoint `state` as step_<step>; returns the seconds training was blocked."""
        start = time.perf_counter()
        self.wait()
        target = step_dir(self.root, self.job, step)
        if self.is_coordinator:
            if target.exists():
                shutil.rmtree(target)  # an incomplete leftover of an earlier attempt
            target.mkdir(parents=True)
        dist.barrier()
        delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
        writer = _DelayedWriter(target, delay) if delay else FileSystemWriter(target)
        if self.async_:
            response = dcp_async_save(state, storage_writer=writer, process_group=self.group,
                                      async_stager=self.stager)
            if isinstance(response, AsyncSaveResponse):
                self.staging, future = response.staging_completion, response.upload_completion
            else:  # staged already (no stager: DCP's default)
                future = response
            assert isinstance(future, Future)
            settled = threading.Event()
            future.add_done_callback(
                lambda f: self._on_written(step, f, start, settled, state))
            self.pending = (future, settled)
        else:
            try:
                dcp_save(state, storage_writer=writer)
            except (Exception, CheckpointException) as err:  # not an Exception subclass
                full = volume_full(self.root, step, state_bytes(state), err)
                if full is None:
                    raise
                raise full from err
            self._commit(step)
        return time.perf_counter() - start

    def _on_written(self, step: int, future: Future[Any], started: float,
                    settled: threading.Event, state: dict[str, Any]) -> None:
        try:
            err = future.exception()
            if err is not None:
                full = volume_full(self.root, step, state_bytes(state), err)
                log.error("checkpoint step_%d failed, it stays incomplete: %s", step,
                          err if full is None else full)
                return
            self._commit(step)
            self.longest_write = max(self.longest_write, time.perf_counter() - started)
        finally:
            settled.set()

    def _commit(self, step: int) -> None:
        """Every rank's shards are durable: rank 0 marks the checkpoint complete and purges."""
        with self._lock:
            if self.is_coordinator and self.fenced is not None and self.fenced():
                log.warning("checkpoint step_%d left incomplete: this trainer cannot show that "
                            "its attempt is still the live one (its Lease renewals are refused, "
                            "or none was accepted for longer than the Lease's duration)", step)
                self.withheld = step
                return
            self.committed, self.withheld = step, None
            if not self.is_coordinator:
                return
            target = step_dir(self.root, self.job, step)
            meta = {"step": step, "time": time.time(), "format": "torch.distributed.checkpoint",
                    **self.meta}
            write_durably(target / META_FILE, json.dumps(meta).encode())
            write_durably(target / DONE, b"")
            if self.hold_for is not None and (hold := self.hold_for(step)) > 0:
                hold_ahead(target, time.time() + hold)  # its evaluation Job has yet to start
            self.purge()
            log.info("checkpoint step_%d complete", step)

    def commit_withheld(self) -> bool:
        """Ask `fenced` again and, if it allows now, commit the withheld checkpoint; whether
        none is withheld any more."""
        if self.withheld is not None:
            self._commit(self.withheld)
        return self.withheld is None

    def wait_staged(self) -> float:
        """Block until the in-flight asynchronous save has its copy of the state, so that the
        state may change; returns the seconds waited. A failed copy fails the save's write,
        which `wait` reports."""
        if self.staging is None:
            return 0.0
        start = time.perf_counter()
        staging, self.staging = self.staging, None
        with contextlib.suppress(Exception, CheckpointException):  # reported with the write's
            staging.result()
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the in-flight asynchronous save (if any) is written and committed (the
        future resolves before its callbacks run: its `done` is written by the callback)."""
        if self.pending is not None:
            (future, settled), self.pending = self.pending, None
            try:
                future.result()
            except (Exception, CheckpointException) as err:  # not an Exception subclass
                log.error("asynchronous checkpoint failed: %s", first_line(err))
            settled.wait()

    def purge(self) -> None:
        """`purge_checkpoints` of this job, keeping `checkpoint.keep`."""
        purge_checkpoints(self.root, self.job, self.keep, self._held)

    # --- resume -------------------------------------------------------------------------------

    def remove_incomplete(self) -> list[Path]:
        return remove_incomplete(self.root, self.job, self.is_coordinator)

    def load_latest(self, state: dict[str, Any]) -> int:
        """Load the newest readable complete checkpoint into `state` in place; its step, or 0."""

        def load(entry: CheckpointEntry) -> int | None:
            try:
                dcp_load(state, checkpoint_id=entry.path)
            except (Exception, CheckpointException) as err:  # unreadable: try an older one
                log.warning("checkpoint %s is unreadable (%s): trying an older one",
                            entry.path, first_line(err))
                return None
            return entry.step

        step = load_newest(self.root, self.job, load)
        if step is not None:
            self.committed = step
        return step or 0

    def latest_step(self) -> int | None:
        entry = latest_complete(self.root, self.job)
        return entry.step if entry else None
