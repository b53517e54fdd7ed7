"""The Neuron compile cache: node-local while training, seeded from and published to a shared copy.

Why: a node that joins with a cold cache (a replacement, a spare, the first run on new nodes)
compiles every graph for many minutes while its peers wait in the first collective; a shared
cache on the job's volume lets it start warm. The compiler itself must not use the shared
volume: the paper (section "Neuron Persistent Cache on Local Worker") saw communication
timeouts with the cache on FSx, every device reading it. So, as the paper's scripts do
(awslabs/HLAT 70b/compile_and_run.sh:153-172: copy the shared cache into a local one before
every run), `hlat-launch` copies the shared graphs into `spec.neuron.cacheDir` before the
workers start (`CacheSync.seed`), and publishes the graphs this node compiled back
(`CacheSync.publish`) every `PUBLISH_SECONDS` while it runs and once when its workers end. A
spare pod also pulls each round, so it is warm when it takes a rank.

Layout (the compiler wrapper's, neuron-caching.rst:77): `<cache>/neuronxcc-<version>/
MODULE_<graph hash>+<flags hash>/` holding `model.neff`, and `model.done` once complete. An
entry is copied only when complete: `model.neff` and `model.done` both there (how
huggingface/optimum-neuron optimum/neuron/cache/cleanup.py `_classify_entry` tells a success
from a failed compile, `model.log` without `model.neff`, or one in progress, a `*.lock`). A
failed entry is never published: every node would skip that graph's compilation and fail
(neuron-caching.rst:126-133).

Atomic and safe with many writers: an entry is copied (each file fsynced) under a temporary
name in the destination's version directory, then renamed to its final name. rename(2) of a
directory onto an existing non-empty one fails, so of two nodes publishing the same entry one
wins and the other drops its copy; readers never see a half-written entry (they skip names
that are not `MODULE_*`). A publisher killed mid-copy leaves only a temporary directory, removed
by the next sync once older than `STALE_TMP_SECONDS`.

Bounded and never fatal: every sync has a time budget (checked between files), runs in a
thread the caller stops waiting for at the budget, and reports what it did and what failed;
errors are reported, training goes on (at worst the node compiles what it lacks).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Final

VERSION_PREFIX: Final = "neuronxcc-"
ENTRY_PREFIX: Final = "MODULE_"
COMPLETE_FILES: Final = ("model.neff", "model.done")
TMP_PREFIX: Final = ".hlat-tmp-"
STALE_TMP_SECONDS: Final = 3600.0
SEED_SECONDS: Final = 600.0
"""Budget of the copy before the workers start: what is not copied by then is compiled."""
PUBLISH_SECONDS: Final = 300.0
"""How often a running node publishes its new graphs (and a spare pulls)."""
FINAL_SECONDS: Final = 60.0
"""Budget of the publish when the node's workers have ended."""


@dataclass
class SyncReport:
    """What one sync did; `errors` are one line each."""

    copied: int = 0
    present: int = 0
    skipped: int = 0
    """Entries not complete in the source (failed, in progress): never copied."""
    errors: list[str] = field(default_factory=list)
    timed_out: bool = False
    seconds: float = 0.0

    def line(self, what: str) -> str:
        text = (f"compile cache: {what}: {self.copied} graph(s) copied, {self.present} already "
                f"there, {self.skipped} incomplete skipped, in {self.seconds:.1f}s")
        if self.timed_out:
            text += " (stopped at its time budget; the rest is compiled where missing)"
        if self.errors:
            text += f"; {len(self.errors)} error(s), first: {self.errors[0]}"
        return text


def complete(entry: Path) -> bool:
    return all((entry / name).is_file() for name in COMPLETE_FILES)


def compiler_version() -> str | None:
    """The installed neuronx-cc's version without its local part (`2.21.18209.0`), or None."""
    try:
        return metadata.version("neuronx-cc").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def version_dirs(root: Path, version: str | None) -> list[Path]:
    """The compiler-version directories worth copying: the installed compiler's when it has
    one there (the others are never read by it), else all."""
    try:
        found = sorted(p for p in root.iterdir()
                       if p.is_dir() and p.name.startswith(VERSION_PREFIX))
    except FileNotFoundError:
        return []
    if version is not None:
        mine = [p for p in found if p.name.startswith(f"{VERSION_PREFIX}{version}")]
        if mine:
            return mine
    return found


def _entries(version_dir: Path) -> Iterator[Path]:
    for entry in sorted(version_dir.iterdir()):
        if entry.name.startswith(ENTRY_PREFIX) and entry.is_dir():
            yield entry


def _copy_file(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        fout.flush()
        os.fsync(fout.fileno())
    shutil.copystat(src, dst)


def copy_entry(entry: Path, dest_version_dir: Path, stop: threading.Event) -> bool:
    """Copy one complete entry into `dest_version_dir` atomically: True if this call put it
    there, False if it already was (or another writer won the race, or `stop` was set)."""
    final = dest_version_dir / entry.name
    if final.exists():
        return False
    tmp = dest_version_dir / (f"{TMP_PREFIX}{entry.name}-{socket.gethostname()}-{os.getpid()}-"
                              f"{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        for src in sorted(entry.iterdir()):
            if stop.is_set():
                return False
            if src.is_file() and not src.name.endswith(".lock"):
                _copy_file(src, tmp / src.name)
        if stop.is_set() or final.exists():
            return False
        try:
            os.rename(tmp, final)
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False  # another node published it first: theirs is as good
            raise
        return True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_tmp(version_dir: Path, older_than: float = STALE_TMP_SECONDS) -> None:
    """Temporary copies a killed writer left (never visible as entries: only their space)."""
    now = time.time()
    for tmp in version_dir.glob(f"{TMP_PREFIX}*"):
        try:
            if now - tmp.stat().st_mtime > older_than:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass


def sync(src: Path, dst: Path, *, stop: threading.Event | None = None,
         version: str | None = None, report: SyncReport | None = None) -> SyncReport:
    """Copy every complete entry of `src` that `dst` lacks; errors go to the report."""
    stop = stop or threading.Event()
    report = report if report is not None else SyncReport()
    began = time.monotonic()
    try:
        for vdir in version_dirs(src, version):
            target = dst / vdir.name
            target.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(target)
            for entry in _entries(vdir):
                if stop.is_set():
                    report.timed_out = True
                    return report
                if not complete(entry):
                    report.skipped += 1
                    continue
                try:
                    if copy_entry(entry, target, stop):
                        report.copied += 1
                    elif not stop.is_set():
                        report.present += 1
                except OSError as err:
                    report.errors.append(f"{entry.name}: {err}")
    except OSError as err:
        report.errors.append(str(err))
    finally:
        report.seconds = time.monotonic() - began
    report.timed_out = report.timed_out or stop.is_set()
    return report


def bounded_sync(src: Path, dst: Path, budget: float, version: str | None = None) -> SyncReport:
    """`sync` in a thread, waited for at most `budget` seconds; then it is told to stop (at the
    next file) and the report says so. A stalled file system cannot hold the caller."""
    stop, report = threading.Event(), SyncReport()
    worker = threading.Thread(target=sync, args=(src, dst),
                              kwargs={"stop": stop, "version": version, "report": report},
                              name="compile-cache-sync", daemon=True)
    began = time.monotonic()
    worker.start()
    worker.join(budget)
    if worker.is_alive():
        stop.set()
        report.timed_out = True
        report.seconds = time.monotonic() - began
    return report


class CacheSync:
    """The launcher's side: seed before the workers start, publish while and after they run."""

    def __init__(self, local: str, shared: str, *, pull: bool = False,
                 interval: float = PUBLISH_SECONDS, say: Callable[[str], None] = print) -> None:
        self.local, self.shared = Path(local), Path(shared)
        self.pull, self.interval, self.say = pull, interval, say
        self.version = compiler_version()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def seed(self, budget: float = SEED_SECONDS) -> SyncReport:
        report = bounded_sync(self.shared, self.local, budget, self.version)
        self.say(report.line(f"seeded {self.local} from {self.shared}"))
        return report

    def publish(self, budget: float = FINAL_SECONDS) -> SyncReport:
        report = bounded_sync(self.local, self.shared, budget, self.version)
        if report.copied or report.errors or report.timed_out:
            self.say(report.line(f"published {self.local} to {self.shared}"))
        return report

    def start(self) -> None:
        """Publish (and, on a spare, pull) every `interval` seconds until `stop`."""
        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.publish(self.interval)
                if self.pull:
                    self.seed(self.interval)

        self._thread = threading.Thread(target=loop, name="compile-cache", daemon=True)
        self._thread.start()

    def stop(self, budget: float = FINAL_SECONDS) -> SyncReport:
        """End the periodic rounds and publish once more (the workers have ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(budget)
        return self.publish(budget)
