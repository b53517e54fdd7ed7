"""The online packing data loader of the HLAT paper (section 3.3).

Why: tokenizing and packing online, during training, lets one Arrow dataset serve any tokenizer
and sequence length with no offline preprocessing, and costs no throughput as long as a CPU
thread tokenizes future batches while the accelerator runs the current one.

The data is read in `lanes` streams, as a pure function of (dataset, tokenizer, seed, lanes):
every epoch e shuffles ALL documents with a permutation seeded by (seed, e); lane j takes every
`lanes`-th document of it, starting at j, so the lanes are disjoint and together cover each
document once per epoch; epochs follow each other forever. A lane's documents are tokenized,
each followed by EOS, and concatenated into one token stream. Row k of a lane is
stream[k*L : k*L + L + 1] (L = seq_len): inputs are its first L tokens and targets its last L.
Consecutive rows overlap by one token, so the tokens left over at the end of a row start the
next one (the paper's "left over tokens ... used in the following sample") and every token
except the very first is a target exactly once.

A step's global batch of B sequences is, lane after lane, the next B/lanes rows of each lane,
cut into B/micro_batch micro-batches. Data-parallel rank r of D reads the lanes of its share of
them (`hlat_api.spec.micro_batch_share`: consecutive, B/micro_batch/D each, the first ranks one
more when D does not divide them) and cuts its rows, in that order, into micro-batches of
`micro_batch` rows. The trainer reads one lane per sequence (lanes = B: each lane gives one
row a step), so the global batch of every step is the same sequences at every data-parallel
degree that leaves each rank a micro-batch: a run resumed on fewer or more nodes
(`PackedLoader.reshard`) trains on exactly the data it would have trained on, each lane going
on where it stopped. (lanes = D, the default outside the trainer, is one stream per rank whose
consecutive rows make its micro-batches.)

Only when the number of lanes changes (train.globalBatch changed) is the rest of the current
epoch, from the earliest document some old lane had not finished, dealt round robin to the new
lanes (a `Deal`: epoch and permutation index it starts at); later epochs are dealt from their
start as above. Nothing is skipped; what old lanes had read past that point is read again.

Design choices and trade-offs:
- Documents are never cropped or padded: packing wastes nothing, at the price that a sequence
  can start mid-document and attention crosses EOS boundaries (the paper does the same; EOS tells
  the model that the texts are unrelated).
- A daemon thread reads, tokenizes and packs ahead of the trainer into a queue of at most
  `prefetch` micro-batches; a crashed trainer never hangs on it. Errors in the thread (a bad
  file) are re-raised in the consumer at its next batch.
- The resume state records what the trainer CONSUMED, not what the thread prefetched: for
  each of the rank's lanes, the position of its next row's first token as (epoch, document
  index in the lane's share of the epoch, token offset into that document). That is three ints
  per lane however long the documents are; resuming re-tokenizes one document per lane, cheap
  next to keeping a token buffer in every checkpoint. The state also records the lanes, seed,
  seq_len and fingerprints of dataset and tokenizer, and a loader built differently refuses it
  instead of silently training on other data.
- The permutation is materialised once per epoch and shared by the rank's lanes (8 bytes per
  document per rank process: 800 MB for 100M documents); a lazy permutation (e.g. a Feistel
  network) would remove that. A lane costs a tokenizer call per `ENCODE_GROUP` of its documents
  and a buffer of at most that many documents' tokens.
- Tokenization goes through `Tokenizer.encode_batch` in groups of `ENCODE_GROUP` documents
  (after a start, 1, 2, 4, ... first: `LaneStream.documents`); HF tokenizers parallelise a
  group over cores (set RAYON_NUM_THREADS to limit that).
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

from hlat_api.spec import micro_batch_share
from hlat_trainer.data.arrow import ArrowSource
from hlat_trainer.data.tokenizer import Tokenizer
from hlat_trainer.errors import UserError

if TYPE_CHECKING:
    import torch

STATE_VERSION = 2
"""2: positions per lane (1: one stream per data-parallel rank)."""
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


class LaneStream:
    """The documents of one lane, in order, tokenized and followed by EOS."""

    def __init__(
        self, source: ArrowSource, tokenizer: Tokenizer, seed: int, lane: int, lanes: int,
        deal: Deal | None = None, permutations: Permutations | None = None,
    ) -> None:
        self.source, self.tokenizer = source, tokenizer
        self.seed, self.lane, self.lanes = seed, lane, lanes
        self.deal = deal or Deal()
        self.permutations = permutations or Permutations(source.num_documents, seed)

    def docs_of_epoch(self, epoch: int) -> np.ndarray:
        """Global ids of this lane's documents in `epoch`, in the order it reads them."""
        return self.permutations.of(epoch)[self.deal.first(epoch) + self.lane :: self.lanes]

    def permutation_index(self, p: Position) -> int:
        """Index in epoch `p.epoch`'s permutation of the document at position `p`."""
        return self.deal.first(p.epoch) + self.lane + p.doc * self.lanes

    def encode(self, doc_ids: list[int]) -> list[np.ndarray]:
        """Token ids of the documents, each followed by EOS, as int64 arrays."""
        eos = self.tokenizer.eos_id
        encoded = self.tokenizer.encode_batch(self.source.texts(doc_ids))
        return [np.array([*ids, eos], dtype=np.int64) for ids in encoded]

    def documents(self, start: Position) -> Iterator[tuple[int, int, np.ndarray]]:
        """(epoch, doc, tokens) from document `start.doc` of `start.epoch` on, forever. The
        first group is one document and each next one twice as many, up to `ENCODE_GROUP`:
        the first rows wait for one document's tokens, not a whole group's (a resumed
        trainer's first step waited 0.25 s for 32 documents a lane on the rig's shared cores,
        a quarter of its whole in-place recovery). The tokens are the same whatever the
        grouping: each document is encoded on its own."""
        epoch, doc = start.epoch, start.doc
        size = 1
        while True:
            docs = self.docs_of_epoch(epoch)
            while doc < len(docs):
                group = [int(i) for i in docs[doc : doc + size]]
                for k, tokens in enumerate(self.encode(group)):
                    yield epoch, doc + k, tokens
                doc += len(group)
                size = min(2 * size, ENCODE_GROUP)
            epoch, doc = epoch + 1, 0


class Permutations:
    """Each epoch's shuffle of all documents, seeded by (seed, epoch); the last few epochs' are
    kept, shared by the lanes of one rank (lanes drift apart by at most a few documents)."""

    KEEP = 4

    def __init__(self, num_documents: int, seed: int) -> None:
        self.num_documents, self.seed = num_documents, seed
        self._kept: dict[int, np.ndarray] = {}

    def of(self, epoch: int) -> np.ndarray:
        perm = self._kept.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_documents)
            if len(self._kept) >= self.KEEP:
                del self._kept[min(self._kept)]
            self._kept[epoch] = perm
        return perm


def pack(stream: LaneStream, start: Position, seq_len: int
         ) -> Iterator[tuple[np.ndarray, Position]]:
    """The lane's rows, seq_len+1 tokens each (consecutive rows share one token), from
    position `start` on, and the position after each."""
    docs = stream.documents(start)
    segments: list[tuple[int, int, int, np.ndarray]] = []  # (epoch, doc, offset, tokens[offset:])
    buffered = 0
    step, need = seq_len, seq_len + 1
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


def lane_rows(
    streams: list[LaneStream], starts: list[Position], seq_len: int, rows_per_lane: int,
    micro_batch: int,
) -> Iterator[tuple[np.ndarray, tuple[tuple[int, Position], ...]]]:
    """One rank's micro-batches, forever: each step, every lane of the rank in lane order
    gives `rows_per_lane` consecutive rows, and these rows, in that order, are cut into
    micro-batches of `micro_batch` rows ([micro_batch, seq_len+1] arrays). With each, where
    the lanes it read from stand after it, as (lane, position) in row order."""
    packers = [pack(stream, start, seq_len) for stream, start in zip(streams, starts,
                                                                      strict=True)]
    rows: list[np.ndarray] = []
    moved: list[tuple[int, Position]] = []
    while True:
        for stream, packer in zip(streams, packers, strict=True):
            for _ in range(rows_per_lane):
                row, position = next(packer)
                rows.append(row)
                moved.append((stream.lane, position))
                if len(rows) == micro_batch:
                    yield np.stack(rows), tuple(moved)
                    rows, moved = [], []


def _produce(
    batches: Iterator[tuple[np.ndarray, tuple[tuple[int, Position], ...]]],
    out: queue.Queue[Any],
    stop: threading.Event,
) -> None:
    """Background thread: fill `out` with (inputs, targets, lane positions) or an exception."""
    import torch  # here, not at the top: `hlat-data` imports this package and needs no torch

    try:
        for rows, moved in batches:
            inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
            targets = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
            if not _put(out, (inputs, targets, moved), stop):
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

    `global_batch`: sequences per optimizer step over all ranks (default: one micro-batch per
    rank); `lanes`: the streams the data is read in (default: one per data-parallel rank;
    the trainer uses one per sequence of the global batch, so that every step's global batch
    is the same whatever the data-parallel degree).
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
        global_batch: int | None = None,
        lanes: int | None = None,
    ) -> None:
        _check_args(seq_len, micro_batch, dp_rank, dp_size, seed, prefetch)
        self.global_batch = global_batch or dp_size * micro_batch
        self.lanes = lanes or dp_size
        self.my_lanes = rank_lanes(self.global_batch, self.lanes, micro_batch, dp_size,
                                   dp_rank)
        self.source = ArrowSource(paths, text_column)
        if self.source.num_documents < self.lanes:
            streams = ("one per data-parallel rank" if self.lanes == dp_size
                       else "one per sequence of a global batch, train.globalBatch")
            raise UserError(
                f"dataset {paths} has {self.source.num_documents} documents, fewer than the "
                f"{self.lanes} streams it is read in ({streams}): use a larger dataset"
            )
        self.tokenizer = tokenizer
        self.seq_len, self.micro_batch, self.prefetch = seq_len, micro_batch, prefetch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self._deal = Deal()
        self._positions = dict.fromkeys(self.my_lanes, Position(0, 0, 0))
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
        """The earliest epoch the next rows start in (0-based)."""
        return min(p.epoch for p in self._positions.values())

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
        inputs, targets, moved = item
        self._positions.update(moved)
        return inputs, targets

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                thread = self._thread
                if thread is None or not thread.is_alive():
                    return RuntimeError("the data loader thread stopped without a reason")

    def _streams(self) -> list[LaneStream]:
        # each caller gets its own streams and permutation cache: the thread shares nothing
        permutations = Permutations(self.source.num_documents, self.seed)
        return [LaneStream(self.source, self.tokenizer, self.seed, lane, self.lanes,
                           self._deal, permutations) for lane in self.my_lanes]

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        batches = lane_rows(self._streams(), [self._positions[lane] for lane in self.my_lanes],
                            self.seq_len, self.global_batch // self.lanes, self.micro_batch)
        self._thread = threading.Thread(
            target=_produce,
            args=(batches, self._queue, self._stop),
            name=f"hlat-data-rank{self.dp_rank}",
            daemon=True,
        )
        self._thread.start()

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
        """What the trainer has consumed, small and picklable (ints, strings, lists): where each
        of this rank's lanes stands."""
        return {
            "version": STATE_VERSION,
            "lanes": self.lanes,
            "positions": [[lane, p.epoch, p.doc, p.offset]
                          for lane, p in self._positions.items()],
            "deal_epoch": self._deal.epoch,
            "deal_start": self._deal.start,
            "dp_rank": self.dp_rank,  # who saved it: for messages only
            "dp_size": self.dp_size,
            **self._layout(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume so that the next batch is the one after those consumed when `state` was taken
        (a state of this rank, or of any rank whose lanes include this one's)."""
        self.reshard([state])

    def reshard(self, states: list[dict[str, Any]]) -> str:
        """Continue from the states of the ranks of a checkpoint (`states`: every saving rank's,
        in any order, or at least those holding this rank's lanes), whatever their
        data-parallel degree.

        With as many lanes as the saving run (the trainer: the same train.globalBatch), every
        lane goes on where it stopped: the data is the data of a run that never changed its
        degree. With another number of lanes (the global batch changed), the rest of the
        current epoch, from the earliest document not yet finished by every old lane (the
        "frontier", in the epoch's permutation order), is dealt again round robin to the new
        lanes; later epochs are dealt as usual. No document is skipped, the frontier document
        continues at the token where its old lane stopped, and the documents that old lanes had
        read beyond the frontier are read again. The same states give every rank the same
        deal. Returns which of the two it did, in words.
        """
        if not states:
            raise ValueError("reshard needs the state of every old data-parallel rank")
        for state in states:
            _check_state_layout(state, self._layout())
        lanes = {int(state["lanes"]) for state in states}
        deals = {_deal_of(state) for state in states}
        if len(lanes) > 1 or len(deals) > 1:
            raise UserError("the data loader states come from different runs (their lanes "
                            "differ): restore a checkpoint whose ranks saved together")
        old_lanes, deal = lanes.pop(), deals.pop()
        positions = _lane_positions(states, old_lanes)
        if old_lanes == self.lanes:
            missing = [lane for lane in self.my_lanes if lane not in positions]
            if missing:
                raise UserError(
                    f"the data loader states hold no position for lanes {_span(missing)} of "
                    f"data-parallel rank {self.dp_rank}: the checkpoint misses some ranks' "
                    f"states; restore one that every rank saved"
                )
            self._set(deal, {lane: positions[lane] for lane in self.my_lanes})
            return "every lane goes on where it stopped"
        if len(positions) != old_lanes:
            raise UserError(
                f"the checkpoint's data was read in {old_lanes} lanes, this run reads it in "
                f"{self.lanes} (train.globalBatch changed): re-dealing it needs every old "
                f"rank's state, and {old_lanes - len(positions)} lanes have none"
            )
        permutations = Permutations(self.source.num_documents, self.seed)
        epoch, start, offset = min(
            (p.epoch, LaneStream(self.source, self.tokenizer, self.seed, lane, old_lanes, deal,
                                 permutations).permutation_index(p), p.offset)
            for lane, p in positions.items())
        after = Position(epoch + 1, 0, 0)  # a lane with no document left in this epoch
        self._set(Deal(epoch, start), {
            lane: (Position(epoch, 0, offset if lane == 0 else 0)
                   if start + lane < self.source.num_documents else after)
            for lane in self.my_lanes})
        return (f"{old_lanes} lanes re-dealt to {self.lanes} from the earliest unfinished "
                f"document")

    def _set(self, deal: Deal, positions: dict[int, Position]) -> None:
        self._halt()
        self._deal = deal
        for stream in self._streams():
            _check_position(stream, positions[stream.lane])
        self._positions = positions

    def position_text(self) -> str:
        first = self.my_lanes[0]
        p, d = self._positions[first], self._deal
        return (f"rank {self.dp_rank}/{self.dp_size} reads lanes {_span(list(self.my_lanes))} of "
                f"{self.lanes}; lane {first} at epoch {p.epoch}, document {p.doc} of its share "
                f"dealt from permutation index {d.first(p.epoch)}, token {p.offset}")

    def _layout(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "dataset": self.source.fingerprint,
            "tokenizer": self.tokenizer.fingerprint,
        }


def _check_position(stream: LaneStream, p: Position) -> None:
    docs = stream.docs_of_epoch(p.epoch) if p.epoch >= 0 else np.empty(0)
    if not 0 <= p.doc < len(docs):
        raise UserError(
            f"data loader state points at document {p.doc} of epoch {p.epoch}, but lane "
            f"{stream.lane} has {len(docs)} documents in that epoch: the checkpoint does not "
            f"belong to this dataset; start a new run (another checkpoint.dir)"
        )
    length = len(stream.encode([int(docs[p.doc])])[0])
    if not 0 <= p.offset < length:
        raise UserError(
            f"data loader state points at token {p.offset} of a document that has "
            f"{length} tokens: the dataset or tokenizer changed since the checkpoint; "
            f"start a new run (another checkpoint.dir)"
        )


def _lane_positions(states: list[dict[str, Any]], lanes: int) -> dict[int, Position]:
    """The saved position of every lane some state holds (the ranks of one tensor-parallel
    group hold the same lanes, at the same positions)."""
    positions: dict[int, Position] = {}
    for state in states:
        try:
            entries = [(int(lane), Position(int(e), int(d), int(o)))
                       for lane, e, d, o in state["positions"]]
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"data loader state has no readable lane positions ({err}): the "
                            f"checkpoint is damaged; restore an older one") from err
        for lane, position in entries:
            if not 0 <= lane < lanes or positions.setdefault(lane, position) != position:
                raise UserError(
                    f"data loader states disagree on lane {lane} (of {lanes}): the checkpoint "
                    f"mixes ranks of different runs; restore one that every rank saved"
                )
    return positions


def _span(lanes: list[int]) -> str:
    return f"{lanes[0]}-{lanes[-1]}" if len(lanes) > 1 else str(lanes[0])


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


def rank_lanes(global_batch: int, lanes: int, micro_batch: int, dp_size: int, dp_rank: int
               ) -> range:
    """The lanes data-parallel rank `dp_rank` reads: those of its micro-batches of each step
    (`micro_batch_share`: the first ranks take one more when the degree does not divide the
    micro-batches), as the step's rows are laid out, lane after lane."""
    if global_batch % micro_batch:
        raise UserError(f"train.globalBatch {global_batch} is not divisible by microBatch "
                        f"{micro_batch}")
    if global_batch // micro_batch < dp_size:
        raise UserError(f"train.globalBatch {global_batch} makes {global_batch // micro_batch} "
                        f"micro-batches of {micro_batch}, fewer than the {dp_size} "
                        "data-parallel ranks")
    share = micro_batch_share(global_batch // micro_batch, dp_size, dp_rank)
    rows_per_lane = global_batch // lanes if global_batch % lanes == 0 else 0
    first, end = share.start * micro_batch, share.stop * micro_batch
    if not rows_per_lane or first % rows_per_lane or end % rows_per_lane:
        raise UserError(
            f"the loader's {lanes} lanes must divide the global batch of {global_batch} "
            f"sequences and split over the {dp_size} data-parallel ranks at micro-batch "
            f"boundaries (rank {dp_rank} trains sequences {first} to {end - 1} of a step)"
        )
    return range(first // rows_per_lane, end // rows_per_lane)


_LAYOUT_HINTS = {
    "seed": "data.shuffleSeed",
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
