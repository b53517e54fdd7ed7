"""hlat-eval and hlat-export on the neuron-xla backend's checkpoints: NxD's own format, each
tensor-parallel rank's model shard in `<tag>/model/dp_rank_00_tp_rank_<r>_pp_rank_00.pt`
(hlat_trainer.nxd_checkpoint cites the source), joined in one process.

NxD cannot run here. The shards are the NxD model's own state dicts at tp 2, built as the
backend builds them with NxD's initialisation replayed (nxd_fakes: each parallel layer draws
the whole weight and keeps its chunk along its class's partition dimension), and written as
NxD writes them without xser (a plain torch.save of the dict); the xser encoding is read in the
xla tier with torch-xla's own serializer (tests/xla/test_xla_nxd_checkpoint.py). Joined, they
must be the tp-1 model's weights exactly, whatever the reader's table of partition dimensions
says: the table is not what makes the shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_nxd_meta_init import build, make_spec

from hlat_api.layout import DONE
from hlat_trainer import nxd_checkpoint
from hlat_trainer.errors import UserError
from hlat_trainer.evaluate import CheckpointEntry, load
from hlat_trainer.model import build_model


def write_nxd(path: Path, shards: list[dict[str, torch.Tensor]]) -> Path:
    """A complete NxD checkpoint directory of these model shards (tp rank order)."""
    model = path / nxd_checkpoint.MODEL_DIR
    model.mkdir(parents=True)
    for rank, state in enumerate(shards):
        torch.save(dict(state), model / f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt")
    (path / DONE).write_text("1")
    return path


@pytest.fixture
def tp2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An NxD checkpoint of the tiny model at tp 2, and the same model's tp-1 weights."""
    whole = build(monkeypatch, make_spec(tp=1)).state_dict()
    shards = [build(monkeypatch, make_spec(tp=2), rank=r).state_dict() for r in (0, 1)]
    assert any(s.shape != whole[n].shape for n, s in shards[0].items())  # really sharded
    return write_nxd(tmp_path / "step_4", shards), whole


def test_the_shards_of_tp_2_join_into_the_tp_1_model(
        tp2: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, whole = tp2
    like = build_model(make_spec().model.dims(), seed=0).state_dict()
    joined = nxd_checkpoint.read_model(path, like)
    assert sorted(joined) == sorted(whole)
    for name, tensor in whole.items():
        assert torch.equal(joined[name], tensor), name


def test_hlat_eval_loads_an_nxd_checkpoint_into_its_one_process_model(
        tp2: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, whole = tp2
    engine, _ = load(make_spec(tp=2), "job", CheckpointEntry(4, path), held_out=False)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, whole[name].to(tensor.dtype)), name


def test_a_checkpoint_missing_a_rank_s_shard_is_refused(
        tp2: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = tp2
    (path / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").unlink()
    with pytest.raises(UserError, match=r"ranks \[1\], not 0..0"):
        load(make_spec(tp=2), "job", CheckpointEntry(4, path), held_out=False)


def test_another_model_s_checkpoint_is_refused_naming_the_entry(
        tp2: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = tp2
    other = make_spec().model_copy(deep=True)
    other = type(other).model_validate({**other.model_dump(by_alias=True, exclude_none=True),
                                        "model": {"preset": "tiny", "vocabSize": 512}})
    with pytest.raises(UserError, match=r"tok_embeddings.weight is \(256, .*spec.model"):
        load(other, "job", CheckpointEntry(4, path), held_out=False)


def test_kv_heads_replicated_over_ranks_are_refused_naming_the_converter(
        tmp_path: Path) -> None:
    """tp above the kv-head count: NxD's GQA layer, whose head layout the checkpoint does not
    record (trn1 and trn2 differ)."""
    shard = {"layers.0.attention.wqkv.weight_qkv": torch.zeros(4, 4)}
    path = write_nxd(tmp_path / "step_4", [shard, shard])
    with pytest.raises(UserError, match=r"checkpoint_converter\.py"):
        nxd_checkpoint.read_model(path, {"tok_embeddings.weight": torch.zeros(4, 4)})


def test_neither_format_is_refused_as_not_a_checkpoint_of_ours(tmp_path: Path) -> None:
    path = tmp_path / "step_4"
    path.mkdir()
    (path / DONE).write_text("1")
    with pytest.raises(UserError, match="not a checkpoint of ours"):
        load(make_spec(), "job", CheckpointEntry(4, path), held_out=False)
