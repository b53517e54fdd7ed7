"""bench/bench_operator_scale.py's memory trace: it says when the operator's peak came."""

from __future__ import annotations

import os
import time

from bench_operator_scale import RssTrace


def test_the_rss_trace_finds_when_the_peak_came() -> None:
    """A process that holds 300 MiB for 0.4 s in the middle of its trace: the highest
    sample is inside that hold, and 300 MiB above the start."""
    trace = RssTrace(os.getpid(), every=0.02)
    time.sleep(0.3)
    held_from = time.time() - trace.began
    block = b"\x01" * (300 * 2**20)  # written: resident
    time.sleep(0.4)
    held_to = time.time() - trace.began
    del block
    time.sleep(0.3)
    peak_at, peak_mib = trace.stop()
    assert held_from <= peak_at <= held_to
    assert peak_mib - trace.samples[0][1] > 250
