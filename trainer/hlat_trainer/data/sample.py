"""`hlat-data sample`: a small real dataset and tokenizer made from text every machine has.

Why: the demo, the tests and the benchmarks need an Arrow dataset and a BPE tokenizer without
downloading anything. Every Python install carries its standard library's sources: megabytes of
code, docstrings and comments in English, which is enough for a tiny model's loss to fall.

Design choices and trade-offs:
- Documents are the stdlib `.py` files (test suites, `site-packages` and caches skipped, since
  those differ between machines), cut at top-level statements into pieces of about
  `DOC_CHARS` characters, so documents have a realistic spread of lengths and many are shorter
  than a training sequence (which exercises packing).
- `--docs N` keeps N pieces spread evenly over the whole library (not the first N files, which
  would all be `_`-prefixed private modules); the order is the sorted path order, so the output
  is the same for the same Python. The loader shuffles; this file does not need to.
- The tokenizer is a byte-level BPE (GPT-2 style, 4096 ids by default) with `<|endoftext|>` as
  its only special token, trained with `tokenizers` on the same documents.
- Output: `DIR/train.arrow` (Arrow IPC *file* format, one `text` column) and
  `DIR/tokenizer.json`; with `--docs N`, also `DIR/held-out/held_out.arrow`: up to N/10 (at
  least 8, at most 200) pieces the training set left out, spread evenly over the rest of the
  library, for `spec.eval` (a subdirectory: a directory `data.path` reads only its own
  top-level files, so training never sees them). Without `--docs` every piece trains and no
  held-out set is written. Each is written to a temporary name in DIR and renamed into place, so an
  interrupted run never leaves a half-written file where the trainer would load it.
"""

from __future__ import annotations

import os
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hlat_trainer.errors import UserError

EOS_TOKEN = "<|endoftext|>"
DOC_CHARS = 4000
"""Target length of a sample document in characters (about 1000-1500 BPE tokens)."""

_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
)


@dataclass(frozen=True)
class SampleReport:
    """What `write_sample` wrote, for printing."""

    dataset: Path
    tokenizer: Path
    documents: int
    characters: int
    tokens: int
    vocab_size: int
    held_out: Path | None = None
    held_out_documents: int = 0


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's own `.py` files, in a deterministic (sorted) order."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    found = [
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def split_source(text: str, target: int = DOC_CHARS) -> Iterator[str]:
    """Cut a source file into pieces of about `target` characters at top-level statements.

    A statement longer than 4 x `target` (a big data table) is cut at any line instead.
    """
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        starts_statement = bool(line.strip()) and not line[0].isspace()
        if (size >= target and starts_statement) or size >= 4 * target:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    if piece and "".join(piece).strip():
        yield "".join(piece)


def _all_pieces() -> list[str]:
    docs: list[str] = []
    for path in stdlib_files():
        try:
            docs.extend(split_source(path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are deliberately not UTF-8
    return list(dict.fromkeys(docs))  # a few stdlib files are copies of each other


def _spread(docs: list[str], n: int) -> list[str]:
    return docs if n >= len(docs) else [docs[i * len(docs) // n] for i in range(n)]


def sample_documents(num_docs: int | None) -> list[str]:
    """Up to `num_docs` distinct stdlib pieces spread evenly over the library (all if None)."""
    return sample_split(num_docs)[0]


def sample_split(num_docs: int | None) -> tuple[list[str], list[str]]:
    """The training pieces (`sample_documents`) and a held-out set of pieces they do not
    hold: up to num_docs/10 (8..200) spread over the rest; none when every piece trains."""
    docs = _all_pieces()
    if num_docs is None or num_docs >= len(docs):
        return docs, []
    train = _spread(docs, num_docs)
    chosen = set(train)
    rest = [d for d in docs if d not in chosen]
    return train, _spread(rest, min(len(rest), max(8, min(200, num_docs // 10))))


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with `EOS_TOKEN` as its special token, trained on `docs`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def write_sample(out: Path, num_docs: int | None = None, vocab_size: int = 4096) -> SampleReport:
    """Write `out/train.arrow` and `out/tokenizer.json`; see the module docstring."""
    if num_docs is not None and num_docs < 1:
        raise UserError(f"--docs must be at least 1, got {num_docs}")
    if vocab_size < 512:
        raise UserError(f"--vocab-size must be at least 512 (256 bytes + merges), got {vocab_size}")
    docs, held = sample_split(num_docs)
    if not docs:
        raise UserError(
            f"found no Python sources under {sysconfig.get_paths()['stdlib']}: this Python "
            "install has no standard library sources; use a dataset of your own (data.path)"
        )
    _make_dir(out)
    tok = train_tokenizer(docs, vocab_size)
    tokens = _estimate_tokens(tok, docs)
    dataset, tokenizer = out / "train.arrow", out / "tokenizer.json"
    _atomic_write(tokenizer, lambda p: tok.save(str(p)))
    _atomic_write(dataset, lambda p: _write_arrow(p, docs))
    held_out = None
    if held:
        held_out = out / "held-out" / "held_out.arrow"
        _make_dir(held_out.parent)
        _atomic_write(held_out, lambda p: _write_arrow(p, held))
    return SampleReport(
        dataset=dataset,
        tokenizer=tokenizer,
        documents=len(docs),
        characters=sum(len(d) for d in docs),
        tokens=tokens + len(docs),  # one EOS after each document; an estimate
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        held_out=held_out,
        held_out_documents=len(held),
    )


def _estimate_tokens(tok: Tokenizer, docs: list[str], every: int = 10) -> int:
    """Tokens in `docs` extrapolated from every `every`-th one (encoding all takes seconds)."""
    part = docs[::every]
    part_tokens = sum(len(e.ids) for e in tok.encode_batch(part, add_special_tokens=False))
    part_chars = max(1, sum(len(d) for d in part))
    return round(part_tokens * sum(len(d) for d in docs) / part_chars)


def _make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output directory {out}: {exc}; pick another --out") from exc


def _write_arrow(path: Path, docs: list[str]) -> None:
    table = pa.table({"text": pa.array(docs, type=pa.string())})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=256)


def _atomic_write(final: Path, write: object) -> None:
    """Call `write(tmp)` for a temporary path next to `final`, then rename it into place."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        assert callable(write)
        write(tmp)
        tmp.chmod(0o644)  # mkstemp makes it 0600; a dataset is meant to be shared
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
