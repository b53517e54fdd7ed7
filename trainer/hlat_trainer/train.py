"""The training loop: build the pieces from the spec, resume, step, log, checkpoint.

Steps count from 1: the first optimizer step is step 1, `step_<N>` holds the state after N
steps, and a run resumed from it logs step N+1 first. One optimizer step accumulates
gradients over `globalBatch / (microBatch x data-parallel degree)` micro-batches, clips the
global norm, sets the scheduled rate and updates. Everything that must survive a restart is
saved together: model, optimizer (including the stochastic-rounding generator), data loader
position, spike monitor, step and token counters, and the RNG states; the LR schedule is a pure
function of the step. Per-step numbers go to the sinks (stdout JSON or a progress bar,
Prometheus) as one dict, so adding a sink (the heartbeat) touches nothing here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hlat_api import INSTANCE_TYPES, Job
from hlat_trainer.checkpoint import Checkpointer
from hlat_trainer.data import PackedLoader, load_tokenizer
from hlat_trainer.errors import UserError
from hlat_trainer.model import Transformer, build_model, count_params
from hlat_trainer.monitor import GradSpikeMonitor
from hlat_trainer.optim import build_optimizer
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
    """Peak matmul FLOP/s of one rank: the table for accelerators, a short GEMM on CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in _GPU_PEAK_TFLOPS.items() if k in name), 989.0) * 1e12
    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    start, reps = time.perf_counter(), 8
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start)


class Trainer:
    def __init__(self, job: Job, *, device: str = "cpu", sinks: list[Sink] | None = None) -> None:
        spec = job.spec
        if spec.world_size != 1:
            raise UserError(
                f"spec asks for {spec.world_size} ranks ({spec.nodes} nodes x "
                f"{spec.ranks_per_node} processes) but this is a single process: "
                "--set nodes=1 --set processesPerNode=1, or launch under torchrun"
            )
        self.job, self.spec, self.device = job, spec, torch.device(device)
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
        torch.manual_seed(spec.train.seed)
        self.model: Transformer = build_model(self.dims, self.device, seed=spec.train.seed)
        self.policy.apply(self.model)
        o = spec.optimizer
        self.optimizer = build_optimizer(
            list(self.model.parameters()), precision=spec.precision, lr=o.lr, betas=o.betas,
            eps=o.eps, weight_decay=o.weight_decay, seed=spec.train.seed,
        )
        self.loader = PackedLoader(
            spec.data.path, self.tokenizer, text_column=spec.data.text_column,
            seq_len=spec.data.seq_len, micro_batch=spec.train.micro_batch,
            dp_rank=0, dp_size=spec.data_parallel, seed=spec.data.shuffle_seed,
        )
        self.state = TrainState()
        self.checkpointer = Checkpointer(spec.checkpoint.dir, job.name, spec.checkpoint.keep)
        self.peak_flops = self._peak_flops()

    def _peak_flops(self) -> float:
        table = INSTANCE_TYPES[self.spec.instance_type].peak_tflops_per_rank
        if table is not None and self.device.type != "cpu":
            return table * 1e12
        return measure_peak_flops(self.device, self.policy.param_dtype)

    # --- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "train": self.state.state_dict(),
            "rng": {"cpu": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.state.load_state_dict(state["train"])
        torch.set_rng_state(state["rng"]["cpu"])

    def maybe_resume(self) -> int:
        """Load the newest complete checkpoint, if any; returns the step it holds (0: fresh)."""
        for path in self.checkpointer.remove_incomplete():
            log.warning("removed incomplete checkpoint %s (no `done` marker)", path)
        found = self.checkpointer.load_latest()
        if found is None:
            return 0
        step, state = found
        self.load_state_dict(state)
        log.info("resumed from checkpoint step_%d: next step is %d", step, step + 1)
        return step

    # --- the loop ---------------------------------------------------------------------------------

    def _batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        for inputs, targets in self.loader:
            yield inputs.to(self.device), targets.to(self.device)

    def train_step(self, batches: Iterator[tuple[Tensor, Tensor]], step: int) -> dict[str, Any]:
        spec, accum = self.spec, self.spec.grad_accum_steps
        start = time.perf_counter()
        lr = lr_at(step, lr=spec.optimizer.lr, min_lr=spec.optimizer.min_lr,
                   warmup_steps=spec.optimizer.warmup_steps, total_steps=spec.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        for _ in range(accum):
            t0 = time.perf_counter()
            inputs, targets = next(batches)
            data_wait += time.perf_counter() - t0
            with self.policy.autocast(self.device.type):
                logits = self.model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / accum
            loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach()
        params: list[Tensor] = [p for p in self.model.parameters() if p.grad is not None]
        clip = spec.optimizer.grad_clip if spec.optimizer.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        param_norm = torch.linalg.vector_norm(
            torch.stack([n.float() for n in torch._foreach_norm(params)])
        ).item()
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

    def save(self, step: int) -> float:
        blocked = self.checkpointer.save(step, self.state_dict())
        log.info("saved checkpoint step_%d in %.2fs", step, blocked)
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
        batches = self._batches()
        try:
            for step in range(first, total + 1):
                stats = self.train_step(batches, step)
                if step % self.spec.checkpoint.interval == 0 or step == total:
                    stats["checkpoint_blocking_seconds"] = self.save(step)
                if step % self.spec.train.log_interval == 0 or step == total:
                    for sink in self.sinks:
                        sink(stats)
        finally:
            self.loader.close()
        hist = self.state.monitor.histogram()
        log.info("finished at step %d; gradient spikes by length: %s", self.state.step, hist)
        return stats
