"""The logged parameter norm on the NxD path counts each replicated kv head once.

Beyond the kv-head count (70B: 8 kv heads at tp 32) NxD's GQAQKVColumnParallelLinear holds
each kv head on kv_size_multiplier = tp / kvHeads ranks; summing every rank's squares over the
tensor-parallel group would count those rows that many times. Two gloo ranks at tp 2 with one
kv head (multiplier 2) build the layer through the NxD fakes (NxD's signature and attributes)
with their shards of one unreplicated model; the engine's norm must be that model's.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from nxd_fakes import Calls, fake_modules
from torch import nn

from hlat_trainer.distributed import World
from hlat_trainer.parallel import nxd_param_norm

HIDDEN, Q, KV, TP = 6, 8, 4, 2  # 2 query heads and 1 kv head of 4, kv_size_multiplier 2


def unreplicated() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {name: torch.randn(rows, HIDDEN, generator=g)
            for name, rows in (("q", Q), ("k", KV), ("v", KV), ("out", 2 * HIDDEN))} | {
        "norm": torch.randn(HIDDEN, generator=g)}


def rank_main(rank: int, port: int, out: dict[int, float]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    world = World(rank, TP, rank, 1, TP, dp_group=group, tp_group=group)
    full = unreplicated()
    qkv_cls = fake_modules(Calls(), tp=TP)["neuronx_distributed.modules.qkv_linear"]
    model = nn.Module()
    model.qkv = qkv_cls.GQAQKVColumnParallelLinear(  # type: ignore[attr-defined]
        HIDDEN, [Q, KV], bias=False, gather_output=False, kv_size_multiplier=TP)
    model.out = nn.Linear(HIDDEN, HIDDEN, bias=False)  # a plain tp shard (rows split)
    model.norm = nn.Parameter(full["norm"])  # replicated on every rank
    q_rows = Q // TP
    with torch.no_grad():  # this rank's q heads, and the whole (replicated) kv head
        model.qkv.weight_qkv.copy_(torch.cat(
            [full["q"][rank * q_rows:(rank + 1) * q_rows], full["k"], full["v"]]))
        model.out.weight.copy_(full["out"][rank * HIDDEN:(rank + 1) * HIDDEN])
    sharded = [bool(getattr(p, "tensor_model_parallel", False)) or p is model.out.weight
               for p in model.parameters()]
    out[rank] = float(nxd_param_norm(model, sharded, world))
    dist.destroy_process_group()


@pytest.mark.slow
def test_replicated_kv_heads_count_once_in_the_parameter_norm() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(rank_main, args=(port, out), nprocs=TP, join=True)
    expected = torch.sqrt(sum(t.double().pow(2).sum() for t in unreplicated().values()))
    assert out[0] == pytest.approx(float(expected), rel=1e-6)
    assert out[1] == out[0]
