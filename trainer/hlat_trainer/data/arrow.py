"""Arrow files as a random-access list of documents, memory-mapped.

Why: the online packing loader (paper section 3.3) shuffles *all* documents of a dataset and
reads them in permuted order, so it needs `text of document i` for any i, for datasets far
larger than memory. Arrow IPC files memory-map with zero copies: opening a dataset reads only
the schema and batch headers, and a document's bytes are paged in when it is read.

Design choices and trade-offs:
- Both Arrow IPC layouts are accepted, told apart by trying to open each file as the random-access
  *file* format first and then as the *stream* format (what HF `datasets` `save_to_disk` writes
  as `data-*.arrow`). Stream files have no footer, so opening one walks its batch headers once.
  Compressed IPC buffers cannot be mapped and are decompressed into memory when the file opens.
- `data.path` is a file, a directory (its `*.arrow` files, not recursive, so a `DatasetDict`'s
  splits are never mixed silently) or a glob; files are sorted by path so that every rank and
  every restart numbers the documents the same way.
- Document ids run over the files in that order; a null text is an empty document.
- `fingerprint` (file names, row counts, text column) identifies the dataset in loader states.
  Names are base names, so a dataset moved to another mount point still matches.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hlat_trainer.errors import UserError

ARROW_SUFFIX = ".arrow"
_GLOB_CHARS = frozenset("*?[")


def resolve_paths(spec: str | os.PathLike[str]) -> list[Path]:
    """The Arrow files `data.path` names (a file, a directory or a glob), sorted."""
    spec = os.fspath(spec)
    if _GLOB_CHARS.intersection(spec):
        found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not found:
            raise UserError(f"no files match data.path {spec!r}: check the pattern")
        return found
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        return _files_in_dir(path)
    raise UserError(
        f"data path {path} does not exist: set data.path to an Arrow file, a directory of them "
        f"or a glob (to make a sample dataset: `hlat-data sample --out {path}`)"
    )


def _files_in_dir(path: Path) -> list[Path]:
    found = sorted(p for p in path.iterdir() if p.suffix == ARROW_SUFFIX and p.is_file())
    if found:
        return found
    nested = sorted({p.parent for p in path.rglob(f"*{ARROW_SUFFIX}")})
    if nested:
        names = ", ".join(str(p) for p in nested[:5])
        raise UserError(
            f"no Arrow files directly under {path}, but subdirectories have some ({names}): "
            f"set data.path to one of them (e.g. one split of a DatasetDict) or to a glob "
            f"such as {path}/**/*{ARROW_SUFFIX}"
        )
    raise UserError(
        f"no Arrow files ({ARROW_SUFFIX}) under {path}: did you run "
        f"`hlat-data sample --out {path}`, or mean another data.path?"
    )


def _read_table(path: Path) -> pa.Table:
    """The whole file as a table whose buffers point into a memory map (no copy)."""
    try:
        source = pa.memory_map(str(path), "r")
    except OSError as exc:
        raise UserError(f"cannot open data file {path}: {exc}") from exc
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        pass
    try:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid as exc:
        raise UserError(
            f"{path} is not an Arrow IPC file or stream ({exc}): data.path must name Arrow "
            f"files, e.g. those `datasets.Dataset.save_to_disk` or `hlat-data sample` write"
        ) from exc


def _text_chunks(path: Path, table: pa.Table, column: str) -> list[pa.Array]:
    if column not in table.column_names:
        raise UserError(
            f"column {column!r} not in {path} (columns: {', '.join(table.column_names)}): "
            f"set data.textColumn to the column that holds the text"
        )
    col = table.column(column)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise UserError(
            f"column {column!r} of {path} has type {col.type}, not string: "
            f"set data.textColumn to a string column"
        )
    return [c for c in col.chunks if len(c)]


class ArrowSource:
    """The documents of one or more Arrow files, addressed by a global document id."""

    def __init__(self, spec: str | os.PathLike[str], text_column: str) -> None:
        self.spec = os.fspath(spec)
        self.text_column = text_column
        self.paths = resolve_paths(spec)
        self._chunks: list[pa.Array] = []
        rows: list[int] = []
        for path in self.paths:
            chunks = _text_chunks(path, _read_table(path), text_column)
            self._chunks.extend(chunks)
            rows.append(sum(len(c) for c in chunks))
        self.rows_per_file = rows
        self.num_documents = sum(rows)
        if self.num_documents == 0:
            raise UserError(
                f"dataset {self.spec} has no documents ({len(self.paths)} file(s), all empty): "
                f"point data.path at a dataset with rows"
            )
        lengths = np.array([len(c) for c in self._chunks], dtype=np.int64)
        self._chunk_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])

    @property
    def fingerprint(self) -> dict[str, Any]:
        """Identifies the dataset: base names and row counts of its files, and the column."""
        return {
            "files": [[p.name, n] for p, n in zip(self.paths, self.rows_per_file, strict=True)],
            "text_column": self.text_column,
        }

    def text(self, doc_id: int) -> str:
        """The text of document `doc_id` (0 <= doc_id < num_documents)."""
        k = int(np.searchsorted(self._chunk_starts, doc_id, side="right")) - 1
        value = self._chunks[k][doc_id - int(self._chunk_starts[k])].as_py()
        return value if value is not None else ""

    def texts(self, doc_ids: list[int]) -> list[str]:
        """The texts of several documents, in the order given."""
        return [self.text(i) for i in doc_ids]
