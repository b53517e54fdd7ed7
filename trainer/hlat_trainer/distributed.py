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
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hlat_api import PretrainJobSpec
from hlat_trainer.errors import UserError

log = logging.getLogger(__name__)

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


STORE_WAIT_SECONDS = 60.0
"""How long a rank polls for rank 0's store before leaving the wait to c10d's own retries."""
STORE_POLL_FIRST, STORE_POLL_MAX = 0.01, 0.25


def await_store(env: Mapping[str, str] = os.environ, bound: float = STORE_WAIT_SECONDS) -> bool:
    """Wait until rank 0's store (MASTER_ADDR:MASTER_PORT) accepts connections; True once it
    does (or when there is nothing to wait for: rank 0, or torchrun's agent holds the store).

    c10d's client retries a refused connection only after about half a second. In an in-place
    restart every rank's trainer starts at once but rank 0's, which hosts the attempt's store,
    starts a moment later (its launcher first stops the old one), so the others were refused
    and lost that half second. Here they poll at 10 ms, backing off to 250 ms (an address
    resolved once, again only after a failed lookup: no DNS storm at scale). Nothing is sent:
    the probe connection closes before the store's handshake."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if (env.get("RANK", "0") == "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            or not addr or not port):
        return True
    deadline, pause = time.monotonic() + bound, STORE_POLL_FIRST
    host: str | None = None
    while True:
        try:
            if host is None:
                host = str(socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)[0][4][0])
            socket.create_connection((host, int(port)), timeout=1).close()
            return True
        except OSError:  # not resolvable yet (host stays None) or not listening yet
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 1.5, STORE_POLL_MAX)


def join(spec: PretrainJobSpec, backend: str) -> None:
    """Join the job's process group (alone: create a one-rank group), checking its size."""
    timeout = collective_timeout()
    if not dist.is_initialized():
        if launched_by_torchrun():
            check_world(spec, int(os.environ["WORLD_SIZE"]))
            if not await_store():
                log.warning("rank 0's store at %s:%s not reachable after %.0fs; c10d retries on "
                            "(up to the collective timeout, %.0fs)", os.environ.get("MASTER_ADDR"),
                            os.environ.get("MASTER_PORT"), STORE_WAIT_SECONDS,
                            timeout.total_seconds())
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
