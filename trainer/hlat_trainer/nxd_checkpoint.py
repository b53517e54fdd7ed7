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
- Not read: a model whose key/value heads are replicated over tensor-parallel ranks (tp above
  the kv-head count, the 70B at tp 32: NxD's GQAQKVColumnParallelLinear, weights
  `weight_qkv`), whose head layout depends on the hardware that trained it (trn1 tiles the
  copies, trn2 interleaves them: modules/qkv_linear.py 80-86) and is recorded nowhere in the
  checkpoint; pipeline-parallel checkpoints (our backend runs pp 1). Both are refused, naming
  what to use instead (NxD's own scripts/checkpoint_converter.py, told the hardware).

Nothing here ran against a checkpoint NxD wrote (NxD is not installable here): the tests write
the layout above with torch-xla's own `serialization.save` (tests/xla).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

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


def read_model(path: Path, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The whole model state dict of the NxD checkpoint at `path`: each entry of `like` (our
    model's state dict, by the same names) from the tensor-parallel shards, checked against its
    shape."""
    files = shard_files(path)
    shards = [read_shard(f) for f in files]
    names = set(shards[0])
    replicated = sorted(n for n in names if n.rsplit(".", 1)[-1] in _REPLICATED_KV)
    if replicated:
        raise UserError(
            f"NxD checkpoint {path} replicates key/value heads over tensor-parallel ranks "
            f"({replicated[0]}: tensor parallelism above the kv-head count), in a layout that "
            "depends on the hardware that trained it (trn1 or trn2) and is not recorded in the "
            "checkpoint: not read here. Use NxD's scripts/checkpoint_converter.py "
            "(--convert_to_full_state --qkv_linear), told the hardware")
    for file, shard in zip(files, shards, strict=True):
        if set(shard) != names:
            raise UserError(f"NxD checkpoint shard {file} has other entries than {files[0]}: "
                            f"{sorted(set(shard) ^ names)[:5]}")
    missing = sorted(set(like) - names)
    if missing:
        raise UserError(f"NxD checkpoint {path} lacks {len(missing)} of the model's entries "
                        f"({', '.join(missing[:3])}...): is it of this job's model "
                        "(spec.model)?")
    out: dict[str, Tensor] = {}
    for name, target in like.items():
        pieces = [shard[name] for shard in shards]
        dim = _partition_dim(name)
        whole = pieces[0] if dim is None else torch.cat(pieces, dim)
        if whole.shape != target.shape:
            raise UserError(f"NxD checkpoint {path}: {name} is {tuple(whole.shape)} from "
                            f"{len(files)} tensor-parallel shard(s), the model's is "
                            f"{tuple(target.shape)}: is it of this job's model (spec.model)?")
        out[name] = whole
    return out


def load_into(model: torch.nn.Module, path: Path, unwrapped: Callable[[str], str]) -> None:
    """Load the NxD checkpoint at `path` into `model` (one process, any tensor-parallel degree
    it was saved at); `unwrapped` maps one of the model's state-dict names to the plain one
    (activation checkpointing and torch.compile add segments)."""
    mine = model.state_dict()
    plain = {unwrapped(k): k for k in mine}
    whole = read_model(path, {p: mine[k] for p, k in plain.items()})
    model.load_state_dict({plain[p]: v for p, v in whole.items()})
