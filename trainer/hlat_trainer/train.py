"""The training loop: build the pieces from the spec, resume, step, log, checkpoint.

Steps count from 1: the first optimizer step is step 1, `step_<N>` holds the state after N
steps, and a run resumed from it logs step N+1 first. One optimizer step accumulates
gradients over `globalBatch / (microBatch x data-parallel degree)` micro-batches, clips the
global norm, sets the scheduled rate and updates. Everything that must survive a restart is
saved together: model, optimizer (including the stochastic-rounding generator), data loader
position, spike monitor, step and token counters, and the RNG states; the LR schedule is a pure
function of the step. Per-step numbers go to the sinks (stdout JSON or a progress bar,
Prometheus) as one dict, so adding a sink (the heartbeat) touches nothing here.

Every run is a torch.distributed run (one rank when not under torchrun). The device stack
(model, optimizer step, checkpoint format) is an `hlat_trainer.engine.Engine`: on the
torch-native backends `hlat_trainer.parallel` parallelises the pure model (tensor/sequence
parallel, activation checkpointing, data parallel with ZeRO-1) and DCP checkpoints it; on
neuron-xla NxD does both. Each data-parallel rank reads its own stream; tensor-parallel peers
read the same one. The logged loss is the mean over data-parallel ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hlat_api import INSTANCE_TYPES, Job
from hlat_trainer.backends import Backend, select_backend
from hlat_trainer.data import PackedLoader, load_tokenizer
from hlat_trainer.distributed import World
from hlat_trainer.engine import Engine, build_engine, pack, unpack
from hlat_trainer.errors import UserError
from hlat_trainer.heartbeat import LeaseHeartbeat
from hlat_trainer.model import count_params
from hlat_trainer.monitor import GradSpikeMonitor
from hlat_trainer.precision import precision_policy
from hlat_trainer.schedule import lr_at

log = logging.getLogger(__name__)
Sink = Callable[[dict[str, Any]], None]

# Dense BF16 peak per device for MFU where the instance table has none (GPUs by name).
_GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10G": 70.0}


@dataclass
class TrainState:
    """Counters that survive restarts, besides the model, optimizer and loader."""

    step: int = 0
    tokens: int = 0
    monitor: GradSpikeMonitor = field(default_factory=GradSpikeMonitor)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = state["step"], state["tokens"]
        self.monitor.load_state_dict(state["monitor"])


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak matmul FLOP/s of one rank: the table for accelerators, a short GEMM on CPU.

    On CPU the rate is that of the fastest of several timed GEMMs: a machine busy with other
    work while the trainer starts would otherwise yield a peak below what later steps reach,
    and an MFU above 1.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in _GPU_PEAK_TFLOPS.items() if k in name), 989.0) * 1e12
    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    fastest = float("inf")
    for _ in range(16):
        start = time.perf_counter()
        a @ b
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * n**3 / fastest


class Trainer:
    def __init__(self, job: Job, *, sinks: list[Sink] | None = None,
                 backend: Backend | None = None) -> None:
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
        )
        self.state = TrainState()
        self.longest_save = 0.0
        self.peak_flops = self._peak_flops()
        self.heartbeat = LeaseHeartbeat.from_environment(self.world.local_rank)
        if self.heartbeat is not None:
            self.sinks.append(self.heartbeat)
            self.heartbeat.start()

    def _peak_flops(self) -> float:
        table = INSTANCE_TYPES[self.spec.instance_type].peak_tflops_per_rank
        if table is not None and self.device.type != "cpu":
            return table * 1e12
        return measure_peak_flops(self.device, self.policy.param_dtype)

    # --- state ----------------------------------------------------------------------------------

    def loop_state(self) -> bytes:
        """This rank's part of a checkpoint besides the model and optimizer (the engine's)."""
        return pack({"loader": self.loader.state_dict(), "train": self.state.state_dict(),
                     "rng": torch.get_rng_state()})

    def maybe_resume(self) -> int:
        """Load the newest complete checkpoint, if any; returns the step it holds (0: fresh)."""
        restored = self.engine.resume()
        if restored is None:
            return 0
        if restored.same_layout:
            loop = unpack(restored.loop_states[self.world.rank])
            self.loader.load_state_dict(loop["loader"])
            torch.set_rng_state(loop["rng"])
        else:
            loops = [unpack(restored.loop_states[r]) for r in sorted(restored.loop_states)]
            loop = loops[0]
            self.loader.reshard([s["loader"] for s in loops])
            log.warning(
                "resumed step_%d, saved by %d ranks (dp %d), on %d ranks (dp %d): data streams "
                "re-dealt from the earliest unfinished document (%s); optimizer state re-"
                "partitioned by parameter name", restored.step, restored.saved.world,
                restored.saved.dp, self.world.size, self.world.dp, self.loader.position_text())
        self.state.load_state_dict(loop["train"])
        log.info("resumed from checkpoint step_%d: next step is %d", restored.step,
                 restored.step + 1)
        return restored.step

    # --- the loop ---------------------------------------------------------------------------------

    def _batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        for inputs, targets in self.loader:
            yield inputs.to(self.device), targets.to(self.device)

    def train_step(self, batches: Iterator[tuple[Tensor, Tensor]], step: int) -> dict[str, Any]:
        spec, accum = self.spec, self.spec.grad_accum_steps
        start = time.perf_counter()
        lr = lr_at(step, lr=spec.optimizer.lr, min_lr=spec.optimizer.min_lr,
                   warmup_steps=spec.optimizer.warmup_steps, total_steps=spec.total_steps)
        self.engine.set_lr(lr)
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        for _ in range(accum):
            t0 = time.perf_counter()
            inputs, targets = next(batches)
            data_wait += time.perf_counter() - t0
            with self.backend.autocast():
                logits = self.model(inputs)
            loss = self.backend.loss(logits, targets) / accum
            loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach()
        grad_norm_t = self.engine.step(spec.optimizer.grad_clip)
        if self.world.dp > 1:
            dist.all_reduce(loss_sum, group=self.world.dp_group)
            loss_sum /= self.world.dp
        param_norm_t = self.engine.param_norm()
        self.backend.step_end()  # on XLA: the step is one graph; the numbers below read it back
        grad_norm, param_norm = float(grad_norm_t), float(param_norm_t)
        seconds = time.perf_counter() - start
        tokens = spec.tokens_per_step
        self.state.step, self.state.tokens = step, self.state.tokens + tokens
        tps = tokens / seconds
        return {
            "step": step, "loss": loss_sum.item(), "lr": lr, "grad_norm": grad_norm,
            "param_norm": param_norm, "tokens_per_second": tps, "step_seconds": seconds,
            "data_wait_seconds": data_wait, "tokens": self.state.tokens, "tokens_step": tokens,
            "mfu": self.dims.flops_per_token(spec.data.seq_len) * tps
            / (self.peak_flops * spec.world_size),
            "grad_spike": self.state.monitor.observe(grad_norm),
        }

    def _beat(self, **fields: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.update(checkpoint_step=self.engine.committed, **fields)

    def save(self, step: int) -> float:
        self._beat(phase="checkpointing")
        blocked = self.engine.save(step, self.loop_state())
        self.longest_save = max(self.longest_save, blocked)
        self._beat(phase="training", checkpoint_seconds=self.longest_save)
        log.info("checkpoint step_%d: training blocked %.3fs", step, blocked)
        return blocked

    def run(self) -> dict[str, Any]:
        """Train to the spec's step count; returns the last step's stats."""
        total = self.spec.total_steps
        first = self.maybe_resume() + 1
        log.info(
            "job %s: %s parameters, %d steps of %d tokens (%d micro-batches of %dx%d), "
            "precision %s, starting at step %d",
            self.job.name, f"{count_params(self.model):,}", total, self.spec.tokens_per_step,
            self.spec.grad_accum_steps, self.spec.train.micro_batch, self.spec.data.seq_len,
            self.spec.precision, first,
        )
        stats: dict[str, Any] = {"step": first - 1}
        self._beat(phase="training", step=first - 1, tokens=self.state.tokens)
        batches = self._batches()
        finished = False
        try:
            for step in range(first, total + 1):
                stats = self.train_step(batches, step)
                if step % self.spec.checkpoint.interval == 0 or step == total:
                    stats["checkpoint_blocking_seconds"] = self.save(step)
                if step % self.spec.train.log_interval == 0 or step == total:
                    for sink in self.sinks:
                        sink(stats)
                self._beat()
            self.engine.wait()
            finished = True
        finally:
            self.loader.close()
            if self.heartbeat is not None:
                self._beat()
                self.heartbeat.stop(phase="finished" if finished else None)
        hist = self.state.monitor.histogram()
        log.info("finished at step %d; gradient spikes by length: %s", self.state.step, hist)
        return stats
