"""NxD's xser-encoded model shards, written by torch-xla's own serializer, read back without
torch-xla's help (hlat_trainer.nxd_checkpoint; the joining of tensor-parallel shards is
tests/trainer/test_nxd_checkpoint.py).

NxD's `save_checkpoint(use_xser=True)` writes each rank's shard with its own copy of
`torch_xla.utils.serialization.save` that keeps torch-xla's names and reference class
(neuronx-distributed fbac349 trainer/checkpoint.py 518-575): the dict with each tensor replaced
by a `TensorReference`, and `<file>.tensors/tensor_<tid>.pt`. Here the real `xser.save` writes
that layout from XLA tensors; the reader (weights_only, the reference class allowed by name)
must give back the same tensors, dtypes included."""

from __future__ import annotations

from pathlib import Path

import torch
import torch_xla
import torch_xla.utils.serialization as xser

from hlat_trainer import nxd_checkpoint


def test_an_xser_shard_reads_back_as_written(tmp_path: Path) -> None:
    device = torch_xla.device()
    gen = torch.Generator().manual_seed(3)
    state = {"tok_embeddings.weight": torch.randn(8, 4, generator=gen),
             "layers.0.attention_norm.weight": torch.randn(4, generator=gen).bfloat16(),
             "output.weight": torch.randn(8, 4, generator=gen)}
    path = tmp_path / "step_2" / nxd_checkpoint.MODEL_DIR
    path.mkdir(parents=True)
    shard = path / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    xser.save({k: v.to(device) for k, v in state.items()}, str(shard))
    assert len(list(Path(f"{shard}.tensors").iterdir())) == len(state)  # xser's layout
    assert nxd_checkpoint.is_nxd(tmp_path / "step_2")
    got = nxd_checkpoint.read_shard(shard)
    assert sorted(got) == sorted(state)
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
