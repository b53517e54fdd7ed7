"""Fail-slow nodes: which node of a gang is slower than the others, by how much, since when.

Synchronous data parallel runs at the pace of its slowest rank, so a slow node shows in every
rank's step time alike; what tells it apart is each rank's own time a step, outside its waits on
the others: its compute (`Heartbeat.compute_seconds`), its wait for its own data loader
(`Heartbeat.data_wait_seconds`) and its host work (`Heartbeat.host_seconds`: the optimizer
update, clipping, moving batches), each the median of the worker's recent steps. A slow chip
computes longer, a slow data path (a failing disk) waits longer for its batches, a slow host (a
noisy neighbour, a throttled CPU) updates longer; the healthy nodes wait for it in the
collectives (the gradient sync, ZeRO-1's broadcast of the updated shards, the loss's
all-reduce), which the trainer counts as sync, never as their own time. A node is scored
against the median of the *other* nodes (relative to its gang, not to an absolute figure: a
bigger model or a busier host moves every node alike), and flagged only once it has stayed
over the threshold for the window (a garbage collection, a save's copy on one node, is not a
straggler). A dip back under the
threshold no longer than `grace` (the operator passes two heartbeat periods: one renewal's
medians) does not start the window over: each median is over a few steps, and one of a
healthy node's slow steps moving the baseline for one renewal hid a 30%-slow node for 64 s
where the window is 30. Nor does such a dip clear a node already flagged (a node hovering at
the threshold raised and cleared the flag, with a Warning event each time, at every renewal).
Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from hlat_operator.observe import format_time

GRACE_PERIODS = 2
"""A dip under the threshold seen in no more than this many heartbeat periods keeps a node's
spell over it (one renewal's medians, and the next renewal's arriving a pass late)."""


@dataclass(frozen=True)
class Slow:
    node: str
    ratio: float
    """Its own time a step (compute, data wait, host work) over the median of the other
    nodes'."""
    since: datetime
    """Since when it has been over the threshold, with no break longer than the grace."""


@dataclass(frozen=True)
class Spell:
    """A node's time over the threshold: since when, and, while it dips back under, since
    when it has been under (None while over)."""

    since: datetime
    under: datetime | None = None


def slowdowns(compute: Mapping[str, float]) -> dict[str, float]:
    """Each node's own seconds a step (compute, data wait, host work) over the median of the
    other nodes' (1: as fast as its gang; 1.4: 40% slower). Empty when fewer than two nodes
    report: a single node has nothing to be compared with."""
    if len(compute) < 2:
        return {}
    out = {}
    for node, seconds in compute.items():
        base = statistics.median(v for n, v in compute.items() if n != node)
        if base > 0:
            out[node] = seconds / base
    return out


def share_lost(compute: Mapping[str, float], ratios: Mapping[str, float], threshold: float,
               step_seconds: float | None) -> float:
    """The share of each step the slowest node costs the gang while it is over the threshold:
    its compute time less the median of the others' (what they wait for it), over the step
    time; 0 while every node is within the threshold (noise is no straggler's badput)."""
    if not ratios or not step_seconds or step_seconds <= 0:
        return 0.0
    node = max(ratios, key=lambda n: ratios[n])
    if ratios[node] <= 1 + threshold:
        return 0.0
    return min(1.0, compute[node] * (1 - 1 / ratios[node]) / step_seconds)


def restart_pays(lost_seconds: float, restart_seconds: float) -> bool:
    """Without a spare, whether to restart off a slow node now: once the time it has cost the
    job so far exceeds what a restart costs (the ski-rental rule Falcon escalates by: the
    length of a fail-slow is not known in advance, and paying for the move only once its cost
    has been lost bounds the loss to twice the best choice's)."""
    return restart_seconds >= 0 and lost_seconds > restart_seconds


def judge(ratios: Mapping[str, float], spells: Mapping[str, Spell], now: datetime,
          threshold: float, window: float, grace: float) -> tuple[list[Slow], dict[str, Spell]]:
    """The nodes flagged now (slowest first: over `1 + threshold` for the window) and each
    node's spell over it. A node seen over for the first time starts one now; one back under
    (or not reporting) keeps its spell, marked under, for `grace` seconds; under for longer, it
    leaves the map and its next time over starts afresh. A node flagged before it dipped stays
    flagged through the grace (with its ratio now, under the threshold: a node hovering at the
    threshold is one straggler, not a flag raised and cleared at every renewal); one that
    dipped before its window was up is not flagged while under, and is as soon as it is back
    over."""
    out = {}
    for node in sorted(set(ratios) | set(spells)):
        spell, ratio = spells.get(node), ratios.get(node)
        if ratio is not None and ratio > 1 + threshold:
            out[node] = Spell(spell.since if spell is not None else now)
        elif spell is not None:
            under = spell.under or now
            if (now - under).total_seconds() <= grace:
                out[node] = Spell(spell.since, under)
    flagged = [Slow(node, ratios[node], spell.since) for node, spell in out.items()
               if node in ratios and ((spell.under or now) - spell.since).total_seconds()
               >= window]
    return sorted(flagged, key=lambda s: (-s.ratio, s.node)), out


def describe(flagged: list[Slow], threshold: float) -> str:
    """The Straggler condition's message (and its event's): the slowest node first."""
    slow, rest = flagged[0], flagged[1:]
    others = "".join(f"; node {s.node} {s.ratio:.2f}x" for s in rest)
    return (f"node {slow.node} takes {slow.ratio:.2f}x the median of the other nodes' time a "
            f"step, compute, data wait and host work (threshold {1 + threshold:.2f}x) since "
            f"{format_time(slow.since)}{others}; it holds back every step")
