"""The neuron-xla backend on real torch-xla (PJRT CPU), with only NxD's parts replaced.

Everything the XLA path does outside neuronx-distributed is the real code: the backend's
device, its graph cuts (`micro_batch_end`, `step_end`), its precision (bf16 parameters, the
hardware-SR setting in the environment), the ManagedEngine step and resume, the training loop
and its host reads. NxD itself is not installable here, so its three pieces are replaced by
their torch equivalents on the XLA device, keeping NxD's contract (hlat_trainer.backends.base,
`parallelizes_model`):

- model: `hlat_trainer.model.Transformer` (the same math as nxd_model.NxDTransformer at tp 1);
- optimizer: torch's AdamW that clips and keeps the norm as `grad_norm`, as NxDOptimizer does
  (one rank: no data-parallel averaging to do);
- checkpoints: each rank's model and optimizer state copied to the host and saved with
  torch.save under `step_<N>/`, `done` written last (NxD's layout rule).
The process group is gloo on one rank (the loss and vote collectives run on host tensors).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hlat_trainer.backends.base import Backend
from hlat_trainer.backends.neuron_xla import NeuronXlaBackend
from hlat_trainer.distributed import World, join, local_rank


class ClippingAdamW(torch.optim.AdamW):
    """AdamW that clips the global gradient norm first and exposes it, like NxDOptimizer."""

    def __init__(self, params: Iterable[Tensor], *, max_norm: float, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.max_norm = max_norm
        self.grad_norm: Tensor | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        return super().step(closure)


def _host(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_host(v) for v in obj]
    return obj


class CpuXlaBackend(NeuronXlaBackend):
    """neuron-xla with NxD's model, optimizer and checkpoint replaced (see the module doc)."""

    def init_world(self) -> World:
        join(self.spec, "gloo")
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        return World(dist.get_rank(), dist.get_world_size(), local_rank(), 1, 1,
                     dp_group=group, tp_group=group)

    def build_model(self, device: torch.device) -> nn.Module:
        from hlat_trainer.model import build_model
        from hlat_trainer.precision import precision_policy

        model = build_model(self.spec.model.dims(), device, seed=self.spec.train.seed)
        return precision_policy(self.spec.precision).apply(model)

    def build_optimizer(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        o = self.spec.optimizer
        return ClippingAdamW(params, max_norm=o.grad_clip or 1e30, lr=o.lr, betas=o.betas,
                             eps=o.eps, weight_decay=o.weight_decay)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return Backend.loss(self, logits, targets)

    def _shard(self, directory: str, step: int) -> Path:
        return Path(directory) / f"step_{step}" / f"shard_{dist.get_rank()}.pt"

    def save_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer, user_content: dict[str, int]) -> None:
        self.step_end()
        shard = self._shard(directory, step)
        shard.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": _host(model.state_dict()), "optim": _host(optimizer.state_dict())},
                   shard)
        dist.barrier()
        if dist.get_rank() == 0:
            (shard.parent / "done").write_text("1")

    def checkpoint_readable(self, directory: str, step: int) -> bool:
        return self._shard(directory, step).is_file()

    def load_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> None:
        state = torch.load(self._shard(directory, step), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def finalize_checkpoint(self) -> None:
        return None  # saves are synchronous here
