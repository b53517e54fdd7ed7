"""Where this process sits in the job: ranks, the (dp, tp) device mesh, process groups.

Every run is a torch.distributed run, a single process included (a one-rank gloo group on an
in-memory store), so the training loop and the checkpointer have one code path. Ranks are laid
out [dp, tp] with tp fastest, as neuronx-distributed does: a tensor-parallel group is
contiguous ranks, which torchrun places on one node. The parallel degrees are checked against
the world torchrun actually started, up front, with a message that says what to change.
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
    mesh: DeviceMesh

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh["tp"].get_group()

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


def init_distributed(spec: PretrainJobSpec, backend: str = "gloo") -> World:
    """Join (or, alone, create) the process group and build the (dp, tp) mesh."""
    timeout = datetime.timedelta(
        seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT))
    )
    if not dist.is_initialized():
        if launched_by_torchrun():
            check_world(spec, int(os.environ["WORLD_SIZE"]))
            dist.init_process_group(backend, timeout=timeout)
        else:
            check_world(spec, 1)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,  # type: ignore[attr-defined]
                                    timeout=timeout)
    size, tp = dist.get_world_size(), spec.parallelism.tensor
    check_world(spec, size)
    device_type = {"nccl": "cuda", "neuron": "neuron"}.get(backend, "cpu")
    mesh = init_device_mesh(device_type, (size // tp, tp), mesh_dim_names=("dp", "tp"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    return World(dist.get_rank(), size, local_rank, size // tp, tp, mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
