"""The device stack built for the loop: the model, one optimizer step, and its checkpoints.

The training loop (schedule, checkpoint cadence, logging, heartbeats) is one piece of code for
every backend, and so is the engine's step; what differs per device stack is behind `Backend`.
The engine owns the whole optimizer step, because that is where lazy devices (XLA) go wrong:

- `train_step(batches, lr)`: every micro-batch of the step (host batch -> device, forward, loss,
  backward, then the backend's micro-batch boundary: a graph cut on XLA, so one compiled graph
  per micro-batch whatever the accumulation count), then the update (average gradients over
  data parallel, clip the global norm, update, clear the gradients) and the loss averaged over
  data parallel, then the backend's step end (the optimizer's graph on XLA). It returns device
  tensors: nothing is read back to the host here, so an XLA step never waits for the device.
  The loop reads values (`Backend.to_host`) only on the steps it logs or checkpoints.
- `param_norm()` (a device tensor; only asked on logged steps: it is a full pass over the
  parameters and, under tensor parallelism, a collective);
- `save(step, loop_state)` / `resume()`: the model and optimizer in the backend's own format,
  plus each rank's `loop_state` (bytes the trainer packs: loader position, counters, RNG),
  which is durable before the checkpoint's `done` marker can exist; `wait()` before exit;
  `committed`, the newest complete checkpoint step (for the heartbeat).

Two engines:

- `TorchEngine` (cpu, cuda, neuron-native): the pure model parallelised by
  `hlat_trainer.parallel` (DTensor TP/SP, activation checkpointing), the step through its
  `DataParallel` (bucketed all-reduce, global norm, ZeRO-1), checkpoints through
  `hlat_trainer.checkpoint` (torch.distributed.checkpoint). Optimizer state is saved keyed by
  parameter name and tensor-parallel rank, not by data-parallel rank, so a checkpoint loads
  under another data-parallel degree or with ZeRO-1 switched (each rank reads the entries of
  the parameters it now owns).
- `ManagedEngine` (neuron-xla): the backend returns an already parallel model and an optimizer
  that averages, clips and reports the norm itself (NxD's NxDOptimizer / NeuronZero1Optimizer),
  and saves and loads the model and optimizer with its own checkpoint API in the same
  `step_<N>/done` layout; the engine adds each rank's loop state as `step_<N>/hlat/rank_R.pt`,
  written and fsynced before the backend is asked to save. Its format is per data-parallel
  rank, so it resumes only under the layout that saved it.

Every checkpoint also has `hlat.json` (written by rank 0) naming the layout that saved it, so a
resume knows whether, and how, the loop state must be re-dealt (`Restored.same_layout`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hlat_api import Env, PretrainJobSpec
from hlat_api.layout import CheckpointEntry, hold_ahead, latest_complete, step_dir
from hlat_api.spec import evaluation_due
from hlat_trainer.backends import Backend
from hlat_trainer.checkpoint import (
    META_FILE,
    Checkpointer,
    load_newest,
    purge_checkpoints,
    remove_incomplete,
    write_durably,
)
from hlat_trainer.distributed import World
from hlat_trainer.errors import UserError, first_line
from hlat_trainer.optim import AdamWSR
from hlat_trainer.parallel import DataParallel, LocalParams, apply_ac, apply_tp, nxd_param_norm
from hlat_trainer.replica import staged
from hlat_trainer.snapshot import (
    DpSlices,
    Snapshots,
    agree,
    copy_into,
    dp_replicated,
    fits,
    read_staged,
    reassemble,
    snapshot_root,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """How the ranks that saved a checkpoint were laid out."""

    world: int
    dp: int
    tp: int
    zero1: bool

    @classmethod
    def of(cls, world: World, zero1: bool) -> Layout:
        return cls(world.size, world.dp, world.tp, zero1)


@dataclass(frozen=True)
class StepResult:
    """One optimizer step's numbers, as device tensors (`Backend.to_host` reads them)."""

    loss: Tensor
    """Mean loss over the step's micro-batches and the data-parallel ranks (0-d)."""
    grad_norm: Tensor
    """Global gradient norm before clipping (0-d)."""
    data_wait_seconds: float
    """Time spent waiting for the loader's batches."""
    staging_wait_seconds: float = 0.0
    """Time the update waited for an asynchronous save's copy of the state (checkpoint time)."""
    compute_seconds: float | None = None
    """Host time of the step's forward and backward passes, less data wait, before the
    gradients are synchronised (no wait on peers in it). Where the backend's host time is not
    its device's (`Backend.host_timed`), the device time of the micro-batches (XLA: their
    graphs; CUDA: their kernels) of the newest step the device has run
    (`Backend.device_clock`), or None."""
    sync_seconds: float | None = None
    """Host time of the step's collectives over data parallel, each mostly a wait for the
    slowest peer: the gradients' all-reduce, ZeRO-1's broadcast of the updated shards (a peer
    slow to update), the loss's all-reduce. On XLA and CUDA (`Backend.device_clock`), the
    device time of the update (XLA: its graph), where those collectives run with the
    optimizer's update; None where neither times it (a managed optimizer synchronising inside
    its step on an eager device)."""
    host_seconds: float | None = None
    """The rest of the step's time in the engine: the optimizer update, clipping, moving
    batches to the device (the step's wall time less compute, sync, data wait and a save's
    staging wait; None where not host-timed: on XLA the update's device time is in sync). A
    node whose host is slow (a noisy neighbour, a throttled CPU) shows here with its compute
    time normal."""


@dataclass
class Restored:
    """What `Engine.resume` found: the model and optimizer are already loaded in place."""

    step: int
    saved: Layout
    loop_states: dict[int, bytes]
    """Loop state by the saving run's global rank: this rank's own under the same layout, the
    first tensor-parallel rank of every saving data-parallel rank otherwise."""
    same_layout: bool
    source: str = "checkpoint"
    """What it was loaded from: the durable `checkpoint`, or an in-memory `snapshot`."""


def pack(obj: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    return obj


def read_layout(path: Path) -> Layout | None:
    """The layout recorded in a checkpoint's hlat.json (None for one that records none)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    raw = meta.get("layout")
    return Layout(**raw) if isinstance(raw, dict) else None


class Engine(ABC):
    model: nn.Module
    optimizer: torch.optim.Optimizer
    snapshots: Snapshots | None = None
    """This rank's in-memory snapshots (`_snapshot_store`; None: not taken)."""

    def __init__(self, spec: PretrainJobSpec, job: str, backend: Backend, world: World,
                 device: torch.device) -> None:
        self.spec, self.job, self.backend, self.world, self.device = (
            spec, job, backend, world, device)
        self.root = Path(spec.checkpoint.dir)
        self.layout = Layout.of(world, spec.parallelism.zero1)
        self.sync_seconds: float | None = None
        """The last `_update`'s gradient synchronisation, where the engine times it."""
        self.device_clock = None if backend.host_timed else backend.device_clock()
        """Times the step's work on the device where the host cannot (XLA, CUDA):
        `devicetime`."""
        host = dist.new_group(backend="gloo")  # CPU collectives beside the device's
        assert isinstance(host, dist.ProcessGroup)
        self._host_group = host

    @property
    def host_group(self) -> dist.ProcessGroup:
        """The gloo group for the host's own collectives (beside the device's)."""
        return self._host_group

    def snapshot(self, step: int, loop_state: bytes) -> float:
        """Keep this rank's state in memory as of `step` (checkpoint.memoryInterval); returns
        the seconds it held the loop. Engines that take none return 0."""
        return 0.0

    def _agreed_snapshot(self, durable: int, whole: Callable[[dict[str, Any] | None], bool],
                         resized: bool = False) -> tuple[int, dict[str, Any]] | None:
        """The newest in-memory snapshot every rank holds, not older than the durable
        checkpoint of step `durable`, as (step, this rank's saved state), when `whole` says
        every rank's is whole and of this run; else None (a collective: every rank calls it
        and gets the same answer). `whole` is called on every rank alike once a step is
        agreed (with None where this rank could not read it): it may run collectives. None on
        a `resized` attempt: its own snapshots are of the old layout."""
        if self.snapshots is None:
            return None
        self.snapshots.remove_partial()
        held = [] if resized else [s for s in self.snapshots.steps() if s >= max(durable, 1)]
        agreed = agree(held, self._host_group)
        if agreed == 0:
            return None
        saved = self.snapshots.read(agreed)
        if not self._all_ok(whole(saved) and saved is not None):
            log.warning("in-memory snapshot step_%d is not whole on every rank: resuming from "
                        "the durable checkpoint", agreed)
            return None
        assert saved is not None
        return agreed, saved

    def _snapshot_store(self) -> Snapshots | None:
        """This rank's in-memory snapshots, of `self.layout` (set it first): where the spec
        takes them and a launcher keeps the pod's memory across restarts (HLAT_SNAPSHOT_DIR),
        else None."""
        root = snapshot_root(os.environ)
        if self.spec.checkpoint.memory_interval not in (None, "off") and root is None:
            log.warning("checkpoint.memoryInterval is set but no launcher keeps this pod's "
                        "memory across restarts (%s unset): no in-memory snapshots",
                        Env.SNAPSHOT_DIR)
        if not self.spec.snapshot_interval or root is None:
            return None
        return Snapshots(root, self.job, self.world.rank, self.layout)

    snapshot_step: int | None = None
    """The newest in-memory snapshot this rank holds (None: none, or not taken)."""

    @property
    def takes_snapshots(self) -> bool:
        """Whether `snapshot` keeps anything: a store in the pod's memory that outlives this
        process (the in-place launcher's). The same on every rank of a job (every pod runs
        the same launcher)."""
        return False

    def _all_ok(self, ok: bool) -> bool:
        """True only if every rank says ok (a collective: every rank calls it)."""
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._host_group)
        return bool(flag.item())

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Each of `values`, the largest any rank has (a collective on the host: every rank
        calls it)."""
        out = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self._host_group)
        return [float(v) for v in out.tolist()]

    def sum_over_ranks(self, value: int) -> int:
        """`value` summed over every rank, modulo 2^64 (a collective on the host: every rank
        calls it; a rank whose part must not count passes 0)."""
        total = torch.tensor([value - (1 << 64) if value >= 1 << 63 else value],
                             dtype=torch.int64)  # the same 64 bits, as int64 wraps
        dist.all_reduce(total, group=self._host_group)
        return int(total.item()) & ((1 << 64) - 1)

    def fence(self, fenced: Callable[[], bool], lately: Callable[[], bool] | None = None
              ) -> None:
        """Ask `fenced` before marking a checkpoint complete: a trainer whose attempt is over
        commits none. `lately`: the same question answered from what is known already (no
        request), asked before each in-memory snapshot (one a step: `fenced` renews the Lease
        to answer). The managed (NxD) engine's `done` is written by the backend's own save,
        which has no such hook: there the trainer only stops itself at its next report (its
        snapshots are fenced)."""
        return None

    def withheld_checkpoint(self) -> int | None:
        """The step of a checkpoint written whole whose commit the fence held back (`fence`),
        or None. The managed engine's backend commits in its own save: None."""
        return None

    def commit_withheld(self) -> bool:
        """Ask the fence again and commit the withheld checkpoint if it allows now; whether
        none is withheld any more."""
        return True

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, batches: Iterator[tuple[Tensor, Tensor]], lr: float) -> StepResult:
        """One optimizer step over this rank's micro-batches of host tensors (`micro_batches`:
        where the data-parallel degree does not divide the step's micro-batches, some ranks
        train one more). Each micro-batch's loss is divided by the step's micro-batches per
        rank on average, so that the gradients' average over the ranks is their mean over
        every micro-batch of the global batch, whatever the split (and, where it is even,
        bit for bit the division by the accumulation count it always was)."""
        spec, backend = self.spec, self.backend
        accum = spec.micro_batches(self.world.dp_rank)
        share = spec.micro_batches_per_step / spec.data_parallel
        self.set_lr(lr)
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        began = time.perf_counter()
        for _ in range(accum):
            start = time.perf_counter()
            inputs, targets = next(batches)
            data_wait += time.perf_counter() - start
            if self.device_clock is not None:
                self.device_clock.begin()
            inputs, targets = backend.to_device(inputs, self.device), backend.to_device(
                targets, self.device)
            with backend.autocast():
                logits = self.model(inputs)
            loss = backend.loss(logits, targets)
            loss = loss / self._divisor(share, loss)
            loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach()
            if self.device_clock is not None:
                self.device_clock.cut(backend.micro_batch_end, loss_sum)
            else:
                backend.micro_batch_end()
        compute = (time.perf_counter() - began - data_wait) if backend.host_timed else None
        staging_wait = self._wait_staged()  # the update must not change what a save copies
        self.sync_seconds = None
        if self.device_clock is not None:
            self.device_clock.begin()
        grad_norm = self._update(self.spec.optimizer.grad_clip)
        sync = self.sync_seconds if backend.host_timed else None
        if self.world.dp > 1:
            start = time.perf_counter()
            dist.all_reduce(loss_sum, group=self.world.dp_group)
            if sync is not None:  # a wait for a peer slower to update: not this host's work
                sync += time.perf_counter() - start
            loss_sum /= self.world.dp
        host = None
        if self.device_clock is None:
            backend.step_end()
        else:  # an earlier step's device times, once its graphs have run
            self.device_clock.cut(backend.step_end, grad_norm)
            self.device_clock.step_done()
            timed = self.device_clock.settled()
            if timed is not None:
                compute, sync = timed.compute, timed.update
        if backend.host_timed and compute is not None:
            host = max(0.0, time.perf_counter() - began - data_wait - compute - (sync or 0.0)
                       - staging_wait)
        return StepResult(loss_sum, grad_norm, data_wait, staging_wait, compute, sync, host)

    def _divisor(self, share: float, like: Tensor) -> Tensor:
        """`share` as a 0-d view of a 1-element device tensor uploaded once per value. Neither a
        Python float nor a 0-d upload: torch-xla serves both from its scalar cache, where equal
        values share one buffer and so one graph parameter; `loss / 2.0` then merges with the
        model's own 2.0 (RMSNorm's backward) and `loss / 6.0` does not, and the graphs' hashes
        would change with the accumulation count (a Trainium job compiling again whenever its
        node count does). A 1-d upload gets a buffer of its own."""
        key = (share, like.dtype)
        if self._divisor_cache is None or self._divisor_cache[0] != key:
            value = torch.tensor([share], dtype=like.dtype).to(like.device)
            self._divisor_cache = (key, value)
        return self._divisor_cache[1][0]

    _divisor_cache: tuple[tuple[float, torch.dtype], Tensor] | None = None

    def eval_loss(self, batches: list[tuple[Tensor, Tensor]],
                  each: Callable[[], None] = lambda: None) -> Tensor:
        """Mean token loss over `batches` (host tensors) and the data-parallel ranks (each rank's
        count may differ, or be none: the mean is over every micro-batch of every rank),
        without gradients, the optimizer or the RNG: training resumes as if it had not run.
        `each` after every micro-batch (a sign of life). A 0-d tensor left on the device."""
        backend, model = self.backend, self.model
        was_training = model.training
        model.eval()
        total = torch.zeros((), device=self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for inputs, targets in batches:
                    inputs = backend.to_device(inputs, self.device)
                    targets = backend.to_device(targets, self.device)
                    with backend.autocast():
                        logits = model(inputs)
                    total += backend.loss(logits, targets).float()
                    backend.micro_batch_end()
                    each()
                if self.world.dp > 1:  # (sum, count) of every rank's micro-batches
                    pair = torch.stack([total, torch.full((), float(len(batches)),
                                                          device=self.device)])
                    dist.all_reduce(pair, group=self.world.dp_group)
                    total = pair[0] / pair[1]
                else:
                    total /= max(len(batches), 1)
                backend.step_end()
        finally:
            model.train(was_training)
        return total

    def _wait_staged(self) -> float:
        """Wait until an asynchronous save's copy of the state is taken; the seconds waited."""
        return 0.0

    @abstractmethod
    def _update(self, max_norm: float) -> Tensor:
        """Average gradients over dp, clip to `max_norm` (0: off), update, clear gradients.
        Returns the global gradient norm before clipping, a 0-d tensor left on the device."""

    @abstractmethod
    def param_norm(self) -> Tensor:
        """Global L2 norm of the parameters (0-d, on the device)."""

    @abstractmethod
    def describe(self) -> str:
        """One log line: what this rank holds and updates."""

    # --- checkpoints ------------------------------------------------------------------------

    @abstractmethod
    def save(self, step: int, loop_state: bytes) -> float:
        """Checkpoint step_<step> with this rank's loop state; the seconds training blocked."""

    @abstractmethod
    def resume(self) -> Restored | None:
        """Load the newest complete checkpoint that loads; None when there is none."""

    def wait(self) -> None:
        """Block until an asynchronous save is durable and committed (before exit)."""
        return None

    def trace_checkpoint_paths(self, loop_state: bytes) -> None:
        """For a precompile run (graph extraction): run a save and a resume through the same
        code as real ones, so that their device graphs are traced and compiled ahead, leaving
        nothing a real run would load. Eager engines compile nothing: no-op."""
        return None

    def longest_write_seconds(self) -> float | None:
        """Longest asynchronous save so far, start to commit; None when none was measured."""
        return None

    @property
    @abstractmethod
    def committed(self) -> int | None:
        """The newest complete checkpoint's step, as far as this rank knows."""

    def latest_step(self) -> int | None:
        entry = latest_complete(self.root, self.job)
        return entry.step if entry else None

    def _meta(self) -> dict[str, Any]:
        return {"layout": self.layout.__dict__}


def build_engine(spec: PretrainJobSpec, job: str, backend: Backend, world: World,
                 device: torch.device) -> Engine:
    kind = ManagedEngine if backend.parallelizes_model else TorchEngine
    return kind(spec, job, backend, world, device)


# --- torch-native ----------------------------------------------------------------------------


class TorchEngine(Engine):
    def __init__(self, spec: PretrainJobSpec, job: str, backend: Backend, world: World,
                 device: torch.device) -> None:
        super().__init__(spec, job, backend, world, device)
        torch.manual_seed(spec.train.seed)
        model = backend.build_model(device)
        kv = apply_tp(model, world, spec.parallelism.sequence_parallel)  # type: ignore[arg-type]
        apply_ac(model, spec.parallelism.activation_checkpointing)  # type: ignore[arg-type]
        self.model = model
        self.dp = DataParallel(LocalParams.of(model), world, spec.parallelism.zero1,
                               backend.build_optimizer, kv)
        self.optimizer = self.dp.optimizer
        self.layout = Layout.of(world, self.dp.zero1)  # effective: ZeRO-1 needs dp > 1
        self.checkpointer = Checkpointer(self.root, job, spec.checkpoint.keep,
                                         async_=spec.checkpoint.async_, rank=world.rank,
                                         meta=self._meta())
        if spec.evaluation is not None:
            deadline = float(spec.evaluation.deadline_seconds)
            self.checkpointer.hold_for = lambda step: (
                deadline if evaluation_due(spec, step) else 0.0)
        self.snapshots = self._snapshot_store()
        self.slices = DpSlices(world.dp, world.dp_rank, world.dp_group,
                               dp_replicated(self.layout.zero1))
        """A snapshot keeps each rank's 1/dp of what its dp replicas hold alike."""

    def describe(self) -> str:
        w = self.world
        return (f"rank {w.rank} (dp {w.dp_rank}, tp {w.tp_rank}) updates "
                f"{sum(s.numel() for s in self.dp.owned)} of "
                f"{sum(s.numel() for s in self.dp.params.shards)} parameter elements "
                f"(zero1={self.dp.zero1})")

    def _update(self, max_norm: float) -> Tensor:
        began = time.perf_counter()
        self.dp.sync_grads()
        synced = time.perf_counter() - began
        norm = self.dp.clip(max_norm)
        self.sync_seconds = synced + self.dp.step()
        return norm

    def param_norm(self) -> Tensor:
        return self.dp.param_norm()

    @property
    def committed(self) -> int | None:
        return self.checkpointer.committed

    def fence(self, fenced: Callable[[], bool], lately: Callable[[], bool] | None = None
              ) -> None:
        self.checkpointer.fenced = fenced
        if self.snapshots is not None:
            self.snapshots.fenced = lately or fenced

    def wait(self) -> None:
        self.checkpointer.wait()

    def withheld_checkpoint(self) -> int | None:
        return self.checkpointer.withheld

    def commit_withheld(self) -> bool:
        return self.checkpointer.commit_withheld()

    def _wait_staged(self) -> float:
        return self.checkpointer.wait_staged()

    def longest_write_seconds(self) -> float | None:
        return self.checkpointer.longest_write or None

    # The checkpoint's keys. The model's state dict holds DTensors (DCP reshards them). The
    # optimizer's per-parameter state is keyed by parameter name and tp rank: whichever dp rank
    # owns a parameter writes its entries (replicas de-duplicated by DCP), so the keys do not
    # depend on the dp degree or on ZeRO-1. The stochastic-rounding generator and the loop state
    # are per rank.

    def _optimizer_entries(self) -> dict[str, Any]:
        tp = self.world.tp_rank
        entries: dict[str, Any] = {}
        for name, shard in zip(self.dp.params.names, self.dp.params.shards, strict=True):
            for key, value in self.optimizer.state.get(shard, {}).items():
                entries[f"optim.tp{tp}.{name}.{key}"] = value
        return entries

    def _generator(self) -> torch.Generator | None:
        return self.optimizer.generator if isinstance(self.optimizer, AdamWSR) else None

    def _state(self, loop_state: bytes) -> dict[str, Any]:
        r = self.world.rank
        state: dict[str, Any] = {"model": self.model.state_dict(), **self._optimizer_entries(),
                                 f"loop.rank{r}": loop_state}
        gen = self._generator()
        if gen is not None:
            state[f"sr_generator.rank{r}"] = gen.get_state()
        return state

    def save(self, step: int, loop_state: bytes) -> float:
        return self.checkpointer.save(step, self._state(loop_state))

    @property
    def takes_snapshots(self) -> bool:
        return self.snapshots is not None

    def snapshot(self, step: int, loop_state: bytes) -> float:
        if self.snapshots is None:
            return 0.0
        took = self.snapshots.save(step, self.slices.cut(self._state(loop_state)))
        self.snapshot_step = step
        return took

    def _init_optimizer_state(self) -> None:
        """Materialise the optimizer's state (a step with lr 0 on zero gradients) to load into."""
        shards = [p for g in self.optimizer.param_groups for p in g["params"]]
        if all(p in self.optimizer.state for p in shards):
            return
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in shards:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        for p in shards:
            p.grad = None

    def resume(self) -> Restored | None:
        for path in self.checkpointer.remove_incomplete():
            log.warning("removed incomplete checkpoint %s (no `done` marker)", path)
        entry = latest_complete(self.root, self.job)
        durable = entry.step if entry else 0
        resize = (staged(self.snapshots.root, self.job)
                  if self.snapshots is not None else None)  # None: this attempt is no resize
        from_memory = (self._resume_from_memory(durable, resize is not None)
                       or self._resume_resharded(durable, resize))
        if from_memory is not None:
            return from_memory
        if entry is None:
            return None
        saved = read_layout(entry.path) or self.layout
        if saved.tp != self.world.tp:
            raise UserError(
                f"checkpoint {entry.path} was saved with tensor parallel degree {saved.tp}, this "
                f"run has {self.world.tp}: resume with parallelism.tensor={saved.tp}, or start a "
                "new run (another checkpoint.dir)"
            )
        same = saved.world == self.world.size and saved.dp == self.world.dp
        self._init_optimizer_state()
        state = self._state(b"")
        r = self.world.rank
        if not same:  # the loop state of every saving dp rank (its first tp rank holds it)
            del state[f"loop.rank{r}"]
        wanted = [r] if same else [d * saved.tp for d in range(saved.dp)]
        state.update({f"loop.rank{w}": b"" for w in wanted})
        same_partition = same and saved.zero1 == self.layout.zero1
        if not same_partition:
            state.pop(f"sr_generator.rank{r}", None)
        step = self.checkpointer.load_latest(state)
        if step == 0:
            return None
        self._restore_optimizer(state, same_partition, step)
        return Restored(step, saved, {w: state[f"loop.rank{w}"] for w in wanted}, same)

    def _resume_from_memory(self, durable: int, resized: bool) -> Restored | None:
        """Load the newest in-memory snapshot every rank holds, when there is one not older
        than the durable checkpoint of step `durable` (a collective: every rank calls it, and
        every rank gets the same answer). Nothing is loaded unless every rank's fits; none is
        taken on a `resized` attempt (its own snapshots are of the old layout)."""
        state: dict[str, Any] = {}

        def whole(saved: dict[str, Any] | None) -> bool:
            self._init_optimizer_state()  # on every rank alike: a step of the optimizer
            state.update(self._state(b""))
            return saved is not None and fits(self.slices.cut(state), saved)

        found = self._agreed_snapshot(durable, whole, resized)
        if found is None:
            return None
        agreed, saved = found
        copy_into(state, self.slices.join(state, saved))
        self._restore_optimizer(state, True, agreed)
        self.snapshot_step = agreed
        if durable:
            self.checkpointer.committed = durable
        log.info("in-memory snapshot step_%d loaded (durable checkpoint: step_%d)", agreed,
                 durable)
        r = self.world.rank
        return Restored(agreed, self.layout, {r: state[f"loop.rank{r}"]}, True, "snapshot")

    def _resume_resharded(self, durable: int, resize: tuple[int, int] | None
                          ) -> Restored | None:
        """After a resize: load the old world's snapshots its launchers staged (`resize`:
        `replica.staged`'s step and old world), when every rank has them and they are not older than the durable
        checkpoint of step `durable`; the optimizer state re-partitioned and the loop state of
        every old dp rank returned, as from a durable checkpoint of the old size (a collective:
        every rank calls it, and every rank gets the same answer)."""
        if self.snapshots is None:
            return None
        root, job, tp = self.snapshots.root, self.job, self.world.tp
        step, world = resize or (0, 0)
        usable = step >= max(durable, 1) and world % tp == 0
        agreed = agree([step] if usable else [], self._host_group)
        if agreed == 0:
            return None
        old_dp, t = world // tp, self.world.tp_rank
        wanted = sorted({d * tp + t for d in range(old_dp)} | {d * tp for d in range(old_dp)})
        payloads = {r: read_staged(root, job, r, agreed) for r in wanted}
        layouts = {str(p.get("layout")) for p in payloads.values() if p is not None}
        saved = next(iter(payloads.values()))
        old = Layout(**saved["layout"]) if saved is not None and len(layouts) == 1 else None
        self._init_optimizer_state()
        state = self._state(b"")
        r = self.world.rank
        del state[f"loop.rank{r}"]
        state.pop(f"sr_generator.rank{r}", None)
        whole: dict[str, Any] | None = None
        if old is not None and (old.world, old.tp) == (world, tp) and all(
                p is not None for p in payloads.values()):
            pieces = [payloads[d * tp + t]["state"] for d in range(old_dp)]  # type: ignore[index]
            try:
                whole = reassemble(state, pieces, dp_replicated(old.zero1))
            except (KeyError, ValueError) as err:
                log.warning("staged snapshots of step_%d do not make up rank %d's state (%s)",
                            agreed, r, err)
        if not self._all_ok(whole is not None and fits(state, whole)):
            log.warning("staged snapshots of step_%d are not whole for every rank: resuming "
                        "from the durable checkpoint", agreed)
            return None
        assert whole is not None and old is not None
        copy_into(state, whole)
        self._restore_optimizer(state, False, agreed)
        loops = {d * tp: payloads[d * tp]["state"][f"loop.rank{d * tp}"]  # type: ignore[index]
                 for d in range(old_dp)}
        if durable:
            self.checkpointer.committed = durable
        log.info("in-memory snapshot step_%d of %d ranks (dp %d) loaded at %d ranks (dp %d) "
                 "(durable checkpoint: step_%d)", agreed, old.world, old.dp, self.world.size,
                 self.world.dp, durable)
        return Restored(agreed, old, loops, False, "snapshot")

    def _restore_optimizer(self, state: dict[str, Any], same_partition: bool, step: int) -> None:
        tp = self.world.tp_rank
        for name, shard in zip(self.dp.params.names, self.dp.params.shards, strict=True):
            slots = self.optimizer.state.get(shard)
            if slots is None:
                continue
            for key in list(slots):
                loaded = state[f"optim.tp{tp}.{name}.{key}"]
                if loaded is not slots[key]:  # non-tensor entries come back as new objects
                    slots[key] = loaded
        gen = self._generator()
        if gen is None:
            return
        if same_partition:
            gen.set_state(state[f"sr_generator.rank{self.world.rank}"])
        else:  # another partition: the rounding noise restarts from (seed, step), the same on
            # every rank, so that replicas of a parameter keep rounding alike
            gen.manual_seed(self.spec.train.seed * 1_000_003 + step)


# --- backends that parallelise and checkpoint themselves (NxD) --------------------------------


LOOP_DIR = "hlat"
PRECOMPILE_DIR = "_precompile"
"""Under `<root>/<job>/`: the precompile's scratch checkpoint (ManagedEngine.trace_checkpoint_paths)."""


def loop_file(path: Path, rank: int) -> Path:
    return path / LOOP_DIR / f"rank_{rank:05d}.pt"


class ManagedEngine(Engine):
    def __init__(self, spec: PretrainJobSpec, job: str, backend: Backend, world: World,
                 device: torch.device) -> None:
        super().__init__(spec, job, backend, world, device)
        torch.manual_seed(spec.train.seed)
        # tensor/sequence parallel and activation checkpointing come with the backend's model
        self.model = backend.build_model(device)
        self.optimizer = backend.build_optimizer(self.model.parameters())
        self._sharded = [backend.is_tp_sharded(p) for p in self.model.parameters()]
        # the built state as device data now (on XLA its own graph): left pending, it would
        # join the next graph, a resume's load in one start and the first micro-batch in
        # another, so the precompile's traced load (mid-run) would not be the one a restart runs
        backend.step_end()
        self._committed = self.latest_step()
        self._held: set[int] = set()
        """Checkpoints kept past checkpoint.keep for a reader (`purge_checkpoints`)."""
        self.snapshots = self._snapshot_store()
        """What the backend's checkpoint holds of this rank, whole (no dp cut: gathering the
        pieces back would be a device collective, a graph to compile at a restart)."""

    def describe(self) -> str:
        w = self.world
        local = sum(p.numel() for p in self.model.parameters())
        return (f"rank {w.rank} (dp {w.dp_rank}, tp {w.tp_rank}) holds {local} parameter "
                f"elements; {self.backend.name} shards the optimizer (zero1="
                f"{self.spec.parallelism.zero1})")

    def _update(self, max_norm: float) -> Tensor:
        # the backend's optimizer all-reduces over dp, clips to the spec's grad clip (configured
        # when it was built) and keeps the norm it computed
        self.optimizer.step()
        norm = getattr(self.optimizer, "grad_norm", None)
        self.optimizer.zero_grad(set_to_none=True)
        if not isinstance(norm, Tensor):
            raise RuntimeError(f"backend {self.backend.name}: its optimizer reported no "
                               f"gradient norm tensor (grad_norm: {norm!r}) after the step")
        return norm

    def param_norm(self) -> Tensor:
        return nxd_param_norm(self.model, self._sharded, self.world)

    @property
    def committed(self) -> int | None:
        return self._committed

    def save(self, step: int, loop_state: bytes) -> float:
        start = time.perf_counter()
        path = step_dir(self.root, self.job, step)
        target = loop_file(path, self.world.rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        # durable before the backend's save starts: its `done` comes after every rank returns
        write_durably(target, loop_state)
        if self.world.is_coordinator:
            write_durably(path / META_FILE, json.dumps({"step": step, **self._meta()}).encode())
            if self.spec.evaluation is not None and evaluation_due(self.spec, step):
                # its evaluation Job has yet to start: held from now (the backend's `done`
                # may come only at the next save)
                hold_ahead(path, time.time() + float(self.spec.evaluation.deadline_seconds))
        self.backend.save_checkpoint(str(self.root / self.job), step, self.model,
                                     self.optimizer, {"step": step})
        self._settled()
        return time.perf_counter() - start

    def wait(self) -> None:
        self.backend.finalize_checkpoint()
        self._settled()

    @property
    def takes_snapshots(self) -> bool:
        return self.snapshots is not None

    def fence(self, fenced: Callable[[], bool], lately: Callable[[], bool] | None = None
              ) -> None:
        if self.snapshots is not None:  # the backend's save has no hook: snapshots only
            self.snapshots.fenced = lately or fenced

    def snapshot(self, step: int, loop_state: bytes) -> float:
        if self.snapshots is None:
            return 0.0
        started = time.perf_counter()  # the copies to the host hold the loop too
        state = self.backend.snapshot_state(self.model, self.optimizer)
        self.snapshots.save(step, {**state, "loop": loop_state})
        self.snapshot_step = step
        return time.perf_counter() - started

    def _settled(self) -> None:
        """After the backend's save or finalize: the newest complete checkpoint, and retention
        (ours, which keeps what a reader holds; the backend is told to keep every one)."""
        self._committed = self.latest_step()
        if self.world.is_coordinator:
            purge_checkpoints(self.root, self.job, self.spec.checkpoint.keep, self._held)

    def trace_checkpoint_paths(self, loop_state: bytes) -> None:
        """Save step_0 under `<root>/<job>/_precompile/` and resume from it, through `save`,
        `wait` and `resume` themselves (so the traced graphs are the ones a real save and a
        real first resume run, whatever the backend does on device: NxD's save rendezvous and
        tensor syncs, its load's all-reduce broadcast and ZeRO-1 re-shard, our step end;
        neuronx-distributed fbac349 src/neuronx_distributed/trainer/checkpoint.py,
        save_checkpoint l.654-824, _xser_load_data l.347-432, load_checkpoint l.838-967), then
        remove the scratch. It cannot pass for a checkpoint: readers match only
        `<root>/<job>/step_<N>` (hlat_api.layout), `_precompile` is no job name (job names are
        DNS subdomains: no underscore) and steps count from 1. The backend's own save writes
        its `done` marker in the scratch, which is removed before training goes on. Every rank
        calls this (the save and load run collectives)."""
        root, job, committed, snapshots = self.root, self.job, self._committed, self.snapshots
        self.root, self.job = root / job, PRECOMPILE_DIR
        self.snapshots = None  # the scratch is what loads back, never a snapshot
        scratch = self.root / self.job
        try:
            self._clear(scratch)  # one a killed precompile left behind
            self.save(0, loop_state)
            self.wait()
            if self.resume() is None:  # every rank read it back, or none did (the vote)
                raise RuntimeError(f"the precompile's scratch checkpoint {scratch} did not "
                                   "load back: the resume path's graphs were not traced")
        finally:
            self.root, self.job, self._committed = root, job, committed
            self.snapshots = snapshots
        self._clear(scratch)

    def _clear(self, scratch: Path) -> None:
        self._all_ok(True)  # a barrier: no rank still reads or writes it
        if self.world.is_coordinator:
            shutil.rmtree(scratch, ignore_errors=True)
        self._all_ok(True)

    def resume(self) -> Restored | None:
        for path in remove_incomplete(self.root, self.job, self.world.is_coordinator,
                                      self._host_group):
            log.warning("removed incomplete checkpoint %s (no `done` marker)", path)
        entry = latest_complete(self.root, self.job)
        return (self._resume_from_memory(entry.step if entry else 0)
                or load_newest(self.root, self.job, self._load))

    def _resume_from_memory(self, durable: int) -> Restored | None:
        """Load the newest in-memory snapshot every rank holds, when there is one not older
        than the durable checkpoint of step `durable`, and every rank's is whole and of this
        model and optimizer (a collective: every rank calls it and gets the same answer)."""
        found = self._agreed_snapshot(durable, lambda saved: saved is not None and (
            isinstance(saved.get("loop"), bytes)
            and fits(self.model.state_dict(), saved.get("model") or {})
            and set(saved.get("optim") or {}) == set(self.optimizer.state_dict())))
        if found is None:
            return None
        agreed, saved = found
        try:
            self.backend.load_snapshot_state(self.model, self.optimizer, saved)
        except Exception as err:  # peers may be inside the load's collectives: stop here
            raise RuntimeError(
                f"in-memory snapshot step_{agreed} passed every rank's check but did not load "
                f"on rank {self.world.rank}; the ranks cannot agree on another one: {err}"
            ) from err
        self.snapshot_step = agreed
        log.info("in-memory snapshot step_%d loaded (durable checkpoint: step_%d)", agreed,
                 durable)
        return Restored(agreed, self.layout, {self.world.rank: saved["loop"]}, True,
                        "snapshot")

    def _load(self, entry: CheckpointEntry) -> Restored | None:
        """Load one checkpoint if every rank can read it (None: an older one is tried)."""
        saved = read_layout(entry.path) or self.layout
        if saved != self.layout:
            raise UserError(
                f"checkpoint {entry.path} was saved by {saved.world} ranks (dp {saved.dp}, "
                f"tp {saved.tp}, zero1 {saved.zero1}); backend {self.backend.name} resumes "
                f"only the same layout, this run is {self.layout.world} ranks (dp "
                f"{self.layout.dp}, tp {self.layout.tp}, zero1 {self.layout.zero1}): "
                "restore that layout or start a new run (another checkpoint.dir)"
            )
        # Vote before loading: the backend's load runs collectives (NxD's load_checkpoint
        # synchronises the ranks), so a rank that failed inside it would leave its peers
        # blocked there. Each rank checks what it can alone; only a unanimous yes loads.
        loop = self._readable_loop_state(entry.path, entry.step)
        if not self._all_ok(loop is not None):
            log.warning("checkpoint %s is not readable on every rank: trying an older one",
                        entry.path)
            return None
        assert loop is not None
        try:
            self.backend.load_checkpoint(str(self.root / self.job), entry.step, self.model,
                                         self.optimizer)
        except Exception as err:  # peers may be inside the load's collectives: stop here
            raise RuntimeError(
                f"checkpoint {entry.path} passed every rank's check but did not load on "
                f"rank {self.world.rank}; the ranks cannot agree on another one: {err}"
            ) from err
        # the loaded values as device data now (on XLA a graph of their own): left pending,
        # the copies would join the first micro-batch's graph, a graph no run before the
        # restart compiled (on Neuron, a fresh compilation at every restart)
        self.backend.step_end()
        self._committed = entry.step
        return Restored(entry.step, saved, {self.world.rank: loop}, True)

    def _readable_loop_state(self, path: Path, step: int) -> bytes | None:
        """This rank's loop state of a checkpoint, if it and the backend's files are readable."""
        try:
            if not self.backend.checkpoint_readable(str(self.root / self.job), step):
                raise FileNotFoundError(f"the {self.backend.name} checkpoint files of this rank")
            loop = loop_file(path, self.world.rank).read_bytes()
            unpack(loop)  # a truncated file fails here, not after the collective load
            return loop
        except Exception as err:
            log.warning("checkpoint %s is unreadable on rank %d: %s", path, self.world.rank,
                        first_line(err))
            return None
