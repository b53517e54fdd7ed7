"""The online packing data loader of the HLAT paper (section 3.3).

Why: tokenizing and packing online, during training, lets one Arrow dataset serve any tokenizer
and sequence length with no offline preprocessing, and costs no throughput as long as a CPU
thread tokenizes future batches while the accelerator runs the current one.

What one data-parallel rank sees, as a pure function of (dataset, tokenizer, seed, rank, size):
every epoch e shuffles ALL documents with a permutation seeded by (seed, e); rank r takes every
`dp_size`-th document of it, starting at r, so the ranks' streams are disjoint and together
cover each document once per epoch; epochs follow each other forever. The rank's documents are
tokenized, each followed by EOS, and concatenated into one token stream. Row k of the rank's
output is stream[k*L : k*L + L + 1] (L = seq_len): inputs are its first L tokens and targets its
last L. Consecutive rows overlap by one token, so the tokens left over at the end of a row start
the next one (the paper's "left over tokens ... used in the following sample") and every token
except the very first is a target exactly once. A micro-batch is `micro_batch` consecutive rows.

After a change of the data-parallel degree (`PackedLoader.reshard`, a resume on fewer or more
nodes) the rest of the current epoch, from the earliest document some old rank had not
finished, is dealt round robin to the new ranks (a `Deal`: epoch and permutation index it
starts at); later epochs are dealt from their start as above. Nothing is skipped; what old
ranks had read past that point is read again.

Design choices and trade-offs:
- Documents are never cropped or padded: packing wastes nothing, at the price that a sequence
  can start mid-document and attention crosses EOS boundaries (the paper does the same; EOS tells
  the model that the texts are unrelated).
- A daemon thread reads, tokenizes and packs ahead of the trainer into a queue of at most
  `prefetch` micro-batches; a crashed trainer never hangs on it. Errors in the thread (a bad
  file) are re-raised in the consumer at its next batch.
- The resume state records what the trainer CONSUMED, not what the thread prefetched: the
  position of the next row's first token as (epoch, document index in this rank's share of the
  epoch, token offset into that document). That is three ints however long the documents are;
  resuming re-tokenizes one document, cheap next to keeping a token buffer in every checkpoint.
  The state also records seed, rank, size, seq_len and fingerprints of dataset and tokenizer,
  and a loader built differently refuses it instead of silently training on other data.
- The permutation is materialised once per epoch (8 bytes per document per rank process: 800 MB
  for 100M documents); a lazy permutation (e.g. a Feistel network) would remove that.
- Tokenization goes through `Tokenizer.encode_batch` in groups of `ENCODE_GROUP` documents; HF
  tokenizers parallelise a group over cores (set RAYON_NUM_THREADS to limit that).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from hlat_trainer.data.arrow import ArrowSource
from hlat_trainer.data.tokenizer import Tokenizer
from hlat_trainer.errors import UserError

if TYPE_CHECKING:
    import torch

STATE_VERSION = 1
ENCODE_GROUP = 32
"""Documents tokenized per `encode_batch` call in the background thread."""


@dataclass(frozen=True)
class Position:
    """Where the next row starts in a rank's stream."""

    epoch: int
    doc: int
    """Index of the document within this rank's share of the epoch's permutation."""
    offset: int
    """Tokens of that document (its EOS included) that lie before the next row's first token."""


@dataclass(frozen=True)
class Deal:
    """Where the current data-parallel layout began dealing documents: from index `start` of
    epoch `epoch`'s permutation (0, 0 for a run that never changed its dp degree). Every later
    epoch is dealt from its start."""

    epoch: int = 0
    start: int = 0

    def first(self, epoch: int) -> int:
        return self.start if epoch == self.epoch else 0


class RankStream:
    """The documents of one data-parallel rank, in order, tokenized and followed by EOS."""

    def __init__(
        self, source: ArrowSource, tokenizer: Tokenizer, seed: int, dp_rank: int, dp_size: int,
        deal: Deal | None = None,
    ) -> None:
        self.source, self.tokenizer = source, tokenizer
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.deal = deal or Deal()
        self._cached: tuple[int, np.ndarray] | None = None

    def docs_of_epoch(self, epoch: int) -> np.ndarray:
        """Global ids of this rank's documents in `epoch`, in the order it reads them."""
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(self.source.num_documents)
            first = self.deal.first(epoch)
            self._cached = (epoch, perm[first + self.dp_rank :: self.dp_size])
        return self._cached[1]

    def permutation_index(self, p: Position) -> int:
        """Index in epoch `p.epoch`'s permutation of the document at position `p`."""
        return self.deal.first(p.epoch) + self.dp_rank + p.doc * self.dp_size

    def encode(self, doc_ids: list[int]) -> list[np.ndarray]:
        """Token ids of the documents, each followed by EOS, as int64 arrays."""
        eos = self.tokenizer.eos_id
        encoded = self.tokenizer.encode_batch(self.source.texts(doc_ids))
        return [np.array([*ids, eos], dtype=np.int64) for ids in encoded]

    def documents(self, start: Position) -> Iterator[tuple[int, int, np.ndarray]]:
        """(epoch, doc, tokens) from document `start.doc` of `start.epoch` on, forever."""
        epoch, doc = start.epoch, start.doc
        while True:
            docs = self.docs_of_epoch(epoch)
            while doc < len(docs):
                group = [int(i) for i in docs[doc : doc + ENCODE_GROUP]]
                for k, tokens in enumerate(self.encode(group)):
                    yield epoch, doc + k, tokens
                doc += len(group)
            epoch, doc = epoch + 1, 0


def pack(
    stream: RankStream, start: Position, seq_len: int, micro_batch: int
) -> Iterator[tuple[np.ndarray, Position]]:
    """Micro-batches of rows as flat arrays of micro_batch*seq_len+1 tokens, and the position
    after each. Rows are `flat[i*seq_len : (i+1)*seq_len + 1]`."""
    docs = stream.documents(start)
    segments: list[tuple[int, int, int, np.ndarray]] = []  # (epoch, doc, offset, tokens[offset:])
    buffered = 0
    step, need = micro_batch * seq_len, micro_batch * seq_len + 1
    first = True
    while True:
        while buffered < need:
            epoch, doc, tokens = next(docs)
            offset = start.offset if first else 0
            first = False
            segments.append((epoch, doc, offset, tokens[offset:]))
            buffered += len(tokens) - offset
        flat = _take(segments, need)
        segments = _advance(segments, step)
        buffered -= step
        epoch, doc, offset, _ = segments[0]
        yield flat, Position(epoch, doc, offset)


def _take(segments: list[tuple[int, int, int, np.ndarray]], n: int) -> np.ndarray:
    parts, got = [], 0
    for *_, tokens in segments:
        parts.append(tokens[: n - got])
        got += len(parts[-1])
        if got == n:
            break
    return np.concatenate(parts)


def _advance(
    segments: list[tuple[int, int, int, np.ndarray]], n: int
) -> list[tuple[int, int, int, np.ndarray]]:
    """Drop the first `n` tokens (fewer than are buffered)."""
    k = 0
    while n >= len(segments[k][3]):
        n -= len(segments[k][3])
        k += 1
    epoch, doc, offset, tokens = segments[k]
    return [(epoch, doc, offset + n, tokens[n:]), *segments[k + 1 :]]


def _produce(
    batches: Iterator[tuple[np.ndarray, Position]],
    out: queue.Queue[Any],
    stop: threading.Event,
    shape: tuple[int, int],
) -> None:
    """Background thread: fill `out` with (inputs, targets, position) or an exception."""
    import torch  # here, not at the top: `hlat-data` imports this package and needs no torch

    try:
        for flat, position in batches:
            inputs = torch.from_numpy(flat[:-1].reshape(shape))
            targets = torch.from_numpy(flat[1:].copy().reshape(shape))
            if not _put(out, (inputs, targets, position), stop):
                return
    except BaseException as exc:  # handed to the consumer, which re-raises it
        _put(out, exc, stop)


def _put(out: queue.Queue[Any], item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class PackedLoader:
    """Iterates forever over packed micro-batches `(inputs, targets)` of one data-parallel rank.

    Both are int64 tensors of shape [micro_batch, seq_len]; see the module docstring for the
    exact semantics. Use as a context manager, or call `close()`, to stop the background thread.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str],
        tokenizer: Tokenizer,
        *,
        text_column: str,
        seq_len: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        prefetch: int = 8,
    ) -> None:
        _check_args(seq_len, micro_batch, dp_rank, dp_size, seed, prefetch)
        self.source = ArrowSource(paths, text_column)
        if self.source.num_documents < dp_size:
            raise UserError(
                f"dataset {paths} has {self.source.num_documents} documents, fewer than the "
                f"{dp_size} data-parallel ranks: use a larger dataset"
            )
        self.tokenizer = tokenizer
        self.seq_len, self.micro_batch, self.prefetch = seq_len, micro_batch, prefetch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self._deal = Deal()
        self._stream = RankStream(self.source, tokenizer, seed, dp_rank, dp_size)
        self._position = Position(0, 0, 0)
        self.wait_seconds = 0.0
        """Seconds the consumer has spent waiting for the background thread (data wait)."""
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._closed = False

    @property
    def tokens_per_batch(self) -> int:
        """Target tokens in one micro-batch: micro_batch x seq_len."""
        return self.micro_batch * self.seq_len

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def epoch(self) -> int:
        """The epoch the next row starts in (0-based)."""
        return self._position.epoch

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._closed:
            raise RuntimeError("PackedLoader is closed")
        if self._thread is None:
            self._start()
        t0 = time.perf_counter()
        item = self._get()
        self.wait_seconds += time.perf_counter() - t0
        if isinstance(item, BaseException):
            self._halt()
            raise item
        inputs, targets, self._position = item
        return inputs, targets

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                thread = self._thread
                if thread is None or not thread.is_alive():
                    return RuntimeError("the data loader thread stopped without a reason")

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        batches = pack(self._stream_copy(), self._position, self.seq_len, self.micro_batch)
        self._thread = threading.Thread(
            target=_produce,
            args=(batches, self._queue, self._stop, (self.micro_batch, self.seq_len)),
            name=f"hlat-data-rank{self.dp_rank}",
            daemon=True,
        )
        self._thread.start()

    def _stream_copy(self) -> RankStream:
        # the thread gets its own stream (and permutation cache): nothing shared with `self`
        return RankStream(self.source, self.tokenizer, self.seed, self.dp_rank, self.dp_size,
                          self._deal)

    def _halt(self) -> None:
        """Stop the background thread and drop what it prefetched."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._thread = None
        self._queue = queue.Queue()

    def close(self) -> None:
        """Stop the background thread. The loader cannot be iterated afterwards."""
        self._halt()
        self._closed = True

    def __enter__(self) -> PackedLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # absent if __init__ raised
        if stop is not None:
            stop.set()

    def state_dict(self) -> dict[str, Any]:
        """What the trainer has consumed, small and picklable (ints, strings, lists)."""
        p = self._position
        return {
            "version": STATE_VERSION,
            "epoch": p.epoch,
            "doc": p.doc,
            "offset": p.offset,
            "deal_epoch": self._deal.epoch,
            "deal_start": self._deal.start,
            **self._layout(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume so that the next batch is the one after those consumed when `state` was taken."""
        _check_state_layout(state, self._layout())
        position = Position(int(state["epoch"]), int(state["doc"]), int(state["offset"]))
        self._set(_deal_of(state), position)

    def reshard(self, states: list[dict[str, Any]]) -> None:
        """Continue the data of a run that had `len(states)` data-parallel ranks (`states[r]`:
        rank r's state), under this loader's dp degree.

        The rule: the documents of the current epoch from the earliest one not yet finished by
        every old rank (the "frontier", in the epoch's permutation order) on are dealt again,
        round robin, to the new ranks; later epochs are dealt as usual. So no document is
        skipped, the frontier document continues at the token where its old reader stopped,
        and the documents that old ranks had read beyond the frontier (at most about the
        spread of their progress times the old dp degree) are read again. The same states give
        every new rank the same frontier.
        """
        if not states:
            raise ValueError("reshard needs the state of every old data-parallel rank")
        old_size = len(states)
        frontier: tuple[int, int, int] | None = None  # (epoch, permutation index, offset)
        for rank, state in enumerate(states):
            mine = {**self._layout(), "dp_rank": rank, "dp_size": old_size}
            _check_state_layout(state, mine)
            old = RankStream(self.source, self.tokenizer, self.seed, rank, old_size,
                             _deal_of(state))
            p = Position(int(state["epoch"]), int(state["doc"]), int(state["offset"]))
            here = (p.epoch, old.permutation_index(p), p.offset)
            if frontier is None or here[:2] < frontier[:2]:
                frontier = here
        assert frontier is not None
        epoch, start, offset = frontier
        deal = Deal(epoch, start)
        if start + self.dp_rank >= self.source.num_documents:  # no document left for this rank
            self._set(Deal(epoch + 1, 0), Position(epoch + 1, 0, 0))
        else:
            self._set(deal, Position(epoch, 0, offset if self.dp_rank == 0 else 0))

    def _set(self, deal: Deal, position: Position) -> None:
        self._halt()
        self._deal = deal
        self._stream = RankStream(self.source, self.tokenizer, self.seed, self.dp_rank,
                                  self.dp_size, deal)
        self._check_position(position)
        self._position = position

    def position_text(self) -> str:
        p, d = self._position, self._deal
        return (f"rank {self.dp_rank}/{self.dp_size} at epoch {p.epoch}, document {p.doc} of "
                f"its share dealt from permutation index {d.first(p.epoch)}, token {p.offset}")

    def _layout(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
            "dataset": self.source.fingerprint,
            "tokenizer": self.tokenizer.fingerprint,
        }

    def _check_position(self, p: Position) -> None:
        docs = self._stream.docs_of_epoch(p.epoch) if p.epoch >= 0 else np.empty(0)
        if not 0 <= p.doc < len(docs):
            raise UserError(
                f"data loader state points at document {p.doc} of epoch {p.epoch}, but this "
                f"rank has {len(docs)} documents per epoch: the checkpoint does not belong to "
                f"this dataset; start a new run (another checkpoint.dir)"
            )
        length = len(self._stream.encode([int(docs[p.doc])])[0])
        if not 0 <= p.offset < length:
            raise UserError(
                f"data loader state points at token {p.offset} of a document that has "
                f"{length} tokens: the dataset or tokenizer changed since the checkpoint; "
                f"start a new run (another checkpoint.dir)"
            )


def _deal_of(state: dict[str, Any]) -> Deal:
    return Deal(int(state.get("deal_epoch", 0)), int(state.get("deal_start", 0)))


def _check_args(
    seq_len: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int, prefetch: int
) -> None:
    if seq_len < 1:
        raise UserError(f"data.seqLen must be at least 1, got {seq_len}")
    if micro_batch < 1:
        raise UserError(f"train.microBatch must be at least 1, got {micro_batch}")
    if not 0 <= dp_rank < dp_size:
        raise UserError(f"data-parallel rank {dp_rank} is not in [0, {dp_size})")
    if seed < 0:
        raise UserError(f"data.shuffleSeed must be >= 0, got {seed}")
    if prefetch < 1:
        raise UserError(f"the loader's prefetch must be at least 1 micro-batch, got {prefetch}")


_LAYOUT_HINTS = {
    "seed": "data.shuffleSeed",
    "dp_size": "data-parallel size (nodes x devices / (tp x pp))",
    "dp_rank": "data-parallel rank",
    "seq_len": "data.seqLen",
    "dataset": "dataset (data.path, data.textColumn)",
    "tokenizer": "tokenizer (data.tokenizer)",
}


def _check_state_layout(state: dict[str, Any], mine: dict[str, Any]) -> None:
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        version = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise UserError(
            f"data loader state has version {version!r}, this trainer reads version "
            f"{STATE_VERSION}: resume with the trainer version that wrote the checkpoint"
        )
    for key, hint in _LAYOUT_HINTS.items():
        if state.get(key) != mine[key]:
            raise UserError(
                f"the checkpoint's data loader was saved with a different {hint}: "
                f"{key} was {_short(state.get(key))}, now {_short(mine[key])}. Resuming "
                f"would not continue the same data stream; restore the original setting or "
                f"start a new run (another checkpoint.dir)"
            )


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
