"""Parallelism applied to the pure model from outside: tensor/sequence parallel, activation
checkpointing, and data parallelism with a ZeRO-1 sharded optimizer.

Design choices:
- Tensor parallelism uses DTensor plans (torch.distributed.tensor.parallel). The fused QKV and
  gate/up weights are laid out by the model so that a contiguous row split gives each rank
  whole kv-head groups (its q heads with their k and v) and matching (gate_i, up_i) pairs, so a
  plain ColwiseParallel suffices; the output projections are RowwiseParallel. With sequence
  parallelism the norms and residual stream are sharded along the sequence (Shard(1)) and the
  attention/MLP inputs are all-gathered, as Megatron-SP and NxD do. Logits are gathered
  (Replicate) before the loss: simple, and at the tiny vocabularies of tests cheap; a
  vocab-parallel loss is the next step for 32k+ vocabularies.
- The optimizer sees plain local tensors, never DTensors: `LocalParams` pairs each parameter's
  local shard with its gradient's local shard. Any optimizer (AdamWSR's bit tricks included)
  then works unchanged under tensor parallelism.
- Data parallelism: gradients are averaged over the dp group in flat buckets (one all-reduce per
  bucket). ZeRO-1: parameters are assigned whole to dp ranks, balanced by size; each rank keeps
  optimizer state for, and updates, only its own, then broadcasts them to its dp peers. The
  optimizer state per rank is about 1/dp of the whole.
- The gradient norm is global: squares of tensor-parallel shards are summed over the tp group,
  replicated parameters are counted once.
- Tensor parallelism beyond the kv-head count (70B: 8 kv heads at tp 32): each kv head is
  replicated on m = tp / kvHeads ranks. Before sharding, every fused QKV weight is re-laid out
  as kvHeads x m groups [q_per_kv / m query heads, k, v] (k and v copied into each replica), so
  the plain row split hands each rank one group; after backward, the replicas' k/v gradient rows
  are summed over their m ranks (each replica saw only its own query heads' share), so the
  replicas get the canonical gradient and stay identical; norms count those rows once. The
  model computes exactly what it computes at tp 1 (tests/trainer/test_kv_replication.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from hlat_trainer.distributed import World
from hlat_trainer.model import Attention, DecoderLayer, Transformer

BUCKET_ELEMENTS = 1 << 24


def replicate_kv_rows(weight: Tensor, kv_heads: int, q_per_kv: int, head_dim: int,
                      m: int) -> Tensor:
    """model.py's fused QKV weight ([kv groups of (q_per_kv q heads, k, v)] rows) re-laid out
    with each kv group split into m groups of q_per_kv / m query heads, each with its own copy
    of the group's k and v."""
    hidden = weight.shape[-1]
    groups = weight.reshape(kv_heads, q_per_kv + 2, head_dim, hidden)
    q, kv = groups[:, :q_per_kv], groups[:, q_per_kv:]
    q = q.reshape(kv_heads, m, q_per_kv // m, head_dim, hidden)
    kv = kv.unsqueeze(1).expand(-1, m, -1, -1, -1)  # [kv, m, 2, hd, hidden]
    return torch.cat((q, kv), dim=2).flatten(0, 3)


@dataclass
class KvReplication:
    """Which local gradient rows are replicas, and the process group of each rank's replicas."""

    params: list[Tensor]
    rows: int
    """Trailing rows of each local wqkv shard that are the (replicated) k and v."""
    m: int
    group: dist.ProcessGroup

    def sum_grads(self, grads: list[Tensor]) -> None:
        """Sum the replicas' k/v gradient rows over the ranks holding the same kv head."""
        chunk = torch.cat([g[-self.rows:].reshape(-1) for g in grads])
        dist.all_reduce(chunk, group=self.group)
        _unflatten_into(chunk, [g[-self.rows:] for g in grads])


def _kv_groups(world: World, m: int) -> dist.ProcessGroup:
    """This rank's group of kv replicas: m consecutive tp ranks (every rank makes every group)."""
    mine: dist.ProcessGroup | None = None
    for d in range(world.dp):
        for block in range(world.tp // m):
            ranks = [d * world.tp + block * m + i for i in range(m)]
            group = dist.new_group(ranks)
            if world.rank in ranks:
                assert isinstance(group, dist.ProcessGroup)
                mine = group
    assert mine is not None
    return mine


def _replicate_kv(model: Transformer, world: World) -> KvReplication | None:
    dims = model.dims
    if world.tp <= dims.kv_heads:
        return None
    if world.tp % dims.kv_heads or dims.heads % world.tp:
        raise ValueError(f"tensor parallel degree {world.tp} beyond {dims.kv_heads} kv heads "
                         f"must be a multiple of them and divide the {dims.heads} heads")
    m = world.tp // dims.kv_heads
    params: list[Tensor] = []
    for layer in model.layers:
        attn: Attention = layer.attention  # type: ignore[assignment]
        new = replicate_kv_rows(attn.wqkv.weight.detach(), dims.kv_heads, attn.q_per_kv,
                                dims.head_dim, m)
        attn.wqkv.weight = nn.Parameter(new)  # no second init, no draw from the global RNG
        attn.wqkv.out_features = new.shape[0]
        attn.q_per_kv //= m
        params.append(attn.wqkv.weight)
    return KvReplication(params, 2 * dims.head_dim, m, _kv_groups(world, m))


def apply_tp(model: Transformer, world: World, sequence_parallel: bool) -> KvReplication | None:
    """Shard the model over the tp mesh dimension (no-op when tp == 1); returns the kv-head
    replication when tp exceeds the kv heads (its gradients need summing), else None."""
    if world.tp == 1:
        return None
    replication = _replicate_kv(model, world)
    mesh = world.tp_mesh
    if mesh is None:
        raise ValueError("apply_tp needs a World built on a DeviceMesh (init_distributed)")
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for layer in model.layers:
        plan: dict[str, Any] = {
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wqkv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w_gate_up": ColwiseParallel(),
            "feed_forward.w_down": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(layer, mesh, plan)
    if replication is not None:  # the parameters are DTensors now
        replication.params = [
            layer.attention.wqkv.weight for layer in model.layers  # type: ignore[union-attr,misc]
        ]
    return replication


def apply_ac(model: Transformer, mode: str) -> None:
    """Activation checkpointing: `full` recomputes whole layers, `selective` the attention core."""
    if mode == "none":
        return
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        if mode == "full":
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]
        else:
            attn: Attention = layer.attention
            attn.core_attention = partial(  # type: ignore[method-assign]
                checkpoint, attn.core_attention, use_reentrant=False
            )


def local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def is_tp_sharded(p: Tensor) -> bool:
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


@dataclass
class LocalParams:
    """Plain local-shard tensors standing in for the model's (possibly DTensor) parameters."""

    names: list[str]
    params: list[nn.Parameter]
    shards: list[Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> LocalParams:
        names, params = zip(*model.named_parameters(), strict=True)
        shards = [local(p).detach() for p in params]
        return cls(list(names), list(params), shards)

    def bind_grads(self) -> None:
        for p, shard in zip(self.params, self.shards, strict=True):
            grad = p.grad
            if isinstance(grad, DTensor) and isinstance(p, DTensor) and (
                grad.placements != p.placements
            ):  # e.g. a Partial or Replicate gradient of a sharded embedding
                grad = grad.redistribute(p.device_mesh, p.placements)
            shard.grad = None if grad is None else local(grad)


def _flat_all_reduce(tensors: list[Tensor], group: dist.ProcessGroup, divide: int) -> None:
    """All-reduce (and average) in place, one collective per bucket of one dtype."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        for chunk in _buckets(same):
            flat = torch.cat([t.reshape(-1) for t in chunk])
            dist.all_reduce(flat, group=group)
            if divide > 1:
                flat /= divide
            _unflatten_into(flat, chunk)


def _unflatten_into(flat: Tensor, chunk: list[Tensor]) -> None:
    offset = 0
    for t in chunk:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _buckets(tensors: list[Tensor]) -> Iterable[list[Tensor]]:
    bucket: list[Tensor] = []
    size = 0
    for t in tensors:
        if bucket and size + t.numel() > BUCKET_ELEMENTS:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def global_norm(tensors: list[Tensor | None], tp_sharded: list[bool], world: World,
                kv_rows: list[int] | None = None, kv_m: int = 1) -> Tensor:
    """L2 norm over the whole model of the local tensors (gradients or parameters): squares of
    tensor-parallel shards summed over the tp group, replicated tensors counted once (and the
    last `kv_rows[i]` rows of tensor i, replicated on `kv_m` tp ranks, once). A 0-d tensor on
    the tensors' device (no host sync here: on XLA it stays in the step's graph)."""
    rows = kv_rows or [0] * len(tensors)
    present = [(t, s, r) for t, s, r in zip(tensors, tp_sharded, rows, strict=True)
               if t is not None]
    device = present[0][0].device if present else torch.device("cpu")
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    sharded = torch.zeros((), dtype=dtype, device=device)
    replicated = torch.zeros((), dtype=dtype, device=device)
    for t, is_sharded, r in present:
        sq = t.to(dtype).pow(2).sum()
        if r:
            sq = sq - t[-r:].to(dtype).pow(2).sum() * (1 - 1 / kv_m)
        if is_sharded:
            sharded += sq
        else:
            replicated += sq
    if world.tp > 1:
        dist.all_reduce(sharded, group=world.tp_group)
    return (sharded + replicated).sqrt()


def nxd_kv_replication(model: nn.Module) -> tuple[list[int], int]:
    """For each of `model.parameters()`, how many of its trailing rows are replicated kv heads,
    and over how many tensor-parallel ranks (1: none). NxD marks it on the layer:
    `GQAQKVColumnParallelLinear.kv_size_multiplier`, each rank holding
    `kv_output_size_per_partition` rows of k and of v, after its q rows in the fused
    `weight_qkv` (or as `weight_k` / `weight_v`), all of them `tensor_model_parallel`
    (neuronx-distributed fbac349 src/neuronx_distributed/modules/qkv_linear.py l.420-455,
    472-513)."""
    rows: dict[int, int] = {}
    m = 1
    for module in model.modules():
        mult = getattr(module, "kv_size_multiplier", 1)
        if not isinstance(mult, int) or mult <= 1:
            continue
        m = mult
        kv = int(getattr(module, "kv_output_size_per_partition"))  # noqa: B009 (typed: Any)
        for name in ("weight_qkv", "bias_qkv"):
            t = getattr(module, name, None)
            if isinstance(t, Tensor) and not (name == "bias_qkv" and getattr(module, "gather_output", False)):
                rows[id(t)] = 2 * kv
        for name in ("weight_k", "weight_v", "bias_k", "bias_v"):
            t = getattr(module, name, None)
            if isinstance(t, Tensor):
                rows[id(t)] = t.shape[0]
    return [rows.get(id(p), 0) for p in model.parameters()], m


def nxd_param_norm(model: nn.Module, tp_sharded: list[bool], world: World) -> Tensor:
    """The parameters' global norm on an NxD model, each replicated kv head counted once."""
    rows, m = nxd_kv_replication(model)
    return global_norm(list(model.parameters()), tp_sharded, world, rows, m)


def partition(numels: list[int], parts: int) -> list[int]:
    """Owner (dp rank) of each parameter: greedy by size, largest first, ties to the lowest rank."""
    owners = [0] * len(numels)
    loads = [0] * parts
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(parts), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += numels[i]
    return owners


class DataParallel:
    """Gradient averaging over dp, the global grad norm, and (optionally) ZeRO-1."""

    def __init__(self, params: LocalParams, world: World, zero1: bool,
                 build_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer],
                 kv: KvReplication | None = None) -> None:
        self.params, self.world, self.kv = params, world, kv
        replicas = {id(p) for p in kv.params} if kv else set()
        self.kv_rows = [kv.rows if kv and id(p) in replicas else 0 for p in params.params]
        self.zero1 = zero1 and world.dp > 1
        numels = [s.numel() for s in params.shards]
        self.owners = partition(numels, world.dp) if self.zero1 else [world.dp_rank] * len(numels)
        self.owned = [s for s, o in zip(params.shards, self.owners, strict=True)
                      if o == world.dp_rank]
        self.optimizer = build_optimizer(self.owned)

    def sync_grads(self) -> None:
        """Bind local grads, sum kv replicas' rows, and average over the dp group."""
        self.params.bind_grads()
        if self.kv is not None:
            self.kv.sum_grads([s.grad for s, r in zip(self.params.shards, self.kv_rows,
                                                      strict=True) if r and s.grad is not None])
        grads = [s.grad for s in self.params.shards if s.grad is not None]
        if self.world.dp > 1:
            _flat_all_reduce(grads, self.world.dp_group, self.world.dp)

    def _norm(self, tensors: list[Tensor | None]) -> Tensor:
        sharded = [is_tp_sharded(p) for p in self.params.params]
        return global_norm(tensors, sharded, self.world, self.kv_rows,
                           self.kv.m if self.kv else 1)

    def grad_norm(self) -> Tensor:
        """0-d, on the device: nothing is read back to the host."""
        return self._norm([s.grad for s in self.params.shards])

    def param_norm(self) -> Tensor:
        return self._norm(list(self.params.shards))

    def clip(self, max_norm: float) -> Tensor:
        """Scale the gradients so that their global norm is at most `max_norm` (0: off) and
        return the norm before; no host sync and no branch on the norm's value."""
        norm = self.grad_norm()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            grads = [s.grad for s in self.params.shards if s.grad is not None]
            torch._foreach_mul_(grads, coef.to(grads[0].dtype) if grads else coef)
        return norm

    def step(self) -> float:
        """Update this rank's shards (with ZeRO-1, then share them over dp) and clear the
        gradients; the seconds spent sharing (each owner's broadcast waits for its update)."""
        self.optimizer.step()
        shared = 0.0
        if self.zero1:
            began = time.perf_counter()
            self._broadcast_updates()
            shared = time.perf_counter() - began
        for p in self.params.params:
            p.grad = None
        for s in self.params.shards:
            s.grad = None
        return shared

    def _broadcast_updates(self) -> None:
        dp_ranks = dist.get_process_group_ranks(self.world.dp_group)
        for owner in range(self.world.dp):
            mine = [s for s, o in zip(self.params.shards, self.owners, strict=True) if o == owner]
            for chunk in _buckets(mine):
                flat = torch.cat([t.reshape(-1) for t in chunk])
                dist.broadcast(flat, src=dp_ranks[owner], group=self.world.dp_group)
                if owner != self.world.dp_rank:
                    _unflatten_into(flat, chunk)
