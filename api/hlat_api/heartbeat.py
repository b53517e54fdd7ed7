"""The heartbeat protocol: each node's local rank 0 renews a coordination.k8s.io Lease.

Who writes: the trainer (one Lease per worker pod, named by `lease_name`). Who reads: the
operator, for liveness and progress. Two clocks, both the worker's: `renewTime` says the
process is alive (a background thread renews it), `progress_time` says the training loop moves
(set whenever the loop reports). A worker stuck in a collective or in the device runtime keeps
renewing but stops progressing; a frozen or dead one stops both. Values are strings, as
annotations must be; `Heartbeat.to_annotations` / `from_annotations` are the only encoding.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from pydantic.alias_generators import to_camel

PREFIX = "hlat.dev/"
DEFAULT_PERIOD_SECONDS = 10.0
EXPIRY_PERIODS = 3
"""A Lease not renewed for this many periods has expired (its leaseDurationSeconds): the
process is frozen or gone."""

Phase = Literal["starting", "compiling", "training", "checkpointing", "finished"]
STARTING_PHASES: tuple[Phase, ...] = ("starting", "compiling")
"""An attempt's start, before its first step: the startup timeout applies, its step is not the
job's progress, its time is not training, and the worker publishes leaving it at once (not at
its next beat)."""


PEER_PORT = 29490
"""Each worker's launcher listens here (in-place restarts) so that its peers can tell it is
reachable: below the rendezvous ports (29500 + attempt % 16) and the ephemeral range."""
PEER_PROBE_SECONDS = 0.5
"""How often a launcher connects to its neighbours' (node ranks one below and one above, in a
ring), and how long a connection may take."""
PEER_LOST_SECONDS = 2.0
"""A neighbour reached once and then not for this long is reported unreachable."""
REPLICA_PORT = 29491
"""Each worker's launcher (in-place restarts, in-memory snapshots) serves its peers' snapshot
replicas here (`hlat_trainer.replica`)."""
CHECKPOINT_REQUEST = PREFIX + "checkpoint-request"
"""The one annotation the operator writes on a worker's Lease while the worker runs: a
checkpoint asked for now (a Kueue preemption; `spec.suspend` of a running gang), its value a
positive integer that grows with each new request (the job's step when it asked, plus one).
Node local rank 0's heartbeat reads it from each renewal's answer; every rank agrees on it at
the same step (`hlat_trainer.requests`) and saves that step once, then trains on until its pods
are stopped. Not a `Heartbeat` field: the worker never writes it."""


def lease_name(pod_name: str) -> str:
    """The Lease of a worker pod shares the pod's name (a different kind, so no clash)."""
    return pod_name


class Activity(BaseModel):
    """Seconds a worker spent per activity since its attempt began (the launcher started), from
    its monotonic clock, as of the heartbeat's `progress_time`: every second of the attempt is
    in exactly one of them. The operator's goodput accounting (`status.goodput`) reads them."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)

    startup: float = 0
    """Launcher start to the model built: imports, rendezvous, data and model set-up."""
    compile: float = 0
    """Graph compilation (XLA/Neuron; 0 on eager backends)."""
    restore: float = 0
    """Loading the durable checkpoint the attempt resumed from."""
    memory_restore: float = 0
    """Loading the in-memory snapshot the attempt resumed from instead (checkpoint.memoryInterval:
    no storage read)."""
    productive: float = 0
    """Steps no earlier attempt had finished (less data wait and compilation)."""
    recompute: float = 0
    """Steps at or below the highest step an earlier attempt finished: work done again."""
    checkpoint: float = 0
    """Durable saves blocking the training loop."""
    snapshot: float = 0
    """In-memory snapshots (checkpoint.memoryInterval) blocking the training loop."""
    data_wait: float = 0
    """The loop waiting for the data loader."""
    evaluation: float = 0
    """The held-out validation loss (spec.eval), between steps."""
    final_checkpoint: float = 0
    """Waiting, after the last step, for the last asynchronous write to complete."""

    def total(self) -> float:
        return float(sum(self.model_dump().values()))


class Heartbeat(BaseModel):
    """What a worker reports with each renewal."""

    phase: Phase = "starting"
    step: int = 0
    tokens: float = 0
    loss: float | None = None
    tokens_per_second: float | None = None
    step_seconds: float | None = None
    """Mean seconds per optimizer step recently; the operator's hang timeout learns from it."""
    compute_seconds: float | None = None
    """Median, over this worker's recent steps, of the seconds it computed in a step (forward
    and backward, less data wait), not counting its waits on its peers: a slow node's is higher
    than its gang's (`spec.faultTolerance.stragglers`). On XLA, the device time of the
    micro-batch graphs, from the runtime's buffer-ready callbacks (no host sync); None where
    nothing times the device (CUDA: not measured yet)."""
    sync_seconds: float | None = None
    """Median, over the same steps, of the seconds its collectives over data parallel took (the
    gradients' all-reduce, ZeRO-1's broadcast of the updated shards, the loss's all-reduce): on
    a healthy node mostly waiting for a slow one (a slow node's is the gang's shortest). With
    `compute_seconds`, `step_seconds` and the data wait, where a node's step time goes."""
    data_wait_seconds: float | None = None
    """Median, over the same steps, of the seconds the loop waited for this worker's data
    loader: a node whose data path is slow (a failing disk, a saturated link to the data) keeps
    its gang waiting as a slow chip does, with its compute time normal. The operator scores a
    node on `compute_seconds` plus this plus `host_seconds` (`hlat_operator.stragglers`)."""
    host_seconds: float | None = None
    """Median, over the same steps, of the rest of a step's time on this worker: the
    optimizer update, clipping, moving batches to the device (the step less compute, sync,
    data wait and a save's staging), none of it a wait on a peer. With the three above, where
    the step goes; a slow host (a noisy neighbour, a throttled CPU) shows here, and the
    operator's straggler score counts it. None where not measured (XLA: the update's device
    time is in `sync_seconds`; CUDA)."""
    validation_loss: float | None = None
    """The latest held-out validation loss (spec.eval), taken after step `validation_step`."""
    validation_step: int | None = None
    checkpoint_step: int | None = None
    """Newest complete checkpoint's step."""
    snapshot_step: int | None = None
    """Newest in-memory snapshot this worker's ranks hold (checkpoint.memoryInterval): with
    every pod's, what a restart in place can resume from."""
    resumed_step: int | None = None
    """The step this attempt resumed from (a checkpoint or an in-memory snapshot; 0: none)."""
    carried_seconds: float | None = None
    """With `resumed_step`: the training seconds of the steps the state it resumed from holds
    past the operator's steps done (HLAT_STEPS_DONE). An earlier attempt trained them after its
    last report, so no report counted them; goodput counts them productive now, from the time
    that attempt's end was charged to."""
    checkpoint_seconds: float | None = None
    """Longest whole checkpoint write of this attempt (asynchronous: start to commit): what the
    operator scales into how long a worker in phase `checkpointing` may go without progress
    (None before the first write completed: the startup bound)."""
    progress_time: datetime | None = None
    """When the training loop last reported (a step done, a phase begun)."""
    attempt: int | None = None
    exit_code: int | None = None
    """Set by the launcher when the trainer of this attempt exited and the pod stays (an
    in-place restart): the exit code, read by the operator as it reads a failed container's."""
    exit_reason: str | None = None
    """With `exit_code`, where the launcher can tell: `OOMKilled` when the kernel OOM-killed a
    process of the container's memory cgroup since the attempt began (the reason a container
    runtime gives a container)."""
    activity: Activity | None = None
    """Seconds per activity since the attempt began, up to `progress_time` (one annotation,
    JSON)."""
    unreachable_ranks: list[int] | None = None
    """Set by the launcher: the node ranks of this attempt whose launchers it reached and then
    could not for `PEER_LOST_SECONDS` (a TCP connection to `PEER_PORT` refused or timed out);
    `[]` once it reaches them again. A node's kernel answers a connection even while its
    processes are starved or stopped, so a slow node is not reported; a lost or cut-off one
    is, seconds before the node lifecycle controller's grace runs out."""
    unreachable_since: datetime | None = None
    """When the launcher last reached the first of `unreachable_ranks` (its own clock)."""

    @field_validator("activity", "unreachable_ranks", mode="before")
    @classmethod
    def _decode_json(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    def to_annotations(self) -> dict[str, str]:
        return {PREFIX + k: json.dumps(v, separators=(",", ":")) if isinstance(v, dict | list)
                else str(v) for k, v in self.model_dump(mode="json").items() if v is not None}

    @classmethod
    def from_annotations(cls, annotations: dict[str, str] | None) -> Heartbeat | None:
        """Decode; None when absent or malformed (an unknown writer is not trusted)."""
        if not annotations:
            return None
        raw = {k[len(PREFIX) :]: v for k, v in annotations.items() if k.startswith(PREFIX)}
        if not raw:
            return None
        try:
            return cls.model_validate(raw)
        except (ValidationError, ValueError):
            return None
