"""The neuron-xla engine on real torch-xla (PJRT CPU): graphs, compilations, host transfers.

What a Trainium user would otherwise find out on the device, at the cost of hours of
compilation: a step must be one graph per micro-batch plus one for the optimizer, the same
graphs every step (whatever the accumulation count, i.e. the node count), across a checkpoint
save and across a resume; nothing read back to the host except on the steps that are logged or
checkpointed; and bf16 parameters (hardware stochastic rounding on Trainium) stay bf16.
Counts come from `torch_xla.debug.metrics` (CompileTime, ExecuteTime, TransferFromDeviceTime).
The backend is the real NeuronXlaBackend with NxD's model and glue replaced on the XLA device
and torch-xla's own ZeRO-1 optimizer (xla_standin.py).
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch import Tensor
from xla_standin import CpuXlaBackend

from hlat_api import Job
from hlat_trainer.train import Trainer

NAMES = ("CompileTime", "ExecuteTime", "TransferFromDeviceTime")


def counts() -> dict[str, int]:
    """The metrics' counts once the device has finished what was scheduled (executions are
    asynchronous: their count would otherwise lag)."""
    xm.wait_device_ops()
    out = {}
    for name in NAMES:
        data = met.metric_data(name)
        out[name] = int(data[0]) if data else 0
    return out


@dataclass
class Probe:
    """Metric counts at the start and end of every engine step of a trainer."""

    starts: list[dict[str, int]] = field(default_factory=list)
    ends: list[dict[str, int]] = field(default_factory=list)

    def attach(self, trainer: Trainer) -> None:
        step = trainer.engine.train_step

        def probed(batches: Iterator[tuple[Tensor, Tensor]], lr: float) -> Any:
            self.starts.append(counts())
            out = step(batches, lr)
            self.ends.append(counts())
            return out

        trainer.engine.train_step = probed  # type: ignore[method-assign]

    def within(self, name: str) -> list[int]:
        """Per step: counted inside the engine's step."""
        return [e[name] - s[name] for s, e in zip(self.starts, self.ends, strict=True)]

    def between(self, name: str, last: dict[str, int]) -> list[int]:
        """Per step: counted from its start to the next step's start (its logging and save)."""
        nxt = [*self.starts[1:], last]
        return [n[name] - s[name] for s, n in zip(self.starts, nxt, strict=True)]


def train(job: Job) -> tuple[Trainer, Probe, dict[str, int]]:
    # a process trains one job: the previous test's trainer is garbage held by reference
    # cycles, and its tensors' pending views would join this job's first graph
    gc.collect()
    trainer = Trainer(job, backend=CpuXlaBackend(job.spec))
    probe = Probe()
    probe.attach(trainer)
    trainer.run()
    return trainer, probe, counts()


def test_a_step_is_one_graph_per_micro_batch_plus_the_update_and_compiles_nothing_new(
    make_job: Callable[..., Job],
) -> None:
    """12 steps of 4 micro-batches, logged every 4, saved every 6 (warm-up: up to the first
    logged and the first saved step, which compile the parameter norm and nothing else)."""
    job = make_job(train__steps=12, train__globalBatch=8, train__microBatch=2,
                   train__logInterval=4, checkpoint__interval=6)
    assert job.spec.grad_accum_steps == 4
    trainer, probe, last = train(job)
    assert probe.within("ExecuteTime") == [4 + 1] * 12
    compiled = probe.between("CompileTime", last)
    assert sum(compiled[6:]) == 0, compiled  # the second half: a save, logging, schedule moving
    assert trainer.state.step == 12


def test_the_graphs_do_not_depend_on_the_accumulation_count(
    make_job: Callable[..., Job],
) -> None:
    """The node count sets the accumulation count; the compiled graphs must not change with it."""
    train(make_job(name="a", train__steps=3, train__globalBatch=4, train__microBatch=2))
    before = counts()["CompileTime"]
    _, probe, _ = train(make_job(name="b", train__steps=3, train__globalBatch=12,
                                 train__microBatch=2))
    assert probe.within("ExecuteTime") == [6 + 1] * 3
    assert counts()["CompileTime"] == before


def test_nothing_is_read_back_to_the_host_except_on_logged_and_checkpointed_steps(
    make_job: Callable[..., Job],
) -> None:
    job = make_job(train__steps=10, train__logInterval=5, checkpoint__interval=4)
    _, probe, last = train(job)
    reads = probe.between("TransferFromDeviceTime", last)
    assert all(n == 0 for n in probe.within("TransferFromDeviceTime")), reads
    quiet = [step for step, n in enumerate(reads, start=1) if n == 0]
    assert quiet == [1, 2, 3, 6, 7, 9], reads  # 4, 8 saved; 5, 10 logged (10 also saved)


def test_an_evaluation_reads_back_one_value(
    make_job: Callable[..., Job], held_out_data: Path,
) -> None:
    """Logged every 3 steps, evaluated every 6 over 3 micro-batches: step 6's evaluation adds
    one read to its report's (the mean loss over its micro-batches, not one per micro-batch),
    and its graphs run 3 forwards and the mean, no update."""
    job = make_job(train__steps=9, train__logInterval=3, checkpoint__interval=100,
                   eval={"path": str(held_out_data), "interval": 6, "batches": 3})
    _, probe, last = train(job)
    reads = probe.between("TransferFromDeviceTime", last)
    assert reads[5] == reads[2] + 1, reads  # step 6 (logged, evaluated) vs 3 (logged)
    runs = probe.between("ExecuteTime", last)
    assert runs[5] - runs[2] == 3 + 1, runs  # 3 micro-batch forwards, the mean


def test_after_a_resume_the_steps_are_the_graphs_compiled_before_it(
    make_job: Callable[..., Job],
) -> None:
    """8 steps saved at 4 and 8; step_8 is lost and the job restarts from step_4. The loaded
    state becomes device data in a graph of its own; the training steps that follow are the
    graphs compiled before the restart (on Neuron: found in the persistent compile cache, not
    compiled again), and they end where the uninterrupted run ended."""
    job = make_job(train__steps=8, checkpoint__interval=4)
    straight, _, _ = train(job)
    final = {k: v.cpu() for k, v in straight.model.state_dict().items()}
    shutil.rmtree(Path(job.spec.checkpoint.dir, "job", "step_8"))
    resumed, probe, last = train(job)
    assert len(probe.starts) == 4  # steps 5..8
    compiled = probe.between("CompileTime", last)
    assert sum(compiled) == 0, compiled
    for name, tensor in final.items():
        torch.testing.assert_close(resumed.model.state_dict()[name].cpu(), tensor, msg=name)


def test_bf16_parameters_with_hardware_stochastic_rounding_stay_bf16(
    make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parameters stay bf16; the ZeRO-1 shards (master weights, moments) are fp32, so that
    the gradient norm is (nxd_precision)."""
    monkeypatch.setenv("NEURON_RT_STOCHASTIC_ROUNDING_EN", "1")  # what worker_environment sets
    job = make_job(precision="bf16-sr", train__steps=3)
    trainer, _, _ = train(job)
    dtypes = {p.dtype for p in trainer.model.parameters()}
    assert dtypes == {torch.bfloat16}
    state = trainer.engine.optimizer.base_optimizer.state  # type: ignore[attr-defined]
    moments = {v.dtype for s in state.values() for k, v in s.items() if k != "step"}
    assert moments == {torch.float32}
    assert all(p.device.type == "xla" for p in trainer.model.parameters())
    assert Path(job.spec.checkpoint.dir, "job", "step_3", "done").exists()


def test_compilation_is_charged_to_compile_and_the_first_step_reports_compiling(
    make_job: Callable[..., Job],
) -> None:
    """Goodput's compile badput on a compiling backend is torch-xla's own CompileTime, taken
    out of the steps it happened in; the phases the heartbeat would carry say `compiling`
    until the first step is done."""
    # a sequence length no other test uses: torch-xla reuses graphs it compiled in-process
    job = make_job(name="compile", train__steps=4, checkpoint__interval=4, data__seqLen=24)
    trainer = Trainer(job, backend=CpuXlaBackend(job.spec))
    phases: list[str] = []
    beat = trainer._beat

    def recording(**fields: Any) -> None:
        if "phase" in fields:
            phases.append(fields["phase"])
        beat(**fields)

    trainer._beat = recording  # type: ignore[method-assign]
    before = trainer.backend.compile_seconds()
    trainer.run()
    spent = trainer.ledger.snapshot()
    compiled = trainer.backend.compile_seconds() - before
    assert compiled > 0
    assert spent.compile == pytest.approx(compiled, abs=0.01)
    assert spent.productive > 0 and spent.compile < spent.total()
    assert phases[0] == "compiling" and phases[1] == "training"


def test_each_step_s_device_time_is_measured_without_a_host_sync_its_update_apart(
    make_job: Callable[..., Job],
) -> None:
    """The host cannot time an XLA device without waiting for it; the runtime's buffer-ready
    callbacks give each graph's end (`devicetime`). A step's compute is its micro-batch graphs'
    device time, its update graph's is apart (as sync): here the update is made heavy (sixteen
    1024x1024 matmuls kept as an output of the optimizer's step, some 20 times the tiny
    model's forward and backward), so a compute that counted it would exceed it. The first two
    steps are left out: each graph's first execution carries the runtime's warm-up (0.4 s for
    the first micro-batch graph in a fresh process), which the worker's median absorbs and the
    operator does not score (the attempt is `compiling` until its first step is done). No host
    read comes with it (the test above counts them)."""
    job = make_job(name="devtime", train__steps=8, train__logInterval=8,
                   checkpoint__interval=100)
    gc.collect()
    trainer = Trainer(job, backend=CpuXlaBackend(job.spec))
    engine = trainer.engine
    heavy = torch.randn(1024, 1024).to(engine.device) / 32
    kept: list[Tensor] = []
    update, step = engine.optimizer.step, engine.train_step

    def burdened(*args: Any, **kwargs: Any) -> Any:
        out = update(*args, **kwargs)
        x = heavy
        for _ in range(16):
            x = torch.tanh(x @ heavy)
        kept[:] = [x.sum()]  # alive at the step's sync: an output of the update graph
        return out

    results = []

    def recording(batches: Iterator[tuple[Tensor, Tensor]], lr: float) -> Any:
        results.append(step(batches, lr))
        return results[-1]

    engine.optimizer.step = burdened  # type: ignore[method-assign]
    engine.train_step = recording  # type: ignore[method-assign]
    trainer.run()
    timed = [r for r in results[2:] if r.compute_seconds is not None]
    assert len(timed) >= 4, [(r.compute_seconds, r.sync_seconds) for r in results]
    for r in timed:
        assert r.sync_seconds is not None and 0 < r.compute_seconds < r.sync_seconds, r
        assert r.host_seconds is None  # the update's device time is the sync's
