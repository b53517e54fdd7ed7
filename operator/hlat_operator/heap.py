"""Give memory back: the operator's RSS at 500 jobs was twice its Python objects.

A pass parses JSON lists of pods and Leases (hundreds of KiB for a 64-worker job) in one of six
threads; what it frees stays with the allocator (pymalloc's arenas, glibc's heaps), so the RSS
follows the peak of concurrent passes rather than what is alive. And kopf's aiohttp client
leaves each closed connection's SSL protocol object in a reference cycle until the cyclic
collector's oldest generation runs, which at this allocation rate is rare (641 such objects for
39 open connections at 300 jobs, by tracemalloc). Every `TRIM_SECONDS` a daemon thread runs a
full collection and then glibc's `malloc_trim(0)`, which returns free heap pages to the kernel.
Not on the executor the passes use; where libc has no `malloc_trim` (musl) only the collection
runs. The operator image preloads jemalloc (Dockerfile.operator), which returns its free pages
itself: there the trim has little left to do and the collection is what matters; the trim
serves an operator run without the image (a checkout, the local rig without libjemalloc2).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_SECONDS = 60.0


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    return trim


def give_back() -> bool:
    """One full collection, then the heap's free pages to the kernel; True if trimmed."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def start(every: float = TRIM_SECONDS) -> threading.Event:
    """Run `give_back` every `every` seconds on a daemon thread; set the event to stop it."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            try:
                give_back()
            except Exception:  # never the reason the operator stops
                log.exception("giving memory back failed")

    threading.Thread(target=loop, name="heap-trim", daemon=True).start()
    return stop
