"""In-memory snapshots (checkpoint.memoryInterval): each rank's state in its pod's memory, so a
trainer restarted in its pod resumes from the last snapshot instead of the durable checkpoint.

Layout: `<HLAT_SNAPSHOT_DIR>/<job>/rank_<r>/step_<N>.pt`, one self-contained file per rank and
step (torch.save of the rank's own tensors, DTensors as their local shards, and its loop
state), written to a temporary name and renamed: a file under its final name is whole. The
directory is on a memory file system (/dev/shm) that hlat-launch creates per pod and removes
when it ends, so it outlives the trainer process (a crash loses nothing there) but not the pod.
Each rank keeps its `SNAPSHOTS_KEPT` newest.

What the data-parallel replicas of a rank hold alike (the weights, and without ZeRO-1 the
optimizer state too) is kept once per dp group, not dp times: each rank's file holds its 1/dp
of each such tensor (`DpSlices`), and a restore gathers them back over the dp group. At the
paper's 7B layout (tp 8, dp 256, ZeRO-1) a rank's snapshot is then its optimizer shard and
1/256 of its weights: about 1/50 of the whole state, to write, to hold and to copy to a peer.

A snapshot is used only when every rank holds the same step (`agree`: a rank that died while
writing step N still holds N - interval), with the same layout as this run, and it is not
older than the newest durable checkpoint. With checkpoint.memoryReplicas the launcher also
copies each snapshot into the next node's memory (`hlat_trainer.replica`), from where a rank
that moved to a new pod fetches it back before its trainer starts. Snapshots never touch the durable checkpoints: the
`done` marker still means durable.

Shrunk (an elastic job resized in place after a node was lost): the snapshots are of the old
layout. Before the trainers start, every launcher stages the old world's files of the newest step all of its
ranks are held at (its own, its peers', and the lost node's copies at its successor) under
`<job>/resize/` with a marker naming the step and the old world (`replica.gather`). Each
trainer then takes from them what its rank holds at the new size (`reassemble`): the weights
and, without ZeRO-1, the optimizer state joined from the old dp ranks' pieces, with ZeRO-1 the
entries of the parameters it owns now (kept whole by their old owners; their keys name the
parameter, not the rank), and the loop state of every old dp rank, which the data loader
reshards as from a durable checkpoint of the old size.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hlat_api import Env
from hlat_api.spec import SNAPSHOTS_KEPT
from hlat_trainer.parallel import local
from hlat_trainer.replica import staged_path

log = logging.getLogger(__name__)

_NAME = re.compile(r"step_(\d+)\.pt")


def snapshot_root(env: Mapping[str, str]) -> Path | None:
    """The launcher's directory for snapshots (HLAT_SNAPSHOT_DIR); None when no launcher
    keeps one (a run started by hand, or a gang recreated at each restart): nothing would
    outlive the process to restore from."""
    raw = env.get(Env.SNAPSHOT_DIR)
    return Path(raw) if raw else None


@dataclass(frozen=True)
class DpSlices:
    """Which of a rank's state entries its dp replicas hold alike (`replicated`, by top-level
    key), and this rank's part of them: each such tensor flattened, cut into `dp` equal pieces
    (the last padded with zeros), piece `dp_rank` kept. dp 1: the state as it is."""

    dp: int
    dp_rank: int
    group: dist.ProcessGroup | None
    """The dp group the pieces are gathered over (a collective of its ranks)."""
    replicated: Callable[[str], bool]

    def cut(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` with each replicated tensor (at any depth) as this rank's piece of it."""
        if self.dp == 1:
            return state
        return {k: self._cut(v) if self.replicated(k) else v for k, v in state.items()}

    def _cut(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._cut(v) for k, v in value.items()}
        t = local(value)
        if not isinstance(t, Tensor):
            return value
        flat, size = t.detach().reshape(-1), _piece(t.numel(), self.dp)
        piece = flat[self.dp_rank * size:(self.dp_rank + 1) * size]
        return torch.cat([piece, piece.new_zeros(size - piece.numel())])  # a copy, even whole

    def join(self, state: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """`saved` (every dp rank's, as `cut` made them) with each replicated tensor whole
        again, shaped as in `state`: one all-gather per dtype over the dp group (every rank of
        the group calls it)."""
        if self.dp == 1:
            return saved
        places: list[tuple[dict[str, Any], str, Tensor]] = []  # (where, key, live tensor)
        whole: dict[str, Any] = {}
        for key, value in state.items():
            if self.replicated(key):
                whole[key] = _shell(value, saved[key], key, whole, places)
            else:
                whole[key] = saved[key]
        by_dtype: dict[torch.dtype, list[tuple[dict[str, Any], str, Tensor]]] = {}
        for place in places:
            by_dtype.setdefault(place[2].dtype, []).append(place)
        for group in by_dtype.values():  # every rank builds the same groups, in the same order
            sizes = [_piece(live.numel(), self.dp) for _, _, live in group]
            mine = torch.cat([where[key].to(live.device).reshape(-1)
                              for where, key, live in group])
            pieces = [torch.empty_like(mine) for _ in range(self.dp)]
            dist.all_gather(pieces, mine, group=self.group)
            offset = 0
            for (where, key, live), size in zip(group, sizes, strict=True):
                flat = torch.cat([p[offset:offset + size] for p in pieces])
                where[key] = flat[:live.numel()].view(live.shape)
                offset += size
        return whole


def _piece(numel: int, dp: int) -> int:
    return -(-numel // dp)


def _shell(value: Any, kept: Any, key: str, parent: dict[str, Any],
           places: list[tuple[dict[str, Any], str, Tensor]]) -> Any:
    """`kept` (a cut entry) copied into a new dict tree, its tensors' places recorded with the
    live tensors they stand for (`join` fills them in)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out[k] = _shell(v, kept[k], k, out, places)
        return out
    t = local(value)
    if isinstance(t, Tensor):
        places.append((parent, key, t))
    return kept


def dp_replicated(zero1: bool) -> Callable[[str], bool]:
    """Which state entries (by top-level key) the dp replicas of a rank hold alike: the
    weights, and the optimizer state unless ZeRO-1 splits it (`DpSlices.replicated`)."""
    return lambda key: key == "model" or (key.startswith("optim.") and not zero1)


def reassemble(state: dict[str, Any], pieces: list[dict[str, Any]],
               replicated: Callable[[str], bool]) -> dict[str, Any]:
    """The entries of `state` (this rank's live model and optimizer entries) from the snapshots
    of one tensor-parallel rank's old dp ranks, `pieces` in dp order: a replicated entry (old
    layout) joined from every piece, flattened and cut as `DpSlices.cut` made them (dp 1: the
    tensor whole); any other entry as the one old rank that held it kept it. Raises KeyError or
    ValueError when the pieces do not make `state` up (an entry missing, too few elements)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if replicated(key):
            out[key] = _joined(value, [piece[key] for piece in pieces])
        else:
            held = [piece[key] for piece in pieces if key in piece]
            if not held:
                raise KeyError(f"no old rank's snapshot holds {key}")
            out[key] = held[0]
    return out


def _joined(value: Any, parts: list[Any]) -> Any:
    if isinstance(value, dict):
        return {k: _joined(v, [part[k] for part in parts]) for k, v in value.items()}
    t = local(value)
    if not isinstance(t, Tensor):
        return parts[0]
    flat = torch.cat([part.reshape(-1) for part in parts])
    if flat.numel() < t.numel():
        raise ValueError(f"{flat.numel()} elements in the old pieces of a tensor of "
                         f"{t.numel()}")
    return flat[:t.numel()].view(t.shape)


def read_staged(root: Path, job: str, rank: int, step: int) -> dict[str, Any] | None:
    """A staged snapshot's payload (step, layout, state), its tensors mapped from the memory
    file system rather than copied (a rank reads the parts it needs); None if unreadable."""
    try:
        payload: dict[str, Any] = torch.load(staged_path(root, job, rank, step),
                                             weights_only=True, mmap=True)
    except Exception as err:  # missing or torn: not a snapshot to use
        log.warning("staged snapshot of old rank %d step_%d is unreadable (%s)", rank, step,
                    err)
        return None
    return payload if payload.get("step") == step else None


def _locals(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with every DTensor, at any depth, as its local shard."""
    return {k: _locals(v) if isinstance(v, dict) else local(v) for k, v in state.items()}


class Snapshots:
    """This rank's snapshots of one job."""

    def __init__(self, root: Path, job: str, rank: int, layout: Any,
                 keep: int = SNAPSHOTS_KEPT) -> None:
        self.root, self.job = root, job
        self.dir = root / job / f"rank_{rank:05d}"
        self.layout = asdict(layout)
        self.keep = keep
        self.fenced: Callable[[], bool] = lambda: False

    def steps(self) -> list[int]:
        """The steps of this rank's whole snapshot files, newest first."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)) for n in names if (m := _NAME.fullmatch(n))),
                      reverse=True)

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Write `state` as step `step`'s snapshot; returns the seconds it took. A fenced
        trainer (its attempt is over) writes none: a later attempt may be restoring."""
        if self.fenced():
            return 0.0
        started = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step}.pt"
        partial = path.with_suffix(".tmp")
        payload = {"step": step, "layout": self.layout, "state": _locals(state)}
        torch.save(payload, partial)
        if self.fenced():
            partial.unlink(missing_ok=True)
            return time.perf_counter() - started
        os.replace(partial, path)
        for old in self.steps()[self.keep:]:
            (self.dir / f"step_{old}.pt").unlink(missing_ok=True)
        return time.perf_counter() - started

    def read(self, step: int) -> dict[str, Any] | None:
        """Step `step`'s state if its file is whole and of this run's layout, else None."""
        try:
            payload = torch.load(self.dir / f"step_{step}.pt", weights_only=True)
        except Exception as err:  # missing, torn or unreadable: not a snapshot to use
            log.warning("in-memory snapshot step_%d is unreadable (%s)", step, err)
            return None
        if payload.get("step") != step or payload.get("layout") != self.layout:
            log.warning("in-memory snapshot step_%d is of another run or layout (%s): not "
                        "used", step, payload.get("layout"))
            return None
        state: dict[str, Any] = payload["state"]
        return state

    def remove_partial(self) -> None:
        """Delete what a trainer killed while writing left (a whole snapshot's worth of the
        pod's memory each)."""
        for partial in self.dir.glob("step_*.tmp"):
            partial.unlink(missing_ok=True)


def agree(held: list[int], group: dist.ProcessGroup) -> int:
    """The newest step every rank holds a snapshot of, given each rank's steps (a collective:
    every rank calls it and gets the same answer); 0 when they have none in common. A rank
    that took a lost node's place holds what it fetched from its peer's replica
    (`hlat_trainer.replica`), which may lag the others' newest: the step before may still
    be common to all."""
    everyone: list[list[int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(held), group=group)
    common = set.intersection(*(set(steps or ()) for steps in everyone))
    return max(common, default=0)


def fits(state: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether a snapshot's entries are `state`'s (nested dicts, such as the model's state
    dict, alike), tensors of the same shapes and dtypes."""
    if set(saved) != set(state):
        return False
    for key, value in state.items():
        target, kept = local(value), saved[key]
        if isinstance(value, dict):
            if not isinstance(kept, dict) or not fits(value, kept):
                return False
        elif isinstance(target, Tensor) and (
                not isinstance(kept, Tensor) or kept.shape != target.shape
                or kept.dtype != target.dtype):
            return False
    return True


def copy_into(state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Copy a snapshot that `fits` into `state`: the live model's and optimizer's tensors in
    place (so the model and optimizer hold it), other entries replaced."""
    with torch.no_grad():
        for key, value in state.items():
            target = local(value)
            if isinstance(value, dict):
                copy_into(value, saved[key])
            elif isinstance(target, Tensor):
                target.copy_(saved[key])
            else:
                state[key] = saved[key]
