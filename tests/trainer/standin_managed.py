"""A CPU backend that manages itself the way neuronx-distributed does, to drive ManagedEngine.

NxD cannot run here, so this stand-in exercises what the training loop does with a backend that
`parallelizes_model`: its optimizer averages gradients over data parallel, clips, and exposes
`grad_norm`; it saves and loads the model and optimizer itself, one file per rank under
`step_<N>/`, and writes `done` the way NxD's checkpoint does (synchronously: after a barrier;
asynchronously: only when the next save begins or at `finalize_checkpoint`). Its load ends in
a collective, as NxD's does, so a rank failing inside it leaves its peers waiting there. It is not NxD and
tests nothing of NxD: it tests our engine against the contract NxD is documented to follow.

Run as `torchrun ... standin_managed.py --config FILE` (the hlat-train command line).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hlat_api import PretrainJobSpec
from hlat_trainer.backends.torch_native import TorchNativeBackend
from hlat_trainer.cli import main
from hlat_trainer.distributed import World


class AveragingAdamW(torch.optim.AdamW):
    """AdamW that first averages gradients over data parallel and clips them, like NxDOptimizer."""

    def __init__(self, params: Iterable[Tensor], *, max_norm: float, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.max_norm = max_norm
        self.grad_norm: Tensor | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        size = dist.get_world_size()
        for p in params:
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= size
        self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        return super().step(closure)


class StandInManagedBackend(TorchNativeBackend):
    parallelizes_model = True

    def __init__(self, spec: PretrainJobSpec) -> None:
        super().__init__(spec, "cpu")
        self.pending: Path | None = None

    def init_world(self) -> World:
        world = super().init_world()
        assert world.tp == 1, "the stand-in does data parallel only"
        return world

    def build_optimizer(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        o = self.spec.optimizer
        return AveragingAdamW(params, max_norm=o.grad_clip or 1e30, lr=o.lr, betas=o.betas,
                              eps=o.eps, weight_decay=o.weight_decay, foreach=True)

    def save_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer, user_content: dict[str, int]) -> None:
        self._mark_done()  # the previous asynchronous save, as NxD's next `begin` does
        tag = Path(directory) / f"step_{step}"
        rank = dist.get_rank()
        tag.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                    "user": user_content}, tag / f"shard_{rank}.pt")
        self.pending = tag
        if not self.spec.checkpoint.async_:
            self._mark_done()

    def _mark_done(self) -> None:
        if self.pending is None:
            return
        dist.barrier()
        if dist.get_rank() == 0:  # no purge: the backend passes NxD num_kept_ckpts=None,
            # with which NxD removes no complete checkpoint (trainer/checkpoint.py 95)
            (self.pending / "done").write_text("1")
        dist.barrier()
        self.pending = None

    def _shard(self, directory: str, step: int) -> Path:
        return Path(directory) / f"step_{step}" / f"shard_{dist.get_rank()}.pt"

    def checkpoint_readable(self, directory: str, step: int) -> bool:
        shard = self._shard(directory, step)
        return shard.is_file() and shard.stat().st_size > 0

    def load_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> None:
        shard = torch.load(self._shard(directory, step), weights_only=True)
        model.load_state_dict(shard["model"])
        optimizer.load_state_dict(shard["optim"])
        dist.barrier()  # the ranks meet inside the load, as NxD's load_checkpoint does

    def finalize_checkpoint(self) -> None:
        self._mark_done()


if __name__ == "__main__":
    sys.exit(main(backend=StandInManagedBackend))
