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
from hlat_api.presets import ModelDims
from hlat_trainer import nxd_checkpoint
from hlat_trainer.errors import UserError
from hlat_trainer.evaluate import CheckpointEntry, load
from hlat_trainer.model import Attention, apply_rope, build_model, rope_tables


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


def test_neither_format_is_refused_as_not_a_checkpoint_of_ours(tmp_path: Path) -> None:
    path = tmp_path / "step_4"
    path.mkdir()
    (path / DONE).write_text("1")
    with pytest.raises(UserError, match="not a checkpoint of ours"):
        load(make_spec(), "job", CheckpointEntry(4, path), held_out=False)


def _nxd_gqa_shards(dims: ModelDims, tp: int, gen: torch.Generator
                    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Layer 0's attention as NxD's GQA layer holds it on trn1 at `tp` (above the kv-head
    count): rank r has query heads [r*q, (r+1)*q) and the replicated kv list's slice, that list
    being the kv heads tiled tp/kv times (modules/qkv_linear.py 84-86, `repeat(m, 1)`); its
    `weight_qkv` is its query rows, then key, then value (474-481); `wo` is row-parallel.
    Returns the shards and the whole weights (query heads, k, v, wo) they were cut from."""
    h, hd = dims.hidden_size, dims.head_dim
    q = torch.randn(dims.heads, hd, h, generator=gen)
    k = torch.randn(dims.kv_heads, hd, h, generator=gen)
    v = torch.randn(dims.kv_heads, hd, h, generator=gen)
    wo = torch.randn(h, dims.heads * hd, generator=gen)
    tiled = list(range(dims.kv_heads)) * (tp // dims.kv_heads)
    q_local, kv_local = dims.heads // tp, len(tiled) // tp
    shards = []
    for r in range(tp):
        kv = tiled[r * kv_local:(r + 1) * kv_local]
        fused = torch.cat([*q[r * q_local:(r + 1) * q_local], *k[kv], *v[kv]])
        shards.append({"layers.0.attention.wqkv.weight_qkv": fused,
                       "layers.0.attention.wo.weight": wo[:, r * q_local * hd:
                                                           (r + 1) * q_local * hd]})
    return shards, {"q": q, "k": k, "v": v, "wo": wo}


def _nxd_attention(x: torch.Tensor, shards: list[dict[str, torch.Tensor]], dims: ModelDims,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """What NxD's ranks compute together from the shards (nxd_model.NxDAttention with the GQA
    layer): each rank's query heads attend to its kv heads in order, and the row-parallel
    `wo` outputs are summed."""
    b, t, _ = x.shape
    hd, tp = dims.head_dim, len(shards)
    q_local = dims.heads // tp
    out = torch.zeros(b, t, dims.hidden_size)
    for shard in shards:
        rows = (x @ shard["layers.0.attention.wqkv.weight_qkv"].T).view(b, t, -1, hd)
        kv_local = (rows.shape[2] - q_local) // 2
        q, k, v = rows.split([q_local, kv_local, kv_local], dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        pairs = q_local // kv_local
        k, v = k.repeat_interleave(pairs, dim=1), v.repeat_interleave(pairs, dim=1)
        mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out += mixed.transpose(1, 2).reshape(b, t, -1) @ shard["layers.0.attention.wo.weight"].T
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(8, 2, 4), (8, 2, 8), (4, 1, 4)])
def test_kv_heads_replicated_over_ranks_on_trn1_read_as_the_same_attention(
        tmp_path: Path, heads: int, kv_heads: int, tp: int) -> None:
    """tp above the kv-head count (the paper's 70B: tp 32, 8 kv heads): the query heads each
    rank pairs with its copy of a kv head are regrouped into model.py's layout, `wo`'s columns
    alike; model.py's attention on the joined weights computes what NxD's ranks compute."""
    dims = ModelDims(hidden_size=8 * heads, layers=1, heads=heads, kv_heads=kv_heads,
                     intermediate_size=16, vocab_size=32, max_seq_len=16)
    shards, _ = _nxd_gqa_shards(dims, tp, torch.Generator().manual_seed(tp))
    path = write_nxd(tmp_path / "step_4", shards)
    attention = Attention(dims)
    like = {f"layers.0.attention.{k}": v for k, v in attention.state_dict().items()}
    joined = nxd_checkpoint.read_model(path, like, dims, "trn1.32xlarge")
    attention.load_state_dict({k.removeprefix("layers.0.attention."): v
                               for k, v in joined.items()})
    cos, sin = rope_tables(dims.head_dim, 16, dims.rope_theta)
    x = torch.randn(2, 16, dims.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _nxd_attention(x, shards, dims, cos, sin)
        got = attention(x, cos, sin)
    # fp32, summed in another order: a few ulps of the largest entry; a head paired with the
    # wrong kv head is off by the output's own scale
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)


def test_kv_heads_replicated_over_ranks_on_trn2_are_refused_naming_the_converter(
        tmp_path: Path) -> None:
    """trn2 replicates kv rows by `repeat_interleave` (qkv_linear.py 80-83), not read here."""
    dims = ModelDims(hidden_size=64, layers=1, heads=8, kv_heads=2, intermediate_size=16,
                     vocab_size=32, max_seq_len=16)
    shards, _ = _nxd_gqa_shards(dims, 4, torch.Generator().manual_seed(0))
    path = write_nxd(tmp_path / "step_4", shards)
    like = {f"layers.0.attention.{k}": v for k, v in Attention(dims).state_dict().items()}
    with pytest.raises(UserError, match=r"not trn2\.48xlarge.*checkpoint_converter\.py"):
        nxd_checkpoint.read_model(path, like, dims, "trn2.48xlarge")
