"""The compile cache seeded from a shared copy and published back, on real files and processes.

A node that joins cold takes the gang down (its peers time out in the first collective while it
compiles), so what matters to a user: a node seeded from the shared cache finds every complete
graph there before its workers start; a failed or unfinished compile never spreads; publishing
is atomic (no reader ever sees half an entry), idempotent, and many nodes publishing at once
leave one consistent cache; a stalled or broken shared volume costs time, never the training.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hlat_trainer import compile_cache as cc

VERSION = "neuronxcc-2.21.18209.0+043b1bf7"


def make_entry(cache: Path, name: str, *, neff: bytes = b"neff", done: bool = True,
               log: bool = False, version: str = VERSION) -> Path:
    entry = cache / version / name
    entry.mkdir(parents=True)
    if neff:
        (entry / "model.neff").write_bytes(neff)
    (entry / "model.hlo_module.pb").write_bytes(b"hlo-" + name.encode())
    if done:
        (entry / "model.done").write_text("")
    if log:
        (entry / "model.log").write_text("compilation failed")
    return entry


def listing(cache: Path) -> dict[str, bytes]:
    return {str(p.relative_to(cache)): p.read_bytes()
            for p in sorted(cache.rglob("*")) if p.is_file()}


def test_a_node_seeded_from_the_shared_cache_finds_its_complete_graphs(tmp_path: Path) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    make_entry(shared, "MODULE_1+aa", neff=b"x" * 3_000_000)
    make_entry(shared, "MODULE_2+aa")
    make_entry(shared, "MODULE_3+aa", neff=b"", done=False, log=True)  # a failed compile
    make_entry(shared, "MODULE_4+aa", done=False)  # still compiling somewhere
    (shared / VERSION / f"{cc.TMP_PREFIX}MODULE_5+aa-host-1-abc").mkdir()  # a publisher's copy
    report = cc.CacheSync(str(local), str(shared), say=lambda _: None).seed()
    assert (report.copied, report.skipped, report.errors) == (2, 2, [])
    assert sorted(p.name for p in (local / VERSION).iterdir()) == ["MODULE_1+aa", "MODULE_2+aa"]
    for name in ("MODULE_1+aa", "MODULE_2+aa"):
        assert listing(local / VERSION / name) == listing(shared / VERSION / name)


def test_publishing_is_idempotent(tmp_path: Path) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    make_entry(local, "MODULE_1+aa")
    sync = cc.CacheSync(str(local), str(shared), say=lambda _: None)
    assert sync.publish().copied == 1
    before = {p: p.stat().st_mtime_ns for p in shared.rglob("*")}
    again = sync.publish()
    assert (again.copied, again.present) == (0, 1)
    assert {p: p.stat().st_mtime_ns for p in shared.rglob("*")} == before


def test_only_the_installed_compiler_s_graphs_are_copied_when_there_are(tmp_path: Path) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    make_entry(shared, "MODULE_1+aa", version="neuronxcc-2.20.1.0+abc")
    make_entry(shared, "MODULE_2+aa")
    assert cc.sync(shared, local, version="2.21.18209.0").copied == 1
    assert not (local / "neuronxcc-2.20.1.0+abc").exists()
    assert cc.sync(shared, tmp_path / "other", version=None).copied == 2  # unknown: all


PUBLISHER = """
import sys, pathlib
from hlat_trainer import compile_cache as cc
report = cc.sync(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
print(report.copied, report.present, len(report.errors), flush=True)
"""


def _publish(local: Path, shared: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PUBLISHER, str(local), str(shared)],
                            stdout=subprocess.PIPE, text=True)


def test_a_reader_never_sees_half_an_entry_even_when_the_publisher_is_killed(
        tmp_path: Path) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    sizes = {}
    for i in range(6):
        entry = make_entry(local, f"MODULE_{i}+aa", neff=os.urandom(8_000_000))
        sizes[entry.name] = {p.name: p.stat().st_size for p in entry.iterdir()}
    seen_partial: list[str] = []
    stop = threading.Event()

    def reader() -> None:  # what a seeding node would pick up at any instant
        while not stop.is_set():
            vdir = shared / VERSION
            for entry in (vdir.iterdir() if vdir.exists() else []):
                if entry.name.startswith(cc.ENTRY_PREFIX):
                    got = {p.name: p.stat().st_size for p in entry.iterdir()}
                    if got != sizes[entry.name]:
                        seen_partial.append(f"{entry.name}: {got}")

    watcher = threading.Thread(target=reader)
    watcher.start()
    proc = _publish(local, shared)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(shared.glob(f"*/{cc.TMP_PREFIX}*")):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)  # mid-copy of 48 MB, fsynced file by file
    proc.wait(timeout=30)
    killed_with = list(shared.glob(f"*/{cc.TMP_PREFIX}*"))
    done = _publish(local, shared)  # the next round, e.g. this node's next publish
    out, _ = done.communicate(timeout=120)
    stop.set()
    watcher.join()
    assert out.split()[2] == "0"  # the second round published without errors
    assert seen_partial == []
    assert killed_with, "the publisher was not killed in the middle of a copy"
    assert sorted(p.name for p in (shared / VERSION).iterdir()
                  if p.name.startswith(cc.ENTRY_PREFIX)) == sorted(sizes)
    for name in sizes:
        assert listing(shared / VERSION / name) == listing(local / VERSION / name)
    # the killed copy's temporary directory is invisible as an entry and cleaned once stale
    assert any(p.exists() for p in killed_with)
    cc.remove_stale_tmp(shared / VERSION, older_than=0)
    assert not list((shared / VERSION).glob(f"{cc.TMP_PREFIX}*"))


def _race(local: str, shared: str, go: object) -> None:
    go.wait()  # type: ignore[attr-defined]
    report = cc.sync(Path(local), Path(shared))
    assert report.errors == [], report.errors


def test_many_nodes_publishing_at_once_leave_one_consistent_cache(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    nodes = [tmp_path / f"node{n}" for n in range(4)]
    for n, local in enumerate(nodes):
        for i in range(8):  # every node compiled the same graphs (same bytes) ...
            make_entry(local, f"MODULE_{i}+aa", neff=f"graph {i}".encode() * 100_000)
        make_entry(local, f"MODULE_own{n}+aa")  # ... and one of its own
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_race, args=(str(local), str(shared), go)) for local in nodes]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    names = sorted(p.name for p in (shared / VERSION).iterdir())
    assert names == sorted([f"MODULE_{i}+aa" for i in range(8)]
                           + [f"MODULE_own{n}+aa" for n in range(4)])  # no temporaries left
    for name in names:
        owner = next(local for local in nodes if (local / VERSION / name).exists())
        assert listing(shared / VERSION / name) == listing(owner / VERSION / name)
    new = tmp_path / "spare"
    assert cc.sync(shared, new).copied == 12  # a spare seeded from it is warm for all


def test_a_seed_that_runs_out_of_time_stops_without_half_entries(tmp_path: Path) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    for i in range(40):
        make_entry(shared, f"MODULE_{i}+aa", neff=os.urandom(2_000_000))
    report = cc.bounded_sync(shared, local, budget=0.05)
    assert report.timed_out and report.copied < 40
    time.sleep(1.0)  # the thread stops at its next file and removes its temporary copy
    entries = [p for p in (local / VERSION).iterdir()]
    assert all(p.name.startswith(cc.ENTRY_PREFIX) and cc.complete(p) for p in entries)
    assert "time budget" in report.line("seeded")


def test_a_broken_shared_volume_is_reported_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    local = tmp_path / "local"
    make_entry(local, "MODULE_1+aa")
    lines: list[str] = []
    report = cc.CacheSync(str(local), str(blocker / "cache"), say=lines.append).publish()
    assert report.copied == 0 and report.errors
    assert "error" in lines[0]


@pytest.mark.parametrize("spare", [False, True])
def test_the_periodic_round_publishes_and_a_spare_also_pulls(tmp_path: Path, spare: bool) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    make_entry(local, "MODULE_mine+aa")
    make_entry(shared, "MODULE_theirs+aa")
    sync = cc.CacheSync(str(local), str(shared), pull=spare, interval=0.05, say=lambda _: None)
    sync.start()
    deadline = time.monotonic() + 20
    while not (shared / VERSION / "MODULE_mine+aa").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    sync.stop()
    assert (shared / VERSION / "MODULE_mine+aa" / "model.done").exists()
    assert (local / VERSION / "MODULE_theirs+aa").exists() is spare
