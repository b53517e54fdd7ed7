"""The training loop: build the pieces from the spec, resume, step, log, checkpoint.

Steps count from 1: the first optimizer step is step 1, `step_<N>` holds the state after N
steps, and a run resumed from it logs step N+1 first. One optimizer step accumulates
gradients over this rank's share of the step's `globalBatch / microBatch` micro-batches (the
first ranks one more where the data-parallel degree does not divide them), clips the
global norm, sets the scheduled rate and updates. Everything that must survive a restart is
saved together: model, optimizer (including the stochastic-rounding generator), data loader
position, spike monitor, step and token counters, and the RNG states; the LR schedule is a pure
function of the step. Per-step numbers go to the sinks (stdout JSON or a progress bar,
Prometheus) as one dict, so adding a sink (the heartbeat) touches nothing here.

The loop drives; the engine steps. Values are read back from the device only on the steps
that are logged (`train.logInterval`) or checkpointed, in one transfer: on XLA a read is a
wait for the device, and a read every step would serialise host and device. Every step's
gradient norm still reaches the spike monitor (kept on the device until the next read).
Under `neuron_parallel_compile`'s graph extraction (NEURON_EXTRACT_GRAPHS_ONLY) tensors are
dummies, so no checkpoint is saved: a job resuming from it would start from zeros. That run
exists to trace every graph the real run will meet, and the tool compiles only what it saw
(pytorch-neuron-parallel-compile.rst: "additional compilations due to unreached execution
paths"); a graph first met mid-run compiles there, inside the steady-state hang timeout. So
the extraction run also meets the graphs a real run meets later: after its first step a
logged step's (the parameter norm, the host reads), half-way a save's and a resume's device
work (`Engine.trace_checkpoint_paths`: a scratch save and load, removed after).

Every run is a torch.distributed run (one rank when not under torchrun). The device stack
(model, optimizer step, checkpoint format) is an `hlat_trainer.engine.Engine`: on the
torch-native backends `hlat_trainer.parallel` parallelises the pure model (tensor/sequence
parallel, activation checkpointing, data parallel with ZeRO-1) and DCP checkpoints it; on
neuron-xla NxD does both. Each data-parallel rank reads its own stream; tensor-parallel peers
read the same one. The logged loss is the mean over data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hlat_api import INSTANCE_TYPES, Env, ExitCode, Job, PretrainJobSpec
from hlat_api.spec import SNAPSHOT_AUTO_PROBE_STEPS, SNAPSHOT_AUTO_SHARE, micro_batch_share
from hlat_trainer.backends import Backend, select_backend
from hlat_trainer.data import PackedLoader, Tokenizer, load_tokenizer
from hlat_trainer.data.digest import MASK, batch_digest, digest_text
from hlat_trainer.distributed import World
from hlat_trainer.engine import Engine, StepResult, build_engine, pack, unpack
from hlat_trainer.errors import UserError
from hlat_trainer.heartbeat import LeaseHeartbeat
from hlat_trainer.ledger import Ledger
from hlat_trainer.model import count_params
from hlat_trainer.monitor import GradSpikeMonitor
from hlat_trainer.neuron_env import EXTRACT_GRAPHS_ONLY, extracting_graphs_only
from hlat_trainer.ondemand import CheckpointRequests
from hlat_trainer.precision import precision_policy
from hlat_trainer.schedule import lr_at

log = logging.getLogger(__name__)

COMPUTE_WINDOW_STEPS = 20
"""Steps whose compute (and gradient sync) times the heartbeat's `compute_seconds` (and
`sync_seconds`) is the median of: one slow step (a garbage collection, a save's copy) moves no
median."""

FINAL_COMMIT_WAIT_SECONDS = 900
"""How long rank 0 waits, after the run's last step, for the API server to accept a Lease
renewal so that it may commit the last checkpoint (`_commit_withheld`)."""
LINGER_ENV = "HLAT_FAULT_LINGER_WHILE_EXISTS"
"""Fault injection for tests and drills: after finishing, do not exit while this path exists
(at most an hour), as a process stuck in its teardown (a collective's destructor) would."""


EXIT_ENV = "HLAT_FAULT_EXIT_WHILE_EXISTS"
"""Fault injection for tests and drills: while this path exists, a starting trainer exits
with 1 once its heartbeat began (a worker that breaks on every start)."""


LEAK_ENV = "HLAT_FAULT_LEAK_ONCE"
"""Fault injection for tests and drills: the trainer that removes this path (one, when several
look at once) allocates memory without bound from then on, as a runaway leak would, until the
kernel kills it at its container's memory limit (without a limit, it exits 1 at 8 GiB)."""


def _leak_for_drills(path: str | None) -> None:
    if not path:
        return
    try:
        os.unlink(path)  # the claim: only one trainer leaks
    except OSError:
        return
    log.error("%s taken: allocating memory until killed (drill)", path)
    hoard = [bytearray(64 << 20) for _ in range(128)]  # zero-filled: every page touched
    log.error("%d MiB allocated and not killed: no memory limit (drill)", 64 * len(hoard))
    raise SystemExit(1)


def _exit_for_drills() -> None:
    path = os.environ.get(EXIT_ENV)
    if path and os.path.exists(path):
        log.error("%s exists: exiting (drill)", path)
        raise SystemExit(1)


def _say_started() -> None:
    """Create hlat-launch's HLAT_STARTED_FILE (if it set one): the attempt is training."""
    path = os.environ.get(Env.STARTED_FILE)
    if path:
        try:
            open(path, "a").close()
        except OSError as err:  # the launcher then starts its standbys after its bound
            log.warning("could not create %s (%s): %s", Env.STARTED_FILE, path, err)


def _linger_for_drills() -> None:
    path = os.environ.get(LINGER_ENV)
    deadline = time.monotonic() + 3600
    while path and os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)
Sink = Callable[[dict[str, Any]], None]

# Dense BF16 peak per device for MFU where the instance table has none (GPUs by name).
_GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10G": 70.0}


@dataclass(frozen=True)
class StepStats:
    """What the loop knows of a step without reading the device."""

    step: int
    lr: float
    result: StepResult


RECENT_STEPS = 1024
"""How many of the last steps' times a checkpoint or snapshot keeps (`TrainState.seconds`):
more than a worker trains between two heartbeat renewals (10 s by default). Global rank 0's
only (the rank whose ledger the operator reads), as two tensors (torch.load's weights-only
unpickler refuses bytes): 18 KiB and 0.29 ms a snapshot here (a dict of floats took 0.47 ms);
the other ranks' states hold none."""


@dataclass
class TrainState:
    """Counters that survive restarts, besides the model, optimizer and loader."""

    step: int = 0
    tokens: int = 0
    monitor: GradSpikeMonitor = field(default_factory=GradSpikeMonitor)
    seconds: dict[int, float] = field(default_factory=dict)
    """The seconds the ledger charged each of the last `RECENT_STEPS` steps to training (less
    data wait and compilation), in the attempt that trained it: an attempt that resumes from a
    state newer than the last step the operator saw reported (a snapshot taken after the last
    renewal) has those steps' time from here (`carried_after`)."""

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "tokens": self.tokens, "monitor": self.monitor.state_dict()}
        if self.seconds:  # rank 0's only: the others keep none, and write nothing for it
            state["seconds"] = (torch.tensor(list(self.seconds), dtype=torch.int64),
                                torch.tensor(list(self.seconds.values()), dtype=torch.float64))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = state["step"], state["tokens"]
        self.monitor.load_state_dict(state["monitor"])
        self.seconds = {}  # none on ranks but 0, nor in checkpoints before 2026-11-29
        if "seconds" in state:
            steps, seconds = state["seconds"]
            self.seconds = dict(zip(steps.tolist(), seconds.tolist(), strict=True))

    def trained(self, step: int, seconds: float) -> None:
        """`seconds` more of step `step`'s training (a step is charged in parts)."""
        self.seconds[step] = self.seconds.get(step, 0.0) + seconds
        while len(self.seconds) > RECENT_STEPS:  # steps arrive in order: the first is oldest
            del self.seconds[next(iter(self.seconds))]

    def carried_after(self, done: int) -> float:
        """The training seconds of the steps this state holds past step `done`."""
        return sum(s for k, s in self.seconds.items() if done < k <= self.step)


def steps_done(env: Mapping[str, str]) -> int:
    """The highest step an earlier attempt finished (the operator's HLAT_STEPS_DONE; 0 when
    unset): steps up to it are recomputed work."""
    raw = env.get(Env.STEPS_DONE, "")
    try:
        return max(0, int(raw)) if raw else 0
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", Env.STEPS_DONE, raw)
        return 0


PEAK_GEMM_SECONDS = 0.02
"""The CPU peak is timed on the largest square GEMM (128 to 1024, doubling) that takes about
this long on one thread: a 1024 GEMM in fp32 takes ~24 ms here, but in bf16, which this CPU
emulates, 2.3 s (17 of them held every bf16 run's start for 40 s; 256 there: 25 ms each)."""


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak matmul FLOP/s of one rank: the table for accelerators, a short GEMM on CPU.

    On CPU: the fastest of several GEMMs on one thread, timed in that thread's CPU time, times
    the threads the rank computes with. A machine busy with other work while the trainer
    starts takes the CPU away for part of any GEMM timed by the wall clock, and every one of 16
    was (CI, 2 cores, with three times as many runnable processes): the peak came out below what
    later steps reached, an MFU above 1. CPU time counts only what the GEMM ran; one thread,
    so that no thread spins waiting for a sibling the scheduler took off its core. The GEMM's
    size is the largest up to 1024 that still takes about PEAK_GEMM_SECONDS, so the measurement
    takes well under a second in any dtype.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in _GPU_PEAK_TFLOPS.items() if k in name), 989.0) * 1e12
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 128
        while True:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            start = time.thread_time()
            a @ b  # a warm-up, and the size probe
            if n >= 1024 or time.thread_time() - start >= PEAK_GEMM_SECONDS:
                break
            n *= 2
        fastest = float("inf")
        for _ in range(16):
            start = time.thread_time()
            a @ b
            fastest = min(fastest, time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return threads * 2 * n**3 / max(fastest, 1e-9)


def known_peak_flops(device: torch.device, dtype: torch.dtype, path: str | None) -> float:
    """`measure_peak_flops`, kept in the JSON file `path` (when given) by device and dtype: a
    later attempt in the same pod reads it instead of measuring again."""
    key = f"{device.type}/{dtype}".replace("torch.", "")
    known: dict[str, Any] = {}
    if path:
        with contextlib.suppress(OSError, ValueError, TypeError):
            known = dict(json.loads(Path(path).read_text()))
        value = known.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    peak = measure_peak_flops(device, dtype)
    if path:
        try:  # atomically: the node's other local ranks may write it at the same time
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({**known, key: peak}, f)
            os.replace(tmp, path)
        except OSError as err:
            log.warning("could not keep the peak FLOP/s in %s: %s", path, err)
    return peak


def held_out_batches(spec: PretrainJobSpec, tokenizer: Tokenizer, dp: int = 1, dp_rank: int = 0
                     ) -> list[tuple[Tensor, Tensor]]:
    """Data-parallel rank `dp_rank`'s share (of `dp`) of the held-out set (spec.eval), read
    once and kept on the host: the set's first `eval.batches` micro-batches, read as a step's
    global batch is (one lane per sequence) and dealt as one (`micro_batch_share`), so that
    the set is the same at every data-parallel degree: an elastic job's evaluations compare
    across sizes, and `hlat-eval` and bench_fidelity read all of it in one process. With
    fewer micro-batches than ranks the last ranks get none. None without spec.eval."""
    ev = spec.eval
    if ev is None:
        return []
    readers = min(dp, ev.batches)
    if dp_rank >= readers:
        return []
    sequences = ev.batches * spec.train.micro_batch
    mine = len(micro_batch_share(ev.batches, readers, dp_rank))
    try:
        with PackedLoader(ev.path, tokenizer, text_column=spec.data.text_column,
                          seq_len=spec.data.seq_len, micro_batch=spec.train.micro_batch,
                          dp_rank=dp_rank, dp_size=readers,
                          seed=spec.data.shuffle_seed, global_batch=sequences,
                          lanes=sequences) as loader:
            return [next(loader) for _ in range(mine)]
    except UserError as err:  # its messages speak of data.path
        raise UserError(f"eval.path {ev.path}: {err}".replace("data.path", "eval.path")
                        .replace("data path", "path")) from err


class Trainer:
    def __init__(self, job: Job, *, sinks: list[Sink] | None = None,
                 backend: Backend | None = None) -> None:
        self.ledger = Ledger()  # the attempt's clock started with the launcher
        spec = job.spec
        self.job, self.spec = job, spec
        self.backend = backend or select_backend(spec)
        self.world: World = self.backend.init_world()
        self.device = self.backend.device(self.world.local_rank)
        self.sinks = sinks or []
        self.dims = spec.model.dims()
        self.tokenizer = load_tokenizer(spec.data.tokenizer)
        if self.tokenizer.vocab_size > self.dims.vocab_size:
            raise UserError(
                f"tokenizer {spec.data.tokenizer} has {self.tokenizer.vocab_size} tokens but "
                f"model.vocabSize is {self.dims.vocab_size}: set model.vocabSize to at least "
                f"{self.tokenizer.vocab_size}"
            )
        self.policy = precision_policy(spec.precision)
        self.engine: Engine = build_engine(spec, job.name, self.backend, self.world, self.device)
        self.model = self.engine.model
        log.info("%s", self.engine.describe())
        self.loader = PackedLoader(
            spec.data.path, self.tokenizer, text_column=spec.data.text_column,
            seq_len=spec.data.seq_len, micro_batch=spec.train.micro_batch,
            dp_rank=self.world.dp_rank, dp_size=self.world.dp, seed=spec.data.shuffle_seed,
            # one lane per sequence: a step's global batch is the same at every dp degree
            global_batch=spec.train.global_batch, lanes=spec.train.global_batch,
        )
        self.eval_batches = held_out_batches(spec, self.tokenizer, self.world.dp,
                                             self.world.dp_rank)
        self._evaluated = False  # this attempt has not evaluated yet
        self.state = TrainState()
        self._digest = 0  # of this rank's sequences since the last report (data.digest)
        self._unobserved: list[Tensor] = []  # grad norms not yet fed to the spike monitor
        # the compute and gradient sync times of the last steps (Heartbeat.compute_seconds and
        # sync_seconds: their medians)
        self._computed: deque[float] = deque(maxlen=COMPUTE_WINDOW_STEPS)
        self._synced: deque[float] = deque(maxlen=COMPUTE_WINDOW_STEPS)
        self._waited: deque[float] = deque(maxlen=COMPUTE_WINDOW_STEPS)
        self._hosted: deque[float] = deque(maxlen=COMPUTE_WINDOW_STEPS)
        self.extracting_graphs = extracting_graphs_only(os.environ)
        self.longest_save = 0.0
        self.leak_path = os.environ.get(LEAK_ENV)
        self._window = (time.perf_counter(), 0, 0.0)  # last report: when, at which step, saves
        self.peak_flops = self._peak_flops()
        self.steps_done = steps_done(os.environ)
        self.first_step = 1
        """This attempt's first step (after its resume)."""
        self.snapshot_plan = self.spec.snapshot_interval
        """checkpoint.memoryInterval in effect, worked out once (the spec's property checks the
        node's memory: not a per-step question)."""
        self.snapshot_every: int | None = None
        """memoryInterval auto: the interval chosen in this attempt (None: not yet)."""
        self.resumed_from = "checkpoint"
        """What the attempt resumed from (`maybe_resume`): a durable `checkpoint` or a `snapshot`."""
        self.heartbeat = LeaseHeartbeat.from_environment(self.world.local_rank)
        beat = self.heartbeat
        self.requests = CheckpointRequests(
            (lambda: beat.checkpoint_request if beat is not None else 0)
            if os.environ.get(Env.HEARTBEAT_LEASE) else None,
            self.engine.host_group if self.world.size > 1 else None)
        """Checkpoints the operator asks for now (a preemption, a suspend): `ondemand`."""
        self._asked_save: int | None = None
        """The step of a checkpoint saved on request, until it is complete and published."""
        self.ledger.charge("startup")
        if self.heartbeat is not None:
            self.engine.fence(self.heartbeat.fenced_now, self.heartbeat.fenced_lately)
            self.sinks.append(self.heartbeat)
            self._beat(phase="starting")
            self.heartbeat.start().watch_requests()
        _exit_for_drills()

    def _peak_flops(self) -> float:
        table = INSTANCE_TYPES[self.spec.instance_type].peak_tflops_per_rank
        if table is not None and self.device.type != "cpu":
            return table * 1e12
        return known_peak_flops(self.device, self.policy.param_dtype,
                                os.environ.get(Env.PEAK_FLOPS_FILE))

    # --- state ----------------------------------------------------------------------------------

    def loop_state(self) -> bytes:
        """This rank's part of a checkpoint besides the model and optimizer (the engine's)."""
        return pack({"loader": self.loader.state_dict(), "train": self.state.state_dict(),
                     "rng": torch.get_rng_state()})

    def maybe_resume(self) -> int:
        """Load the newest complete checkpoint, if any; returns the step it holds (0: fresh).
        `resumed_from` says from what: the durable checkpoint or an in-memory snapshot."""
        restored = self.engine.resume()
        self.resumed_from = restored.source if restored is not None else "checkpoint"
        if restored is None:
            return 0
        if restored.same_layout:
            loop = unpack(restored.loop_states[self.world.rank])
            self.loader.load_state_dict(loop["loader"])
            torch.set_rng_state(loop["rng"])
        else:
            loops = [unpack(restored.loop_states[r]) for r in sorted(restored.loop_states)]
            loop = loops[0]
            how = self.loader.reshard([s["loader"] for s in loops])
            log.warning(
                "resumed step_%d, saved by %d ranks (dp %d), on %d ranks (dp %d): data: %s "
                "(%s); optimizer state re-partitioned by parameter name", restored.step,
                restored.saved.world, restored.saved.dp, self.world.size, self.world.dp, how,
                self.loader.position_text())
        self.state.load_state_dict(loop["train"])
        where = "in-memory snapshot" if restored.source == "snapshot" else "checkpoint"
        log.info("resumed from %s step_%d: next step is %d", where, restored.step,
                 restored.step + 1)
        return restored.step

    # --- the loop ---------------------------------------------------------------------------------

    def _batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The loader's micro-batches (host tensors: the engine moves each to the device),
        added to the digest of the steps since the last report on tensor-parallel rank 0 (its
        peers read the same sequences)."""
        for inputs, targets in self.loader:
            if self.world.tp_rank == 0:
                self._digest = (self._digest + batch_digest(inputs, targets)) & MASK
            yield inputs, targets

    def train_step(self, batches: Iterator[tuple[Tensor, Tensor]], step: int) -> StepStats:
        """One optimizer step, driven: the engine runs it; nothing is read from the device."""
        spec = self.spec
        lr = lr_at(step, lr=spec.optimizer.lr, min_lr=spec.optimizer.min_lr,
                   warmup_steps=spec.optimizer.warmup_steps, total_steps=spec.total_steps)
        result = self.engine.train_step(batches, lr)
        if result.compute_seconds is not None:
            self._computed.append(result.compute_seconds)
        if result.sync_seconds is not None:
            self._synced.append(result.sync_seconds)
        self._waited.append(result.data_wait_seconds)
        if result.host_seconds is not None:
            self._hosted.append(result.host_seconds)
        self.state.step, self.state.tokens = step, self.state.tokens + spec.tokens_per_step
        self._unobserved.append(result.grad_norm)
        return StepStats(step, lr, result)

    def observe_norms(self) -> int:
        """Feed the spike monitor every step's gradient norm since the last call (one
        device-to-host transfer); returns how many of those steps spiked."""
        norms, self._unobserved = self.backend.to_host(self._unobserved), []
        return sum(self.state.monitor.observe(n) for n in norms)

    def report(self, s: StepStats) -> dict[str, Any]:
        """The numbers of a logged step: the only place a step's values leave the device.

        Step time and throughput are averaged over the steps since the last report, measured
        once the values are read (the device has then finished them) and less the time saves
        blocked: on a lazy device (XLA) one step's host time is only its tracing time."""
        spikes = self.observe_norms()
        loss, grad_norm, param_norm = self.backend.to_host(
            [s.result.loss, s.result.grad_norm, self.engine.param_norm()])
        now, (since, last_step, saved) = time.perf_counter(), self._window
        seconds = max(now - since - saved, 1e-9) / max(s.step - last_step, 1)
        self._window = (now, s.step, 0.0)
        tokens = self.spec.tokens_per_step
        tps = tokens / seconds
        digest, self._digest = self.engine.sum_over_ranks(self._digest), 0
        return {
            "step": s.step, "time": round(time.time(), 3), "loss": loss, "lr": s.lr, "grad_norm": grad_norm,
            "param_norm": param_norm, "tokens_per_second": tps, "step_seconds": seconds,
            "data_wait_seconds": s.result.data_wait_seconds, "tokens": self.state.tokens,
            "tokens_step": tokens,
            "mfu": self.dims.flops_per_token(self.spec.data.seq_len) * tps
            / (self.peak_flops * self.spec.world_size),
            "grad_spikes": spikes,
            "spike_lengths": self.state.monitor.histogram(),
            "compute_seconds": statistics.median(self._computed) if self._computed else None,
            "sync_seconds": statistics.median(self._synced) if self._synced else None,
            "data_wait_median_seconds": statistics.median(self._waited) if self._waited else None,
            "host_seconds": statistics.median(self._hosted) if self._hosted else None,
            # the sequences trained since the last line (recomputed ones included), summed
            # over the ranks: the same at every data-parallel degree for the same data
            "batch_digest": digest_text(digest),
        }

    def _beat(self, **fields: Any) -> None:
        """Hand the heartbeat the loop's state: its step with the ledger that counts it (every
        beat comes after the step's charge). A beat during a save or an evaluation after step
        N says N, not the N - 1 of the last line written: a worker lost there had step N
        counted productive, and the next gang, told N - 1 was the last step done, counted it
        productive again."""
        if self.heartbeat is not None:
            fields.setdefault("step", self.state.step)
            fields.setdefault("tokens", self.state.tokens)
            committed = self.engine.committed
            self.heartbeat.update(checkpoint_step=committed,
                                  snapshot_step=self.engine.snapshot_step,
                                  activity=self.ledger.snapshot(), **fields)
            asked = self._asked_save
            if asked is not None and committed is not None and committed >= asked:
                self._asked_save = None  # the operator waits for this news: told at once
                self.heartbeat.renew_soon()

    def _charge_step(self, step: int, data_wait: float, compiled_since: float,
                     staged: float = 0.0) -> float:
        """Charge the loop's time since the last charge to this step (productive, or recompute
        when an earlier attempt finished it), less its data wait, compilation and the wait for
        an asynchronous save's copy of the state (`staged`, checkpoint time); returns the
        compile seconds counted so far (the next step's baseline)."""
        compiled = self.backend.compile_seconds()
        kind = "recompute" if step <= self.steps_done else "productive"
        before = self.ledger.seconds[kind]
        self.ledger.charge(kind, data_wait=data_wait, compile=compiled - compiled_since,
                           checkpoint=staged)
        if self.world.rank == 0:  # the ledger the operator reads
            self.state.trained(step, self.ledger.seconds[kind] - before)
        return compiled

    def _commit_withheld(self) -> None:
        """The run's last checkpoint, written whole but held back by the fence (no Lease
        renewal accepted for longer than its duration: the API server away as the run ended):
        wait for a renewal to be accepted, then commit it, so that the job ends with its last
        state complete (an earlier one held back is superseded by the next; the last has no
        next). Bounded by `FINAL_COMMIT_WAIT_SECONDS`, then a failure: the operator restarts
        from the newest complete checkpoint. Refused for good (another attempt holds this
        rank): stops as a fenced trainer does, committing nothing."""
        step = self.engine.withheld_checkpoint()
        if step is None or self.heartbeat is None:
            return
        heartbeat, began = self.heartbeat, time.monotonic()
        log.warning("checkpoint step_%d, the run's last, is written but not committed: waiting "
                    "up to %ds for the API server to accept a Lease renewal", step,
                    FINAL_COMMIT_WAIT_SECONDS)
        noted = began
        while not self.engine.commit_withheld():
            now = time.monotonic()
            if heartbeat.fenced:
                log.error("checkpoint step_%d not committed: this attempt is over (its Lease "
                          "refuses renewals); stopping", step)
                raise SystemExit(ExitCode.FENCED)
            if now - began >= FINAL_COMMIT_WAIT_SECONDS:
                raise RuntimeError(
                    f"checkpoint step_{step}, the run's last, is written but not committed: no "
                    f"Lease renewal accepted in {FINAL_COMMIT_WAIT_SECONDS}s; a restart resumes "
                    "from the newest complete checkpoint")
            if now - noted >= 60:
                log.warning("checkpoint step_%d: still waiting for the API server (%.0fs of "
                            "%ds)", step, now - began, FINAL_COMMIT_WAIT_SECONDS)
                noted = now
            time.sleep(heartbeat.period)
        log.info("checkpoint step_%d committed %.1fs after the run ended, once a Lease renewal "
                 "was accepted", step, time.monotonic() - began)

    def save_bound(self) -> float | None:
        """How long a save may hold the loop, for the operator's `checkpointing` timeout: the
        longest whole write so far (asynchronous: start to commit, since a save waits for the
        previous write; synchronous: the save itself); None before the first (the operator
        then allows its startup bound)."""
        if self.spec.checkpoint.async_:
            return self.engine.longest_write_seconds()
        return self.longest_save or None

    def trace_evaluation(self) -> None:
        """In the extraction run, after its first step: an evaluation's graphs (its
        micro-batches' forwards, the mean over the ranks, the one value read back), which a
        short precompile run would otherwise meet after its last step at most, if its
        interval allowed. They are the same graphs after any step: parameters are device data
        between steps, and the evaluation reads no optimizer or loop state."""
        log.info("graph extraction (%s): tracing an evaluation's graphs", EXTRACT_GRAPHS_ONLY)
        self.evaluate()  # dummy values: not reported
        self.ledger.charge("compile")  # all it is for

    def trace_checkpoint_paths(self) -> None:
        """In the extraction run, before its first step: a save's and a resume's graphs (see
        the module docstring). Half-way: the steps before it are a fresh run's first steps,
        those after it a resumed run's (the first steps after a load are graphs of their own),
        so the extraction run needs a few steps on each side."""
        log.info("graph extraction (%s): tracing a save's and a resume's graphs",
                 EXTRACT_GRAPHS_ONLY)
        self._beat(phase="checkpointing", checkpoint_seconds=self.save_bound())
        self.engine.trace_checkpoint_paths(self.loop_state())
        self.ledger.charge("compile")  # all it is for

    def save(self, step: int) -> float:
        if self.extracting_graphs:  # tensors hold dummy values: a checkpoint would be zeros
            log.info("graph extraction (%s): checkpoint step_%d not saved",
                     EXTRACT_GRAPHS_ONLY, step)
            return 0.0
        self.observe_norms()  # the monitor is part of the saved loop state
        self._beat(phase="checkpointing", checkpoint_seconds=self.save_bound())
        blocked = self.engine.save(step, self.loop_state())
        self.longest_save = max(self.longest_save, blocked)
        self._beat(phase="training", checkpoint_seconds=self.save_bound())
        log.info("checkpoint step_%d: training blocked %.3fs", step, blocked)
        return blocked

    def snapshots_due(self, step: int) -> bool:
        """Whether this rank snapshots its state into memory after `step` (the same answer on
        every rank: memoryInterval auto is decided by a collective, `_choose_interval`)."""
        every = self.snapshot_plan
        if every is None or self.extracting_graphs or not self.engine.takes_snapshots:
            return False  # none to take: no host sync for them either (on XLA, a read back)
        if every == "auto":
            if self.snapshot_every is None:  # the probe: every rank at the same step
                return step - self.first_step + 1 == SNAPSHOT_AUTO_PROBE_STEPS
            every = self.snapshot_every
        return step % every == 0

    def _choose_interval(self, held: float, step: int) -> None:
        """memoryInterval auto, after the probe snapshot that held the loop `held` seconds:
        the smallest interval whose snapshots hold it under SNAPSHOT_AUTO_SHARE of the
        training time, from the slowest rank's snapshot and mean step so far."""
        steps = step - self.first_step + 1
        trained = self.ledger.seconds["productive"] + self.ledger.seconds["recompute"]
        held, per_step = self.engine.max_over_ranks([held, trained / steps])
        self.snapshot_every = max(1, math.ceil(held / (SNAPSHOT_AUTO_SHARE * per_step)))
        log.info("in-memory snapshots (memoryInterval auto): every %d step(s): one holds the "
                 "loop %.3fs, a step takes %.3fs", self.snapshot_every, held, per_step)

    def snapshot(self, step: int) -> float:
        """Step `step`'s state into this pod's memory (checkpoint.memoryInterval)."""
        self.observe_norms()  # the monitor is part of the loop state
        return self.engine.snapshot(step, self.loop_state())

    def evaluates(self, step: int, total: int) -> bool:
        """Whether the held-out loss is taken after `step` (spec.eval)."""
        ev = self.spec.eval
        return ev is not None and (step % ev.interval == 0 or step == total)

    def evaluate(self) -> float:
        """The held-out loss now (one value read back), the heartbeat kept alive meanwhile. On
        a compiling backend an attempt's first evaluation compiles its graphs (loads them, if
        a precompile traced them: `trace_evaluation`): its workers report `compiling`
        meanwhile, so the operator allows its startup bound, not the steady one."""
        phase = "compiling" if self.backend.compiles and not self._evaluated else "training"
        self._beat(phase=phase)
        loss = self.engine.eval_loss(self.eval_batches, each=lambda: self._beat(phase=phase))
        (value,) = self.backend.to_host([loss])
        self._evaluated = True
        return value

    def _off_step_time(self, seconds: float) -> None:
        """Keep `seconds` the loop spent on something else (a save, an evaluation) out of the
        step time the next report logs."""
        since, last_step, saved = self._window
        self._window = (since, last_step, saved + seconds)

    def _evaluate_after(self, step: int, compiled: float) -> tuple[float, float]:
        """The held-out loss after `step`: its time charged to evaluation (less compilation,
        `compiled` the compile seconds counted so far) and kept out of the logged step time;
        returns the loss and the compile seconds now counted."""
        value = self.evaluate()
        compiled_now = self.backend.compile_seconds()
        spent = self.ledger.charge("evaluation", compile=compiled_now - compiled)
        self._off_step_time(spent)
        self._beat(phase="training", validation_loss=value, validation_step=step)
        log.info("step %d: validation loss %.4f (%.3fs)", step, value, spent)
        return value, compiled_now

    def run(self) -> dict[str, Any]:
        """Train to the spec's step count; returns the last step's stats."""
        total = self.spec.total_steps
        self.ledger.charge("startup")  # the caller's set-up since __init__ (e.g. sinks)
        first = self.first_step = self.maybe_resume() + 1
        log.info(
            "job %s: %s parameters, %d steps of %d tokens (%d micro-batches of %dx%d, %d on "
            "this rank), precision %s, starting at step %d",
            self.job.name, f"{count_params(self.model):,}", total, self.spec.tokens_per_step,
            self.spec.micro_batches_per_step, self.spec.train.micro_batch,
            self.spec.data.seq_len, self.spec.micro_batches(self.world.dp_rank),
            self.spec.precision, first,
        )
        # a fresh start found nothing to load: looking was part of starting, not a restore
        self.ledger.charge("startup" if first == 1 else "memory_restore"
                           if self.resumed_from == "snapshot" else "restore")
        stats: dict[str, Any] = {"step": first - 1}
        self._window = (time.perf_counter(), first - 1, 0.0)  # since, at step, saves blocked
        # on a compiling backend (XLA) the first step of every attempt compiles its graphs
        carried = self.state.carried_after(self.steps_done)
        if carried > 0:
            log.info("resumed past step %d, the last the operator saw done: steps %d-%d took "
                     "%.2f s in the attempt that trained them, reported now", self.steps_done,
                     self.steps_done + 1, first - 1, carried)
        self._beat(phase="compiling" if self.backend.compiles else "training", step=first - 1,
                   tokens=self.state.tokens, resumed_step=first - 1,
                   carried_seconds=round(carried, 3))
        batches = self._batches()
        finished = False
        compiled = self.backend.compile_seconds()
        try:
            for step in range(first, total + 1):
                done = self.train_step(batches, step)
                if step == first:
                    _say_started()
                wait, staged = done.result.data_wait_seconds, done.result.staging_wait_seconds
                if step == first and self.extracting_graphs and self.backend.compiles:
                    compiled = self._charge_step(step, wait, compiled, staged)
                    wait = staged = 0.0
                    log.info("graph extraction (%s): tracing a logged step's graphs",
                             EXTRACT_GRAPHS_ONLY)
                    self.report(done)  # to no sink: dummy values
                    self.ledger.charge("compile")  # all it is for
                    if self.spec.eval is not None:
                        self.trace_evaluation()
                if step == (first + total) // 2 and self.extracting_graphs and self.backend.compiles:
                    compiled = self._charge_step(step, wait, compiled, staged)
                    wait = staged = 0.0
                    self.trace_checkpoint_paths()
                if staged:  # the update waited for the last save's copy: that save's time
                    self._off_step_time(staged)
                blocked = None
                asked = self.requests.due()  # every rank, every step: the same answer
                if step % self.spec.checkpoint.interval == 0 or step == total or asked:
                    self.observe_norms()  # waits for the step: its time is the step's
                    compiled = self._charge_step(step, wait, compiled, staged)
                    wait = staged = 0.0
                    if asked:
                        log.info("checkpoint step_%d: asked for by the operator (request %d)",
                                 step, asked)
                        self._asked_save = step
                    self.save(step)
                    # all the save held the loop (building the state included), not only the
                    # checkpointer's part: what the log, the step time and goodput all use
                    blocked = self.ledger.charge("checkpoint")
                    self._off_step_time(blocked)
                if self.snapshots_due(step):
                    compiled = self._charge_step(step, wait, compiled, staged)
                    wait = staged = 0.0
                    self.snapshot(step)
                    held = self.ledger.charge("snapshot")
                    self._off_step_time(held)
                    blocked = (blocked or 0.0) + held
                    if self.snapshot_every is None and self.snapshot_plan == "auto":
                        self._choose_interval(held, step)
                evaluating = self.evaluates(step, total) and not self.extracting_graphs
                if step % self.spec.train.log_interval == 0 or step == total or evaluating:
                    stats = self.report(done)
                    # the step ends where its line says (its `time`): writing the line is the
                    # next step's time, as in the next line's stepSeconds; a worker lost
                    # after this step's report has then lost only unreported time
                    compiled = self._charge_step(step, wait, compiled, staged)
                    wait = staged = 0.0
                    if evaluating:  # after the report, as the precompile traces it: the
                        # report reads the step's values back, so no evaluation graph holds
                        # a piece of the step's (`trace_evaluation`)
                        validation, compiled = self._evaluate_after(step, compiled)
                        stats["validation_loss"] = validation
                        stats["validation_perplexity"] = math.exp(min(validation, 700.0))
                    if blocked is not None:
                        stats["checkpoint_blocking_seconds"] = blocked
                    stats["recomputed"] = step <= self.steps_done
                    for sink in self.sinks:
                        sink(stats)
                else:
                    compiled = self._charge_step(step, wait, compiled, staged)
                self._beat(phase="training")
                _leak_for_drills(self.leak_path)
            self.requests.close()
            # the final asynchronous write: say so, or a long one looks like a hang and gets a
            # finished job restarted; the operator allows the longest write seen x its safety
            # factor (none seen yet: its startup bound)
            self._beat(phase="checkpointing", checkpoint_seconds=self.save_bound())
            self.engine.wait()
            self._commit_withheld()
            self.ledger.charge("final_checkpoint")
            finished = True
        finally:
            self.loader.close()
            if self.heartbeat is not None:
                self._beat()
                self.heartbeat.stop(phase="finished" if finished else None)
        hist = self.state.monitor.histogram()
        log.info("finished at step %d; gradient spikes by length: %s", self.state.step, hist)
        _linger_for_drills()
        return stats
