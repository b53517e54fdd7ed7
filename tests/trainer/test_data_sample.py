"""`hlat-data sample`: a dataset and tokenizer from the Python stdlib, usable by the loader."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from hlat_trainer.data import PackedLoader, load_tokenizer
from hlat_trainer.data.cli import main
from hlat_trainer.data.sample import split_source


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sample")
    assert main(["sample", "--out", str(out), "--docs", "120", "--vocab-size", "1024"]) == 0
    return out


def test_sample_writes_an_arrow_file_and_a_tokenizer(
    sample_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sorted(p.name for p in sample_dir.iterdir()) == [
        "held-out", "tokenizer.json", "train.arrow"]
    table = pa.ipc.open_file(pa.memory_map(str(sample_dir / "train.arrow"))).read_all()
    assert table.column_names == ["text"] and table.num_rows == 120
    texts = table.column("text").to_pylist()
    assert len(set(texts)) == 120 and sum(len(t) for t in texts) > 100_000
    assert sum("def " in t for t in texts) > 60  # Python code, docstrings included
    tok = load_tokenizer(str(sample_dir / "tokenizer.json"))
    assert tok.vocab_size == 1024 and tok.decode([tok.eos_id]) == "<|endoftext|>"
    [ids] = tok.encode_batch([texts[0]])
    assert tok.decode(ids) == texts[0] and len(ids) < len(texts[0]) / 2  # a real BPE


def test_sample_is_deterministic_and_overwrites_cleanly(sample_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "train.arrow").write_text("stale, half-written")
    assert main(["sample", "--out", str(tmp_path), "--docs", "120", "--vocab-size", "1024"]) == 0
    for name in ("train.arrow", "tokenizer.json", "held-out/held_out.arrow"):
        assert (tmp_path / name).read_bytes() == (sample_dir / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "held-out", "tokenizer.json", "train.arrow"]


def test_the_held_out_set_shares_no_document_with_training_and_training_never_reads_it(
        sample_dir: Path) -> None:
    def texts(path: Path) -> list[str]:
        return list(pa.ipc.open_file(pa.memory_map(str(path))).read_all().column("text")
                    .to_pylist())

    held, trained = texts(sample_dir / "held-out" / "held_out.arrow"), texts(
        sample_dir / "train.arrow")
    assert len(held) == 12 and len(set(held)) == 12  # 120 / 10
    assert not set(held) & set(trained)
    from hlat_trainer.data.arrow import resolve_paths

    # data.path = the sample directory reads its own top-level file only
    assert resolve_paths(sample_dir) == [sample_dir / "train.arrow"]


def test_without_docs_every_piece_trains_and_none_is_held_out(tmp_path: Path) -> None:
    from hlat_trainer.data.sample import sample_split

    train, held = sample_split(None)
    assert held == [] and len(train) > 1000


def test_loader_trains_on_the_sample(sample_dir: Path) -> None:
    tok = load_tokenizer(str(sample_dir / "tokenizer.json"))
    with PackedLoader(
        str(sample_dir),
        tok,
        text_column="text",
        seq_len=128,
        micro_batch=4,
        dp_rank=1,
        dp_size=2,
        seed=3,
    ) as loader:
        batches = [next(loader) for _ in range(20)]
    tokens = [int(t) for _, y in batches for t in y.flatten()]
    assert min(tokens) >= 0 and max(tokens) < tok.vocab_size
    assert tokens.count(tok.eos_id) >= 2
    text = tok.decode(tokens)
    assert "<|endoftext|>" in text and "def " in text


def test_sample_prints_what_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", "--out", str(tmp_path), "--docs", "5", "--vocab-size", "600"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path}/train.arrow: 5 documents" in out
    assert f"wrote {tmp_path}/tokenizer.json: byte-level BPE, vocab 600" in out


def test_sample_bad_arguments_exit_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sample", "--out", str(tmp_path), "--docs", "0"]) == 2
    assert "--docs must be at least 1" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["sample", "--out", str(blocker / "sub")]) == 2
    assert "cannot create output directory" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.tmp"))


def test_split_source_cuts_at_top_level_statements() -> None:
    src = "".join(f"def f{i}():\n    return {i}\n\n" for i in range(100))
    pieces = list(split_source(src, target=200))
    assert "".join(pieces) == src
    assert len(pieces) > 5
    assert all(p.startswith("def ") for p in pieces)
