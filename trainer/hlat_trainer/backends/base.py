"""The device-stack interface: what differs between CPU, CUDA and the two Neuron paths.

Why one interface: the training loop, the data loader and the checkpoint layout are the same on
every device; what is not is small and listed here, so the loop asks the backend instead of
branching on device names. Two kinds of backend exist:

- torch-native (`cpu`, `cuda`, `neuron-native`): the plain `hlat_trainer.model.Transformer` on a
  torch device; the trainer applies `hlat_trainer.parallel` (DTensor TP/SP, ZeRO-1) and
  checkpoints with `hlat_trainer.checkpoint` (torch.distributed.checkpoint).
- `neuron-xla` (torch-xla + neuronx-distributed, what the HLAT paper ran): the model is built
  from NxD parallel layers and the optimizer is NxD's ZeRO-1 wrapper, so the backend returns
  them already parallel (`parallelizes_model`), and it saves and loads with NxD's checkpoint API
  in the same `step_<N>/done` layout. hlat_trainer.engine drives either kind.

This module imports torch only inside methods (and for type checking), so that
`hlat_trainer.backends` and `hlat_trainer.neuron_env` can be imported by the launcher, which
execs torchrun and must not pay for (or depend on) torch.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from hlat_api import PretrainJobSpec
    from hlat_trainer.devicetime import StepClock
    from hlat_trainer.distributed import World

BackendName = Literal["cpu", "cuda", "neuron-native", "neuron-xla"]


class Backend(ABC):
    """One device stack. Instances are cheap; nothing is imported or initialised until used."""

    name: BackendName
    dist_backend: str
    """torch.distributed backend for `init_process_group`: gloo, nccl, neuron or xla."""
    autocast_device_type: str
    """`torch.autocast(device_type=...)` for the `mixed` precision: cpu, cuda, neuron or xla."""
    parallelizes_model: ClassVar[bool] = False
    """True: `build_model`/`build_optimizer` return a tensor-parallel model and an optimizer that
    averages gradients over data parallel, clips them, exposes `grad_norm` and (ZeRO-1) shards
    its state, and checkpoints go through `save_checkpoint`/`load_checkpoint` below
    (hlat_trainer.engine.ManagedEngine, NxD); False: the trainer applies hlat_trainer.parallel
    and checkpoints with torch.distributed.checkpoint (hlat_trainer.engine.TorchEngine)."""

    compiles: ClassVar[bool] = False
    """True: graphs are compiled as the loop first meets them (XLA), so an attempt reports
    phase `compiling` until its first step is done; `compile_seconds` measures it."""

    def __init__(self, spec: PretrainJobSpec) -> None:
        self.spec = spec

    @property
    def host_timed(self) -> bool:
        """True where the host's clock around a step's forward and backward is the device's
        (eager CPU: the ops run as they are called), so a rank's compute time is measured
        without a sync; False on asynchronous (CUDA) and lazy (XLA) devices (see
        `device_clock`)."""
        return False

    def compile_seconds(self) -> float:
        """Seconds this process has spent compiling graphs so far (0 on eager backends)."""
        return 0.0

    def device_clock(self) -> StepClock | None:
        """Where the host's clock is not the device's (`host_timed` False): a clock that times
        the step's work on the device without a host sync, from the runtime's callbacks (XLA)
        or events on the stream (CUDA) (`hlat_trainer.devicetime`); None where nothing
        measures it (then a worker reports no compute time, and the operator cannot score its
        node)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, dist={self.dist_backend!r})"

    # --- placement and process group ------------------------------------------------------

    @abstractmethod
    def device(self, local_rank: int) -> torch.device:
        """The torch device of the process with this local rank."""

    def init_world(self) -> World:
        """Join the job's process group and lay out the ranks: a (dp, tp) DeviceMesh here."""
        from hlat_trainer.distributed import init_distributed

        return init_distributed(self.spec, self.dist_backend)

    # --- per step -------------------------------------------------------------------------

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass's autocast for the spec's precision (only `mixed` autocasts)."""
        from hlat_trainer.precision import precision_policy

        with precision_policy(self.spec.precision).autocast(self.autocast_device_type):
            yield

    def to_device(self, batch: Tensor, device: torch.device) -> Tensor:
        """A host batch on the device (asynchronously where the device allows)."""
        return batch.to(device, non_blocking=True)

    def to_host(self, tensors: list[Tensor]) -> list[float]:
        """The values of 0-d device tensors: one device-to-host transfer (one sync)."""
        import torch

        if not tensors:
            return []
        flat = [t.detach().float().reshape(()) for t in tensors]  # 0-d or NxD's [1]
        values: list[float] = torch.stack(flat).cpu().tolist()
        return values

    def micro_batch_end(self) -> None:
        """Called after each micro-batch's backward: cut the lazy graph on XLA, so a step is
        one graph per micro-batch (the same graph for each) whatever the accumulation count;
        nothing on eager devices."""
        return None

    def step_end(self) -> None:
        """Called after each optimizer step: cut the lazy graph on XLA; nothing elsewhere."""
        return None

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross entropy in fp32. logits [B, T, V] (V local on NxD), targets [B, T]."""
        import torch.nn.functional as F

        out: Tensor = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return out

    # --- model and optimizer --------------------------------------------------------------

    @abstractmethod
    def build_model(self, device: torch.device) -> nn.Module:
        """The decoder on `device` with the precision's parameter dtype applied."""

    @abstractmethod
    def build_optimizer(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        """AdamW (with stochastic rounding where the precision asks for it) over `params`."""

    def is_tp_sharded(self, param: Tensor) -> bool:
        """Whether a parameter of `build_model`'s model is a tensor-parallel shard (norms sum
        those over the tp group). Only asked where `parallelizes_model`."""
        return False

    # --- checkpoints (only where `parallelizes_model`) -------------------------------------

    def save_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer, user_content: dict[str, int]) -> None:
        """Save `<directory>/step_<step>/`, `done` written last once every rank's shards are."""
        raise NotImplementedError(f"{self.name}: checkpoints go through hlat_trainer.checkpoint")

    def checkpoint_readable(self, directory: str, step: int) -> bool:
        """Whether this rank's files of `<directory>/step_<step>/` are there to load, checked
        without collectives (the ranks vote on it before `load_checkpoint`, which may run
        collectives a failing rank would leave its peers waiting in)."""
        from pathlib import Path

        return (Path(directory) / f"step_{step}").is_dir()

    def load_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> None:
        """Load `<directory>/step_<step>/` (complete) into `model` and `optimizer` in place."""
        raise NotImplementedError(f"{self.name}: checkpoints go through hlat_trainer.checkpoint")

    def finalize_checkpoint(self) -> None:
        """Wait for an asynchronous save to become durable (before exit)."""
        return None

    def snapshot_state(self, model: nn.Module, optimizer: torch.optim.Optimizer
                       ) -> dict[str, Any]:
        """This rank's state as its checkpoint holds it (the model's and the optimizer's state
        dicts), copied to host memory, for an in-memory snapshot."""
        raise NotImplementedError(f"{self.name}: snapshots go through hlat_trainer.snapshot")

    def load_snapshot_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                            state: dict[str, Any]) -> None:
        """Load what `snapshot_state` returned (this rank's, same layout) into `model` and
        `optimizer` in place, in the order `load_checkpoint` loads them."""
        raise NotImplementedError(f"{self.name}: snapshots go through hlat_trainer.snapshot")
