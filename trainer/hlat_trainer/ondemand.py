"""Checkpoints on request: the operator asks a running gang for a checkpoint now.

When Kueue preempts a job, or a user suspends a running one, the work since the last periodic
checkpoint (up to an interval: hours of a 64-node cluster at the paper's scale) would be
trained again after the job resumes. Instead the operator annotates the attempt's worker Leases
(`hlat_api.heartbeat.CHECKPOINT_REQUEST`) and waits, bounded, for a checkpoint at or after the
step it asked at before it stops the pods.

Only node local rank 0 reads the Lease (its heartbeat watches it and sees the annotation as it
is written, and again in each renewal's answer), and it sees it at a different step on each node; a checkpoint is a collective, so every
rank must save at the same step. Every rank therefore contributes the newest request it has
seen to a MAX all-reduce once a step, on the host's gloo group (never in the device's graph: on
XLA a device value read back would cut the overlap of tracing and execution). The reduction
is asynchronous: started after step k, waited for after step k+1, so a gang of thousands of
ranks does not wait for it; the agreed value is the same on every rank at step k+1, which is
the step they all save. A request is acted on once: a value no larger than one already acted on
is old news. A single process needs no agreement and acts at the step it sees the request.

Off (no collective at all) when the trainer is not run by the operator (no heartbeat Lease in
its environment, the same on every rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class CheckpointRequests:
    def __init__(self, seen: Callable[[], int] | None,
                 group: dist.ProcessGroup | None) -> None:
        """`seen`: the newest request this rank knows of (0: none), or None when requests are
        off; `group`: the host collective group (None: a single process)."""
        self._seen, self._group = seen, group
        self._acted = 0
        self._flight: tuple[torch.Tensor, dist.Work] | None = None

    def due(self) -> int | None:
        """Called by every rank after every step, in the same order as its other host
        collectives: the request to checkpoint this step for (the same on every rank), or None."""
        if self._seen is None:
            return None
        agreed = self._collect()
        if self._group is None:
            agreed = self._seen()
        else:
            value = torch.tensor([self._seen()], dtype=torch.int64)
            work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            assert work is not None
            self._flight = (value, work)
        if agreed <= self._acted:
            return None
        self._acted = agreed
        return agreed

    def _collect(self) -> int:
        if self._flight is None:
            return 0
        value, work = self._flight
        self._flight = None
        work.wait()
        return int(value.item())

    def close(self) -> None:
        """Wait for the reduction in flight (every rank started it): the group may then go."""
        self._collect()
