"""A ZeRO-1 resume on torch-xla's own ZeroRedundancyOptimizer (the class NxD's
NeuronZero1Optimizer subclasses) through a stand-in of NxD's checkpoint calls that keeps NxD's
order: one `load_checkpoint` call loads the optimizer, then the model (nxd_standin.py, cited).

Why it matters: the optimizer's `load_state_dict` re-shards the parameters as they are when it
runs; a resume that feeds it the fresh initialisation trains on from there, silently. The
resumed run must end exactly where the uninterrupted one ended, loss for loss."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from xla_standin import CpuXlaBackend

from hlat_api import Job
from hlat_trainer.train import Trainer


def run(job: Job) -> tuple[Trainer, dict[int, float]]:
    trainer = Trainer(job, backend=CpuXlaBackend(job.spec))
    losses: dict[int, float] = {}
    trainer.sinks.append(lambda stats: losses.__setitem__(stats["step"], stats["loss"]))
    trainer.run()
    return trainer, losses


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr", "mixed"])
def test_a_zero1_resume_continues_the_uninterrupted_run_exactly(
    make_job: Callable[..., Job], precision: str,
) -> None:
    """fp32: the loaded model is what the optimizer re-shards (the two calls' order); bf16-sr
    and mixed: bf16 parameters under fp32 master weights, which only the checkpoint holds."""
    job = make_job(precision=precision, parallelism={"zero1": True}, train__steps=8,
                   train__logInterval=1, checkpoint__interval=4)
    straight, straight_losses = run(job)
    assert isinstance(straight.engine.optimizer, ZeroRedundancyOptimizer)
    final = weights(straight)
    shutil.rmtree(Path(job.spec.checkpoint.dir, "job", "step_8"))
    resumed, resumed_losses = run(job)
    assert sorted(resumed_losses) == [5, 6, 7, 8]
    assert {s: straight_losses[s] for s in resumed_losses} == resumed_losses
    for name, tensor in final.items():
        torch.testing.assert_close(weights(resumed)[name], tensor, rtol=0, atol=0, msg=name)


def test_zero1_computes_the_gradient_norm_in_fp32_under_bf16_parameters(
    make_job: Callable[..., Job],
) -> None:
    """The spike monitor reads this norm: in bf16 (optimizer_dtype bf16) it has 3 digits."""
    job = make_job(precision="bf16-sr", parallelism={"zero1": True}, train__steps=2)
    trainer, _ = run(job)
    optimizer: Any = trainer.engine.optimizer
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert optimizer.grad_norm.dtype == torch.float32
    shards = [p for g in optimizer.base_optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in shards} == {torch.float32}  # the master weights
