"""`heap`: the operator gives freed memory back (its effect on RSS is measured by
bench_operator_scale, not here)."""

from __future__ import annotations

import gc
import os
import time

from hlat_operator import heap


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_freed_memory_goes_back_to_the_kernel_and_cycles_are_collected() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle, as kopf's closed SSL protocols are

    gc.disable()
    try:
        cycles = [Node() for _ in range(1000)]
        del cycles
        # a burst of JSON-sized blocks (glibc's heap, not pymalloc's arenas nor mmap), every
        # hundredth kept: the heap cannot shrink from its top, only trimming frees its pages
        burst = [bytes(4000) + str(i).encode() for i in range(20_000)]
        kept = burst[::100]
        del burst
        before = _rss_kib()
        assert heap.give_back() is True  # glibc here
        after = _rss_kib()
        assert not any(type(o) is Node for o in gc.get_objects())  # no isinstance: it wakes
        # deprecated module attributes of whatever else is alive (torch warns)
    finally:
        gc.enable()
    assert after < before - 40_000, (before, after)  # most of the ~80 MB freed
    assert len(kept) == 200


def test_the_trim_thread_runs_until_stopped() -> None:
    stop = heap.start(every=0.05)
    time.sleep(0.2)
    stop.set()
