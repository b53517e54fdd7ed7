"""The neuron-xla backend on real torch-xla (PJRT CPU), with only NxD's parts replaced.

Everything the XLA path does outside neuronx-distributed is the real code: the backend's
device, its graph cuts (`micro_batch_end`, `step_end`), its precision (nxd_precision: bf16
parameters, the hardware-SR setting in the environment), its optimizer and checkpoint calls, the
ManagedEngine step and resume, the training loop and its host reads. Under ZeRO-1 the optimizer is
torch-xla's own ZeroRedundancyOptimizer, the class NxD's NeuronZero1Optimizer subclasses, built
with the keywords NxD would pass (nxd_standin.py). What NxD itself would do is replaced:

- model: `hlat_trainer.model.Transformer` (the same math as nxd_model.NxDTransformer at tp 1,
  which test_xla_nxd_model.py runs on XLA against it);
- NxD's glue (`initialize_parallel_optimizer`, `save_checkpoint`, `load_checkpoint`): stand-ins
  that follow NxD's call order and side effects, cited line by line (nxd_standin.py): above all,
  a single `load_checkpoint` call loads the optimizer before the model.
The process group is gloo on one rank (the loss and vote collectives run on host tensors).
"""

from __future__ import annotations

from typing import Any

import nxd_standin
import torch
import torch.distributed as dist
from torch import Tensor, nn

from hlat_trainer.backends.base import Backend
from hlat_trainer.backends.neuron_xla import NeuronXlaBackend
from hlat_trainer.distributed import World, join, local_rank
from hlat_trainer.precision import PrecisionPolicy

ClippingAdamW = nxd_standin.ClippingAdamW  # kept importable from here


class CpuXlaBackend(NeuronXlaBackend):
    """neuron-xla with NxD's model and glue replaced (see the module doc)."""

    def nxd(self) -> Any:
        return nxd_standin.module()

    def init_world(self) -> World:
        join(self.spec, "gloo")
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        return World(dist.get_rank(), dist.get_world_size(), local_rank(), 1, 1,
                     dp_group=group, tp_group=group)

    def _model_init_config(self) -> dict[str, Any]:
        return {"meta_device_init": False}  # the model here is model.Transformer, built below

    def _activation_checkpoint_config(self) -> type[nn.Module] | None:
        return None

    def build_model(self, device: torch.device) -> nn.Module:
        from hlat_trainer.model import build_model

        model = build_model(self.spec.model.dims(), device, seed=self.spec.train.seed)
        return PrecisionPolicy(self.spec.precision, self.param_dtype(), None).apply(model)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return Backend.loss(self, logits, targets)

    def checkpoint_readable(self, directory: str, step: int) -> bool:
        return nxd_standin.shard_path(directory, f"step_{step}", "model").is_file()
