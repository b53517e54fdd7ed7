"""The online packing loader: packing semantics, data-parallel streams, epochs, exact resume."""

from __future__ import annotations

import io
import pickle
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlat_api.spec import micro_batch_share
from hlat_trainer.data import ByteTokenizer, PackedLoader, load_tokenizer, packing
from hlat_trainer.data.digest import MASK, batch_digest, digest_text
from hlat_trainer.errors import UserError

EOS = 256
# 40 distinct documents of 0-29 characters (plus a prefix): many shorter than a row, some longer
DOCS = [f"<{i}>" + "abcdefghijklmnopqrstuvwxyz0123"[: (i * 7) % 30] for i in range(40)]


def write_arrow(path: Path, docs: list[str], *, stream: bool = False) -> Path:
    table = pa.table({"text": pa.array(docs, type=pa.string())})
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=6)
    return path


@pytest.fixture
def data(tmp_path: Path) -> str:
    write_arrow(tmp_path / "part-0.arrow", DOCS[:25])
    write_arrow(tmp_path / "part-1.arrow", DOCS[25:], stream=True)
    return str(tmp_path)


def make(data: str, **kw: Any) -> PackedLoader:
    args: dict[str, Any] = dict(
        text_column="text", seq_len=16, micro_batch=2, dp_rank=0, dp_size=1, seed=7, prefetch=4
    )
    args.update(kw)
    return PackedLoader(data, args.pop("tokenizer", load_tokenizer("bytes")), **args)


def take(loader: PackedLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def token_stream(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The rank's token stream as the batches show it: first input token, then all targets."""
    return [int(batches[0][0][0, 0]), *torch.cat([y for _, y in batches]).flatten().tolist()]


def documents_in(stream: list[int]) -> list[str]:
    """Texts of the complete documents in a stream (those after the first EOS)."""
    text = bytes(t if t != EOS else 0 for t in stream).decode()
    return text.split("\0")[1:-1]


def test_batches_have_the_promised_shape_and_type(data: str) -> None:
    with make(data, seq_len=16, micro_batch=3) as loader:
        inputs, targets = next(loader)
        assert inputs.shape == targets.shape == (3, 16)
        assert inputs.dtype == targets.dtype == torch.int64
        assert loader.tokens_per_batch == 48
        assert loader.vocab_size == 257


def test_rows_carry_leftover_tokens_and_no_token_is_lost(data: str) -> None:
    with make(data, seq_len=16, micro_batch=2) as loader:
        batches = take(loader, 30)
    stream = token_stream(batches)
    rows_x = torch.cat([x for x, _ in batches])
    rows_y = torch.cat([y for _, y in batches])
    for i in range(len(rows_x)):
        # row i is stream[16i : 16i+17]: targets are inputs shifted by one, and the next row
        # starts with the last token of this one (the leftover is carried, nothing cropped)
        assert rows_x[i].tolist() == stream[16 * i : 16 * i + 16]
        assert rows_y[i].tolist() == stream[16 * i + 1 : 16 * i + 17]
        if i + 1 < len(rows_x):
            assert rows_x[i + 1, 0] == rows_y[i, -1]


def test_documents_are_whole_and_joined_by_eos(data: str) -> None:
    with make(data, seq_len=16, micro_batch=2) as loader:
        stream = token_stream(take(loader, 15))  # about 25 documents: within epoch 0
    assert stream.count(EOS) > 15
    docs = documents_in(stream)
    assert all(d in DOCS for d in docs)  # each document intact between two EOS
    assert len(set(docs)) == len(docs)  # within one epoch no document repeats
    assert docs != DOCS[1 : len(docs) + 1]  # shuffled


def first_epoch(data: str, rank: int, size: int, seed: int = 7) -> list[str]:
    """The documents of `rank` in epoch 0: rank r gets every size-th one, ceil((40-r)/size)."""
    with make(data, dp_rank=rank, dp_size=size, seed=seed) as loader:
        stream = token_stream(take(loader, 40))
    docs = bytes(t if t != EOS else 0 for t in stream).decode().split("\0")
    return docs[: -(-(len(DOCS) - rank) // size)]


def test_ranks_get_disjoint_streams_that_cover_each_document_once_per_epoch(data: str) -> None:
    per_rank = [first_epoch(data, r, 3) for r in range(3)]
    counts = Counter(doc for docs in per_rank for doc in docs)
    assert set(counts) == set(DOCS)
    assert set(counts.values()) == {1}


def test_seed_changes_the_order(data: str) -> None:
    assert first_epoch(data, 0, 1, seed=1) != first_epoch(data, 0, 1, seed=2)
    assert first_epoch(data, 0, 1, seed=1) == first_epoch(data, 0, 1, seed=1)


def test_epochs_continue_with_a_new_permutation(data: str) -> None:
    with make(data, dp_rank=1, dp_size=2, seq_len=32, micro_batch=4) as loader:
        stream = token_stream(take(loader, 40))
        assert loader.epoch >= 2
    docs = bytes(t if t != EOS else 0 for t in stream).decode().split("\0")
    epoch0, epoch1 = docs[:20], docs[20:40]
    assert sorted(epoch0) != sorted(DOCS)  # half of them
    assert epoch0 != epoch1
    assert len(set(epoch0) | set(epoch1)) > 20  # another split of the documents between ranks


def lane_position(state: dict[str, Any], lane: int = 0) -> tuple[int, int, int]:
    """(epoch, document, offset) of a lane in a loader's state."""
    return next(tuple(p[1:]) for p in state["positions"] if p[0] == lane)


def resume_cases(data: str) -> dict[str, int]:
    """How many batches to consume before saving, for each kind of resume point."""
    with make(data, micro_batch=1, seq_len=8) as loader:
        states = [loader.state_dict()] + [
            (next(loader), loader.state_dict())[1] for _ in range(120)
        ]
    where = [lane_position(s) for s in states]
    doc_start = next(k for k, (_, _, o) in enumerate(where) if k > 0 and o == 0)
    mid_doc = next(k for k, (_, _, o) in enumerate(where) if o > 0)
    last_of_epoch = max(k for k, (e, _, _) in enumerate(where) if e == 0)
    new_epoch = last_of_epoch + 1
    assert where[new_epoch][0] == 1
    return {
        "start": 0,
        "doc_start": doc_start,
        "mid_doc": mid_doc,
        "before_epoch_end": last_of_epoch - 1,
        "new_epoch": new_epoch,
    }


@pytest.mark.parametrize("case", ["start", "doc_start", "mid_doc", "before_epoch_end", "new_epoch"])
def test_resume_gives_exactly_the_next_batches(data: str, case: str, tmp_path: Path) -> None:
    k = resume_cases(data)[case]
    with make(data, micro_batch=1, seq_len=8) as loader:
        expected = take(loader, k + 12)
    with make(data, micro_batch=1, seq_len=8, prefetch=6) as first:
        assert same(take(first, k), expected[:k])
        if k:
            _wait_until_prefetched(first)  # the thread has run ahead of what was consumed
        state = first.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
    buf.seek(0)
    with make(data, micro_batch=1, seq_len=8, prefetch=2) as second:
        second.load_state_dict(torch.load(buf, weights_only=True))
        got = take(second, 12)
    assert same(got, expected[k:])


def same(
    a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, bx) and torch.equal(y, by) for (x, y), (bx, by) in zip(a, b, strict=True)
    )


def _wait_until_prefetched(loader: PackedLoader) -> None:
    deadline = time.monotonic() + 5
    while not loader._queue.full() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader._queue.full()


def test_resume_in_the_same_loader_rewinds(data: str) -> None:
    with make(data) as loader:
        take(loader, 3)
        state = loader.state_dict()
        after = take(loader, 5)
        take(loader, 10)
        loader.load_state_dict(state)
        again = take(loader, 5)
    assert same(after, again)


def test_state_is_small_and_plain(data: str) -> None:
    with make(data, seq_len=4096, micro_batch=1) as loader:
        next(loader)
        state = loader.state_dict()
    assert len(pickle.dumps(state)) < 1000
    assert {"positions", "lanes", "seed", "seq_len", "dataset", "tokenizer"} <= set(state)
    assert [p[0] for p in state["positions"]] == [0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 8}, r"different data\.shuffleSeed: seed was 7, now 8"),
        ({"seq_len": 32}, r"different data\.seqLen: seq_len was 16, now 32"),
    ],
)
def test_state_from_another_layout_is_refused(
    data: str, change: dict[str, Any], message: str
) -> None:
    with make(data) as loader:
        next(loader)
        state = loader.state_dict()
    with make(data, **change) as other, pytest.raises(UserError, match=message):
        other.load_state_dict(state)


def test_state_from_another_dataset_is_refused(data: str, tmp_path: Path) -> None:
    with make(data) as loader:
        state = loader.state_dict()
    other_data = write_arrow(tmp_path / "other.arrow", DOCS[:30])
    with (
        make(str(other_data)) as other,
        pytest.raises(
            UserError,
            match=r"different dataset \(data\.path.*part-0\.arrow', 25\].*other\.arrow', 30",
        ),
    ):
        other.load_state_dict(state)


def test_state_from_another_tokenizer_is_refused(data: str) -> None:
    class Other(ByteTokenizer):
        fingerprint = "other"

    with make(data) as loader:
        state = loader.state_dict()
    with (
        make(data, tokenizer=Other()) as other,
        pytest.raises(UserError, match=r"different tokenizer \(data\.tokenizer\)"),
    ):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("doc", 10_000, r"points at document 10000 of epoch 0, but lane 0 has 40 documents"),
        ("offset", 10_000, r"points at token 10000 of a document that has \d+ tokens"),
        ("lane", 3, r"states disagree on lane 3 \(of 1\)"),
        ("positions", None, r"no readable lane positions"),
        ("version", 99, r"version 99, this trainer reads version 2"),
    ],
)
def test_corrupt_state_is_refused(data: str, field: str, value: Any, message: str) -> None:
    with make(data) as loader:
        state = loader.state_dict()
        column = {"lane": 0, "doc": 2, "offset": 3}.get(field)
        if column is None:
            state[field] = value
        else:
            state["positions"][0][column] = value
        with pytest.raises(UserError, match=message):
            loader.load_state_dict(state)


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hlat-data")]


def test_background_thread_is_a_daemon_and_close_stops_it(data: str) -> None:
    loader = make(data, prefetch=1)
    next(loader)
    assert [t.daemon for t in _loader_threads()] == [True]
    loader.close()
    assert _loader_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


class SlowTokenizer(ByteTokenizer):
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        time.sleep(0.05)
        if any("boom" in t for t in texts):
            raise ValueError("tokenizer exploded")
        return super().encode_batch(texts)


def test_wait_seconds_counts_time_spent_waiting_for_data(data: str) -> None:
    with make(data, tokenizer=SlowTokenizer()) as loader:
        assert loader.wait_seconds == 0
        next(loader)
        assert loader.wait_seconds >= 0.04


def test_errors_in_the_background_thread_reach_the_consumer(tmp_path: Path) -> None:
    path = write_arrow(tmp_path / "d.arrow", ["fine", "boom"])
    with (
        make(str(path), tokenizer=SlowTokenizer()) as loader,
        pytest.raises(ValueError, match="tokenizer exploded"),
    ):
        next(loader)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"seq_len": 0}, r"data\.seqLen must be at least 1"),
        ({"micro_batch": 0}, r"train\.microBatch must be at least 1"),
        ({"dp_rank": 2, "dp_size": 2}, r"rank 2 is not in \[0, 2\)"),
        ({"seed": -1}, r"data\.shuffleSeed must be >= 0"),
    ],
)
def test_bad_arguments(data: str, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        make(data, **kw)


# --- resuming under another data-parallel degree ------------------------------------------------


def doc_ids(stream: list[int]) -> set[int]:
    """Ids of the documents whose "<i>" prefix appears in a token stream."""
    text = bytes(t if t != EOS else 0 for t in stream).decode()
    return {int(m) for m in re.findall(r"<(\d+)>", text)}


@pytest.mark.parametrize(("old_size", "new_size"), [(3, 2), (2, 3), (2, 1)])
def test_reshard_deals_the_rest_of_the_epoch_with_nothing_skipped(
    data: str, old_size: int, new_size: int
) -> None:
    """Old ranks stop at different points of epoch 0; the new ranks continue from the earliest
    unfinished document: every document of the epoch is read, the frontier document goes on at
    the token where it stopped, and only documents old ranks had read past it are read again."""
    kw: dict[str, Any] = dict(seq_len=8, micro_batch=1)
    old_streams, states, old_next = [], [], []
    for rank in range(old_size):
        with make(data, dp_rank=rank, dp_size=old_size, **kw) as old:
            old_streams.append(token_stream(take(old, 3 + 2 * rank)))
            states.append(old.state_dict())
            assert old.epoch == 0
            old_next.append(token_stream(take(old, 6))[1:])  # what it would have read next
    frontier = min(range(old_size), key=lambda r: lane_position(states[r], r)[1] * old_size + r)
    new_streams = []
    for rank in range(new_size):
        with make(data, dp_rank=rank, dp_size=new_size, **kw) as new:
            new.reshard(states)
            batches = []
            while new.epoch == 0:  # the batches that start in epoch 0
                batches.append(next(new))
            new_streams.append(token_stream(batches))
    # new rank 0 goes on with the frontier document's next token, to the document's end
    rest = old_next[frontier][: old_next[frontier].index(EOS) + 1]
    assert new_streams[0][1 : 1 + len(rest)] == rest
    joined = old_streams[frontier] + new_streams[0][1:]
    old_ids = set().union(*(doc_ids(s) for s in old_streams))
    new_ids = set().union(doc_ids(joined), *(doc_ids(s) for s in new_streams[1:]))
    assert old_ids | new_ids == set(range(len(DOCS))), "no document of the epoch is skipped"
    docs = [lane_position(s, r)[1] for r, s in enumerate(states)]
    spread = max(docs) - min(docs) + 1
    repeated = (old_ids & new_ids) - doc_ids(old_streams[frontier])
    # at most what old ranks read past the frontier, plus the epoch-1 tail of each last batch
    assert len(repeated) <= spread * old_size + 2 * new_size, repeated


def test_reshard_is_the_same_on_every_new_rank_and_checks_the_states(data: str) -> None:
    states = []
    for rank in range(2):
        with make(data, dp_rank=rank, dp_size=2) as old:
            take(old, 2 + rank)
            states.append(old.state_dict())
    with make(data, dp_rank=0, dp_size=1) as a, make(data, dp_rank=0, dp_size=1) as b:
        a.reshard(states)
        b.reshard(states[::-1])  # the states say which lanes they hold: any order
        first = take(a, 5)
        assert same(first, take(b, 5))
        # the re-dealt position is a checkpointable state like any other
        state = a.state_dict()
        expected = take(a, 3)
    with make(data, dp_rank=0, dp_size=1) as c:
        c.load_state_dict(state)
        assert same(take(c, 3), expected)
    with make(data, dp_rank=0, dp_size=1, seed=8) as d, pytest.raises(UserError, match="seed"):
        d.reshard(states)
    with make(data, dp_rank=0, dp_size=1) as e, pytest.raises(
            UserError, match=r"read in 2 lanes, this run reads it in 1 .*1 lanes have none"):
        e.reshard(states[:1])


# --- one lane per sequence (the trainer's): the same global batches at every dp degree --------


def global_batches(data: str, batch: int, micro_batch: int,
                   schedule: list[tuple[int, int]]) -> list[list[list[int]]]:
    """The rows (inputs then the last target) of each step's global batch, ranks in order, for
    a run that trains `steps` steps on `size` data-parallel ranks for each (size, steps) of
    `schedule`, every change of size a resume from the ranks' states."""
    steps: list[list[list[int]]] = []
    states: list[dict[str, Any]] = []
    for size, count in schedule:
        loaders = [make(data, dp_rank=r, dp_size=size, micro_batch=micro_batch, seq_len=8,
                        global_batch=batch, lanes=batch, prefetch=2) for r in range(size)]
        try:
            for loader in loaders:
                if states:
                    assert loader.reshard(states) == "every lane goes on where it stopped"
            for _ in range(count):
                rows = []
                for rank, loader in enumerate(loaders):  # uneven: the first ranks one more
                    for _ in micro_batch_share(batch // micro_batch, size, rank):
                        x, y = next(loader)
                        rows += [[*a.tolist(), int(b[-1])] for a, b in zip(x, y, strict=True)]
                steps.append(rows)
            states = [loader.state_dict() for loader in loaders]
        finally:
            for loader in loaders:
                loader.close()
    return steps


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def elastic_runs(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int]]]:
    batch = draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
    micro_batch = draw(st.sampled_from(divisors(batch)))
    sizes = list(range(1, batch // micro_batch + 1))  # any degree: uneven where it must
    schedule = draw(st.lists(st.tuples(st.sampled_from(sizes), st.integers(1, 9)),
                             min_size=2, max_size=4))
    return batch, micro_batch, schedule


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=elastic_runs())
def test_every_step_s_global_batch_is_the_same_whatever_the_sizes_it_ran_at(
        data: str, run: tuple[int, int, list[tuple[int, int]]]) -> None:
    """Resized any number of times, at any step, to any data-parallel degree the global batch
    allows (one that does not divide its micro-batches included: some ranks then read one
    micro-batch more), a run reads exactly the rows a run that never changed its degree reads,
    step by step: no row skipped, none repeated, none moved to another step."""
    batch, micro_batch, schedule = run
    total = sum(count for _, count in schedule)
    straight = global_batches(data, batch, micro_batch, [(schedule[0][0], total)])
    assert global_batches(data, batch, micro_batch, schedule) == straight


def test_one_lane_per_sequence_reads_each_document_once_per_epoch(data: str) -> None:
    """Four lanes, each a row of every step: lane j's rows are every 4th row; each lane's
    first 10 documents (its share of epoch 0's 40) are whole, and together they are every
    document exactly once."""
    with make(data, micro_batch=1, seq_len=8, global_batch=4, lanes=4) as loader:
        rows = take(loader, 4 * 60)
    docs = []
    for lane in range(4):
        stream = token_stream(rows[lane::4])
        docs += bytes(t if t != EOS else 0 for t in stream).decode().split("\0")[:10]
    assert Counter(docs) == Counter(DOCS)


def test_a_resume_that_misses_a_rank_s_state_says_so(data: str) -> None:
    kw: dict[str, Any] = dict(micro_batch=1, seq_len=8, global_batch=4, lanes=4)
    with make(data, dp_size=2, dp_rank=1, **kw) as saved:
        state = saved.state_dict()
    with make(data, dp_size=1, dp_rank=0, **kw) as one, pytest.raises(
            UserError, match=r"no position for lanes 0-1 of data-parallel rank 0: the "
                             r"checkpoint misses some ranks' states"):
        one.reshard([state])


def test_the_digest_is_the_same_for_the_same_sequences_in_any_split_and_order(data: str) -> None:
    """A step's digest is the sum of its micro-batches' in any order and split; a token moved
    within a sequence, or changed, changes it."""
    with make(data, micro_batch=4, seq_len=8) as loader:
        x, y = next(loader)
    whole = batch_digest(x, y)
    halves = (batch_digest(x[:1], y[:1]) + batch_digest(x[1:], y[1:])) & MASK
    assert halves == whole == batch_digest(x[[3, 1, 0, 2]], y[[3, 1, 0, 2]])
    swapped_x, swapped_y = x.clone(), y.clone()
    swapped_x[0, [1, 2]] = x[0, [2, 1]]
    swapped_y[0, [0, 1]] = y[0, [1, 0]]
    assert int(x[0, 1]) == int(x[0, 2]) or batch_digest(swapped_x, swapped_y) != whole
    changed = y.clone()
    changed[2, -1] += 1
    assert batch_digest(x, changed) != whole
    assert len(digest_text(whole)) == 16


class CountingTokenizer:
    """The byte tokenizer, recording how many documents each `encode_batch` call got."""

    def __init__(self) -> None:
        self.inner = load_tokenizer("bytes")
        self.calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.calls.append(len(texts))
        return self.inner.encode_batch(texts)


def test_a_start_tokenizes_one_document_first_then_groups_that_double(
        data: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first rows after a start (a fresh trainer, a resume) wait for one document's tokens,
    not a whole group's; later calls double up to ENCODE_GROUP. The batches are the same as
    with groups of one."""
    monkeypatch.setattr(packing, "ENCODE_GROUP", 8)
    tok = CountingTokenizer()
    with make(data, tokenizer=tok, micro_batch=1, seq_len=8, prefetch=1) as loader:
        got = take(loader, 60)
        state = loader.state_dict()
    assert tok.calls[:5] == [1, 2, 4, 8, 8], tok.calls
    tok.calls.clear()
    with make(data, tokenizer=tok, micro_batch=1, seq_len=8, prefetch=1) as resumed:
        resumed.load_state_dict(state)
        take(resumed, 1)
    assert tok.calls[0] == 1, tok.calls
    monkeypatch.setattr(packing, "ENCODE_GROUP", 1)
    with make(data, micro_batch=1, seq_len=8) as ones:
        assert same(take(ones, 60), got)
