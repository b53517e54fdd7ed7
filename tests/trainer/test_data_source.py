"""Arrow input: IPC file and stream formats, `datasets`-written data, paths, and bad input."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pytest

from hlat_trainer.data import ArrowSource, PackedLoader, load_tokenizer, resolve_paths
from hlat_trainer.errors import UserError

DOCS = [f"document {i}: " + "abc" * (i % 7) for i in range(50)]


def write_arrow(
    path: Path, docs: Sequence[str | None], *, stream: bool = False, chunk: int = 7
) -> Path:
    table = pa.table({"id": pa.array(range(len(docs))), "text": pa.array(docs, type=pa.string())})
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=chunk)
    return path


def all_texts(source: ArrowSource) -> list[str]:
    return source.texts(list(range(source.num_documents)))


@pytest.mark.parametrize("stream", [False, True], ids=["ipc-file", "ipc-stream"])
def test_reads_both_ipc_formats(tmp_path: Path, stream: bool) -> None:
    source = ArrowSource(str(write_arrow(tmp_path / "d.arrow", DOCS, stream=stream)), "text")
    assert source.num_documents == 50
    assert all_texts(source) == DOCS
    assert source.text(49) == DOCS[49]


def test_reads_a_dataset_saved_by_hf_datasets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets  # here: importing it takes seconds

    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(50))}).save_to_disk(tmp_path / "ds")
    assert any(p.name.startswith("data-") for p in (tmp_path / "ds").iterdir())
    source = ArrowSource(str(tmp_path / "ds"), "text")
    assert all_texts(source) == DOCS
    with PackedLoader(
        tmp_path / "ds",  # a Path works as well as a str
        load_tokenizer("bytes"),
        text_column="text",
        seq_len=64,
        micro_batch=2,
        dp_rank=0,
        dp_size=1,
        seed=0,
    ) as loader:
        inputs, targets = next(loader)
    assert inputs.shape == targets.shape == (2, 64)


def test_directory_and_glob_take_files_in_sorted_order(tmp_path: Path) -> None:
    write_arrow(tmp_path / "b.arrow", DOCS[25:], stream=True)
    write_arrow(tmp_path / "a.arrow", DOCS[:25])
    (tmp_path / "notes.txt").write_text("not data")
    for spec in (str(tmp_path), str(tmp_path / "*.arrow")):
        source = ArrowSource(spec, "text")
        assert [p.name for p in source.paths] == ["a.arrow", "b.arrow"]
        assert all_texts(source) == DOCS
        assert source.fingerprint == {
            "files": [["a.arrow", 25], ["b.arrow", 25]],
            "text_column": "text",
        }


def test_null_text_is_an_empty_document(tmp_path: Path) -> None:
    source = ArrowSource(str(write_arrow(tmp_path / "d.arrow", ["a", None, "b"])), "text")
    assert all_texts(source) == ["a", "", "b"]


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data path .*/nope does not exist.*hlat-data sample"):
        resolve_paths(str(tmp_path / "nope"))


def test_directory_without_arrow_files(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(
        UserError, match=rf"no Arrow files .* under {tmp_path}: did you run `hlat-data sample"
    ):
        resolve_paths(str(tmp_path))


def test_dataset_dict_directory_asks_for_one_split(tmp_path: Path) -> None:
    for split in ("test", "train"):
        (tmp_path / split).mkdir()
        write_arrow(tmp_path / split / "data-00000-of-00001.arrow", DOCS)
    with pytest.raises(UserError, match=r"subdirectories have some \(.*/test, .*/train\)"):
        resolve_paths(str(tmp_path))
    assert len(resolve_paths(str(tmp_path / "*" / "*.arrow"))) == 2


def test_glob_matching_nothing(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no files match data\.path '.*\*\.arrow'"):
        resolve_paths(str(tmp_path / "*.arrow"))


@pytest.mark.parametrize("content", [b"", b"hello, I am a CSV,\n1,2\n", b"ARROW1" + b"\0" * 100])
def test_non_arrow_file(tmp_path: Path, content: bytes) -> None:
    write_arrow(tmp_path / "a.arrow", DOCS)
    (tmp_path / "b.arrow").write_bytes(content)
    with pytest.raises(UserError, match=r"b\.arrow is not an Arrow IPC file or stream"):
        ArrowSource(str(tmp_path), "text")


def test_missing_column_names_file_and_columns(tmp_path: Path) -> None:
    path = write_arrow(tmp_path / "d.arrow", DOCS)
    with pytest.raises(
        UserError,
        match=r"column 'content' not in .*d\.arrow \(columns: id, text\): set data\.textColumn",
    ):
        ArrowSource(str(path), "content")


def test_non_string_column(tmp_path: Path) -> None:
    path = write_arrow(tmp_path / "d.arrow", DOCS)
    with pytest.raises(UserError, match=r"column 'id' of .*d\.arrow has type int64, not string"):
        ArrowSource(str(path), "id")


@pytest.mark.parametrize("stream", [False, True])
def test_empty_dataset(tmp_path: Path, stream: bool) -> None:
    write_arrow(tmp_path / "d.arrow", [], stream=stream)
    with pytest.raises(UserError, match=rf"dataset {tmp_path} has no documents"):
        ArrowSource(str(tmp_path), "text")


def test_fewer_documents_than_ranks(tmp_path: Path) -> None:
    path = write_arrow(tmp_path / "d.arrow", DOCS[:3])
    with pytest.raises(UserError, match=r"has 3 documents, fewer than the 4 streams it is read "
                                        r"in \(one per data-parallel rank\)"):
        PackedLoader(
            str(path),
            load_tokenizer("bytes"),
            text_column="text",
            seq_len=8,
            micro_batch=1,
            dp_rank=0,
            dp_size=4,
            seed=0,
        )


def test_fewer_documents_than_sequences_in_a_global_batch(tmp_path: Path) -> None:
    """The trainer reads one lane per sequence of the global batch: each needs documents."""
    path = write_arrow(tmp_path / "d.arrow", DOCS[:3])
    with pytest.raises(UserError, match=r"has 3 documents, fewer than the 8 streams it is read "
                                        r"in \(one per sequence of a global batch, "
                                        r"train\.globalBatch\): use a larger dataset"):
        PackedLoader(str(path), load_tokenizer("bytes"), text_column="text", seq_len=8,
                     micro_batch=2, dp_rank=0, dp_size=2, seed=0, global_batch=8, lanes=8)
