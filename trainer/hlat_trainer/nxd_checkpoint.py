"""The weights of a neuronx-distributed (NxD) training checkpoint, read in one process without
NxD or torch-xla: what `hlat-eval` and `hlat-export` need of the neuron-xla backend's
checkpoints (the torch-native backends' are torch.distributed.checkpoint directories).

What NxD writes, read at aws-neuron/neuronx-distributed fbac349 (release 2.29, NxD 0.18.0:
the release `nxd_release` pins), src/neuronx_distributed/trainer/checkpoint.py (CK):
- `save_checkpoint(dir, tag="step_<N>", model=..., use_xser=True)` (our `neuron_xla`
  backend's call) puts each tensor-parallel rank's model state dict in
  `<dir>/<tag>/model/dp_rank_00_tp_rank_<tp:02d>_pp_rank_<pp:02d>.pt` (CK 54-63, 790-812: the
  data-parallel field is always 00 for the model; expert parallelism adds `_ep_rank_`, which
  our models never have). The state dict is the wrapped module's own (`model.state_dict()`,
  trainer/model.py 84-87): no `module.` prefix, so its names are `nxd_model.NxDTransformer`'s,
  which are `hlat_trainer.model.Transformer`'s.
- With `use_xser` the `.pt` file is a `torch.save` of the dict with each tensor replaced by a
  `torch_xla.utils.serialization.TensorReference` (one field, `tid`), and the tensor itself in
  `<file>.tensors/tensor_<tid>.pt`, a `torch.save` of a CPU tensor (CK 518-575, which reuse
  torch-xla's names: pytorch/xla v2.9.0 torch_xla/utils/serialization.py 10-21, 32, 76).
  Without it the `.pt` holds the tensors. Both are read here with `weights_only`: the
  reference class is allowed by name (`_TensorReference`), nothing else outside torch's own.
- Parameters are saved as each rank's shard (parallel_layers/layers.py): ColumnParallelLinear
  `[out / tp, in]` (663-664), RowParallelLinear `[out, in / tp]` (912-913), ParallelEmbedding
  `[vocab / tp, hidden]` (283), each split contiguously (stride 1, as our layers are built), so
  the whole tensor is the shards concatenated in tp-rank order along that dimension
  (`PARTITION_DIMS`); the norms are whole on every rank. Our fused QKV and gate/up layouts are
  split so that each rank holds whole kv groups and whole (gate, up) pairs (nxd_model's module
  doc): concatenated, they are model.py's layouts again.
- Key/value heads replicated over tensor-parallel ranks (tp above the kv-head count, the
  paper's 70B at tp 32: NxD's GQAQKVColumnParallelLinear, one fused `weight_qkv` a rank,
  its query rows, then its key rows, then its value rows: modules/qkv_linear.py 474-481).
  Each rank holds heads/tp query heads (contiguous) and kv_heads*m/tp kv heads (m =
  tp / kv_heads) of the replicated list, which on trn1 is the kv heads tiled m times
  (`master_weight.repeat(m, 1)`, 84-86); within a rank, query heads pair with its kv heads
  in order (nxd_model.CoreAttention). `_join_replicated_kv` regroups the query heads by the
  kv head they attend to, which is model.py's fused layout, and permutes `wo`'s input
  columns alike: the same function, its heads relabelled. The layout is the hardware's
  (recorded nowhere in the checkpoint): it is taken from the job's instance type. trn2's
  (`repeat_interleave` of the weight's rows, 80-83) is refused, as are pipeline-parallel
  checkpoints (our backend runs pp 1), naming NxD's scripts/checkpoint_converter.py.

Nothing here ran against a checkpoint NxD wrote (NxD is not installable here): the tests write
the layout above with torch-xla's own `serialization.save` (tests/xla).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from hlat_api.presets import ModelDims, canonical_instance_type
from hlat_trainer.backends.nxd_model import kv_size_multiplier
from hlat_trainer.errors import UserError

MODEL_DIR = "model"
_SHARD = re.compile(r"dp_rank_00_tp_rank_(\d+)_pp_rank_(\d+)\.pt")
PARTITION_DIMS = {
    "tok_embeddings.weight": 0,  # ParallelEmbedding: vocabulary ranges
    "attention.wqkv.weight": 0,  # ColumnParallelLinear
    "feed_forward.w_gate_up.weight": 0,  # ColumnParallelLinear
    "output.weight": 0,  # ColumnParallelLinear (vocab-parallel logits)
    "attention.wo.weight": 1,  # RowParallelLinear
    "feed_forward.w_down.weight": 1,  # RowParallelLinear
}
"""The dimension each tensor-parallel weight of `nxd_model.NxDTransformer` is split along, by
the end of its name; any other entry (the norms) is whole on every rank."""
_REPLICATED_KV = ("weight_qkv", "weight_q", "weight_k", "weight_v")
"""The weights of NxD's GQA layer (kv heads replicated over ranks), by the end of the name."""


def _replicated_kv(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _REPLICATED_KV


class _TensorReference:
    """Stands for torch_xla.utils.serialization.TensorReference when unpickling (its only
    field: `tid`, the number of its tensor file)."""

    tid: int


_TensorReference.__module__ = "torch_xla.utils.serialization"
_TensorReference.__name__ = _TensorReference.__qualname__ = "TensorReference"


def is_nxd(path: Path) -> bool:
    """Whether the checkpoint directory `path` holds NxD model shards."""
    model = path / MODEL_DIR
    return model.is_dir() and any(_SHARD.fullmatch(p.name) for p in model.iterdir())


def shard_files(path: Path) -> list[Path]:
    """The model shard files of the NxD checkpoint at `path`, in tensor-parallel rank order."""
    found: dict[tuple[int, int], Path] = {}
    for p in (path / MODEL_DIR).iterdir():
        m = _SHARD.fullmatch(p.name)
        if m:
            found[(int(m.group(1)), int(m.group(2)))] = p
    stages = sorted({pp for _, pp in found})
    if stages != [0]:
        raise UserError(f"NxD checkpoint {path} has pipeline stages {stages}: only pipeline "
                        "parallelism 1 is read here (NxD's scripts/checkpoint_converter.py "
                        "merges pipeline stages)")
    ranks = sorted(tp for tp, _ in found)
    if ranks != list(range(len(ranks))):
        raise UserError(f"NxD checkpoint {path}/{MODEL_DIR} has the shards of tensor-parallel "
                        f"ranks {ranks}, not 0..{len(ranks) - 1}: it is incomplete")
    return [found[(tp, 0)] for tp in ranks]


def read_shard(file: Path) -> dict[str, Tensor]:
    """One rank's model state dict, xser-encoded or plain, on the CPU."""
    try:
        with torch.serialization.safe_globals([_TensorReference]):
            saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"NxD checkpoint shard {file} could not be read: {err}") from err
    if not isinstance(saved, dict):
        raise UserError(f"NxD checkpoint shard {file} holds a {type(saved).__name__}, not a "
                        "state dict")
    out: dict[str, Tensor] = {}
    for name, value in saved.items():
        if isinstance(value, _TensorReference):
            data = Path(f"{file}.tensors") / f"tensor_{value.tid}.pt"
            try:
                value = torch.load(data, map_location="cpu", weights_only=True)
            except Exception as err:
                raise UserError(f"NxD checkpoint shard {file}: tensor {name} ({data}) could "
                                f"not be read: {err}") from err
        if not isinstance(value, Tensor):
            raise UserError(f"NxD checkpoint shard {file}: entry {name} is a "
                            f"{type(value).__name__}, not a tensor")
        out[name] = value
    return out


def _partition_dim(name: str) -> int | None:
    for suffix, dim in PARTITION_DIMS.items():
        if name == suffix or name.endswith("." + suffix):
            return dim
    return None


def read_model(path: Path, like: Mapping[str, Tensor], dims: ModelDims | None = None,
               instance_type: str = "") -> dict[str, Tensor]:
    """The whole model state dict of the NxD checkpoint at `path`: each entry of `like` (our
    model's state dict, by the same names) from the tensor-parallel shards, checked against its
    shape. `dims` and `instance_type` (the job's): for kv heads replicated over ranks."""
    files = shard_files(path)
    shards = [read_shard(f) for f in files]
    names = set(shards[0])
    for file, shard in zip(files, shards, strict=True):
        if set(shard) != names:
            raise UserError(f"NxD checkpoint shard {file} has other entries than {files[0]}: "
                            f"{sorted(set(shard) ^ names)[:5]}")
    joined: dict[str, Tensor] = {}
    if any(_replicated_kv(n) for n in names):
        joined = _join_replicated_kv(path, shards, dims, instance_type)
        names = {n for n in names if not _replicated_kv(n)} | set(joined)
    missing = sorted(set(like) - names)
    if missing:
        raise UserError(f"NxD checkpoint {path} lacks {len(missing)} of the model's entries "
                        f"({', '.join(missing[:3])}...): is it of this job's model "
                        "(spec.model)?")
    out: dict[str, Tensor] = {}
    for name, target in like.items():
        if name in joined:
            whole = joined[name]
        else:  # each shard's piece let go as it is joined: one copy of the model, not two
            pieces = [shard.pop(name) for shard in shards]
            dim = _partition_dim(name)
            whole = pieces[0] if dim is None else torch.cat(pieces, dim)
        if whole.shape != target.shape:
            raise UserError(f"NxD checkpoint {path}: {name} is {tuple(whole.shape)} from "
                            f"{len(files)} tensor-parallel shard(s), the model's is "
                            f"{tuple(target.shape)}: is it of this job's model (spec.model)?")
        out[name] = whole
    return out


def _join_replicated_kv(path: Path, shards: list[dict[str, Tensor]], dims: ModelDims | None,
                        instance_type: str) -> dict[str, Tensor]:
    """Each layer's `attention.wqkv.weight` (model.py's layout) and `attention.wo.weight` from
    the shards of NxD's GQA layer, its kv heads tiled over the ranks (trn1; module doc)."""
    if dims is None or not canonical_instance_type(instance_type).startswith("trn1"):
        raise UserError(
            f"NxD checkpoint {path} replicates key/value heads over tensor-parallel ranks "
            f"(tensor parallelism above the kv-head count) in the layout of the hardware that "
            f"trained it, which the checkpoint does not record; read here for trn1 (the job's "
            f"instanceType), not {instance_type or 'an unknown instance type'}. Use NxD's "
            "scripts/checkpoint_converter.py (--convert_to_full_state --qkv_linear)")
    tp, hd = len(shards), dims.head_dim
    if "layers.0.attention.wqkv.weight_qkv" not in shards[0]:
        raise UserError(f"NxD checkpoint {path}: its GQA layers keep separate q/k/v weights "
                        "(fuse_qkv=False), which our model does not build: not read here")
    q_local = dims.heads // tp
    kv_local = dims.kv_heads * kv_size_multiplier(dims, tp) // tp  # copies a rank holds
    pairs = q_local // kv_local  # a rank's query heads per kv head, in order
    groups: list[list[int]] = [[] for _ in range(dims.kv_heads)]
    kv_at: dict[int, tuple[int, int]] = {}  # kv head -> (rank, local index) of a copy
    for rank in range(tp):
        for a in range(q_local):
            b = a // pairs
            head = (rank * kv_local + b) % dims.kv_heads  # trn1: the kv heads tiled
            groups[head].append(rank * q_local + a)
            kv_at.setdefault(head, (rank, b))
    if any(len(g) != dims.heads // dims.kv_heads for g in groups):
        raise UserError(f"NxD checkpoint {path}: the query heads do not pair evenly with the "
                        f"kv heads at tp {tp} ({dims.heads} heads, {dims.kv_heads} kv heads)")
    order = [g for group in groups for g in group]  # model.py's query head h is NxD's order[h]
    out: dict[str, Tensor] = {}
    for i in range(dims.layers):
        fused = [s[f"layers.{i}.attention.wqkv.weight_qkv"] for s in shards]
        q = torch.cat([f[: q_local * hd] for f in fused]).view(dims.heads, hd, -1)
        k = [f[q_local * hd: (q_local + kv_local) * hd].view(kv_local, hd, -1) for f in fused]
        v = [f[(q_local + kv_local) * hd:].view(kv_local, hd, -1) for f in fused]
        rows = []
        for head, group in enumerate(groups):
            rank, b = kv_at[head]
            rows += [q[g] for g in group] + [k[rank][b], v[rank][b]]
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat(rows)
        wo = torch.cat([s[f"layers.{i}.attention.wo.weight"] for s in shards], dim=1)
        cols = wo.view(wo.shape[0], dims.heads, hd)
        out[f"layers.{i}.attention.wo.weight"] = cols[:, order].reshape(wo.shape[0], -1)
    return out


def load_into(model: torch.nn.Module, path: Path, unwrapped: Callable[[str], str],
              dims: ModelDims | None = None, instance_type: str = "") -> None:
    """Load the NxD checkpoint at `path` into `model` (one process, any tensor-parallel degree
    it was saved at); `unwrapped` maps one of the model's state-dict names to the plain one
    (activation checkpointing and torch.compile add segments); `dims`, `instance_type`: the
    job's (`read_model`)."""
    mine = model.state_dict()
    plain = {unwrapped(k): k for k in mine}
    whole = read_model(path, {p: mine[k] for p, k in plain.items()}, dims, instance_type)
    model.load_state_dict({plain[p]: v for p, v in whole.items()})
