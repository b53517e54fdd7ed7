"""Where this process sits in the job: ranks, the data- and tensor-parallel process groups.

Every run is a torch.distributed run, a single process included (a one-rank gloo group on an
in-memory store), so the training loop and the checkpointer have one code path. Ranks are laid
out [dp, tp] with tp fastest, as neuronx-distributed does: a tensor-parallel group is
contiguous ranks, which torchrun places on one node. The parallel degrees are checked against
the world torchrun actually started, up front, with a message that says what to change.

The torch-native backends get their groups from a (dp, tp) DeviceMesh (`init_distributed`),
whose tp dimension DTensor shards the model over; a backend that lays out ranks itself
(neuronx-distributed's parallel_state) builds its `World` from its own groups (`join`, then
`World(...)` without a mesh).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hlat_api import PretrainJobSpec
from hlat_trainer.errors import UserError

COLLECTIVE_TIMEOUT_ENV = "HLAT_COLLECTIVE_TIMEOUT_SECONDS"
DEFAULT_COLLECTIVE_TIMEOUT = 600.0  # a hung peer surfaces as an error, not an endless wait


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    dp: int
    tp: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    tp_mesh: DeviceMesh | None = None
    """The tp dimension of the DeviceMesh (torch-native backends): what DTensor shards over."""
    dp_rank: int = -1
    """This rank's index in its data-parallel group (which data stream it reads); by default
    from the [dp, tp] layout. NxD's layouts are not always that one (trn2 at LNC=2, trn1 at
    tp 4 interleave their groups), so the NxD backend passes its own."""
    tp_rank: int = -1
    """This rank's index in its tensor-parallel group; by default from the [dp, tp] layout."""

    def __post_init__(self) -> None:
        if self.dp_rank < 0:
            object.__setattr__(self, "dp_rank", self.rank // self.tp)
        if self.tp_rank < 0:
            object.__setattr__(self, "tp_rank", self.rank % self.tp)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_world(spec: PretrainJobSpec, world_size: int) -> None:
    """The spec's layout must match the processes that were started."""
    if world_size != spec.world_size:
        how = "torchrun" if world_size > 1 else "a single process"
        raise UserError(
            f"spec asks for {spec.world_size} ranks ({spec.nodes} nodes x {spec.ranks_per_node} "
            f"processes per node) but {how} started {world_size}: set nodes and "
            "processesPerNode to match, or launch with torchrun --nnodes/--nproc-per-node"
        )


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(
        seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT))
    )


def join(spec: PretrainJobSpec, backend: str) -> None:
    """Join the job's process group (alone: create a one-rank group), checking its size."""
    timeout = collective_timeout()
    if not dist.is_initialized():
        if launched_by_torchrun():
            check_world(spec, int(os.environ["WORLD_SIZE"]))
            dist.init_process_group(backend, timeout=timeout)
        else:
            check_world(spec, 1)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,  # type: ignore[attr-defined]
                                    timeout=timeout)
    check_world(spec, dist.get_world_size())


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(spec: PretrainJobSpec, backend: str = "gloo") -> World:
    """Join (or, alone, create) the process group and build the (dp, tp) mesh."""
    join(spec, backend)
    size, tp = dist.get_world_size(), spec.parallelism.tensor
    device_type = {"nccl": "cuda", "neuron": "neuron"}.get(backend, "cpu")
    mesh = init_device_mesh(device_type, (size // tp, tp), mesh_dim_names=("dp", "tp"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank())
    return World(dist.get_rank(), size, local_rank(), size // tp, tp,
                 dp_group=mesh["dp"].get_group(), tp_group=mesh["tp"].get_group(),
                 tp_mesh=mesh["tp"])


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
