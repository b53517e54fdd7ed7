"""Environment variables the operator sets in worker pods and the trainer reads.

One module of names, so neither side scatters string literals. Rendezvous variables follow
torchrun's own meaning; HLAT_* ones are ours.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Env(StrEnum):
    JOB_NAME = "HLAT_JOB_NAME"
    """PretrainJob name; also the checkpoint subdirectory."""
    NAMESPACE = "HLAT_NAMESPACE"
    POD_NAME = "HLAT_POD_NAME"
    NODE_NAME = "HLAT_NODE_NAME"
    ATTEMPT = "HLAT_ATTEMPT"
    """Restart attempt number, from 0."""
    CONFIG = "HLAT_CONFIG"
    """Path of the trainer config (the PretrainJob spec as JSON, from the ConfigMap)."""
    NNODES = "HLAT_NNODES"
    NODE_RANK = "HLAT_NODE_RANK"
    NPROC_PER_NODE = "HLAT_NPROC_PER_NODE"
    MASTER_ADDR = "HLAT_MASTER_ADDR"
    MASTER_PORT = "HLAT_MASTER_PORT"
    HEARTBEAT_LEASE = "HLAT_HEARTBEAT_LEASE"
    """Name of the Lease this pod's local rank 0 renews; unset means no heartbeat."""
    HEARTBEAT_PERIOD = "HLAT_HEARTBEAT_PERIOD_SECONDS"
    METRICS_PORT = "HLAT_METRICS_PORT"
    """Port of the trainer's Prometheus endpoint (local rank 0); 0 or unset disables it."""
    STEPS_DONE = "HLAT_STEPS_DONE"
    """The highest step node rank 0 of an earlier attempt reported (the operator's view when
    it created the gang): a step at or below it is work done again (goodput's recompute)."""
    LAUNCHED_MONOTONIC = "HLAT_LAUNCHED_MONOTONIC"
    """The launcher's start on the machine's monotonic clock: where the attempt's time
    accounting begins (set by hlat-launch)."""
    EVAL_STEP = "HLAT_EVAL_STEP"
    """The checkpoint step an evaluation Job reads (hlat-eval's default for --step)."""
    EVAL_RESULT = "HLAT_EVAL_RESULT"
    """Where `hlat-eval` writes its result (a JSON object) when no --output is given."""
    EXIT_FILE = "HLAT_EXIT_FILE"
    """Where a trainer that fails for good writes its exit code (set by hlat-launch, which
    makes it the pod's: torchrun reports every failed worker as 1)."""
    STARTED_FILE = "HLAT_STARTED_FILE"
    """A file the trainer creates once it has taken its attempt's first training step (set by
    hlat-launch under InPlace: it starts the next warm standbys only then, so that their
    imports take no CPU from the attempt's own start)."""
    PEAK_FLOPS_FILE = "HLAT_PEAK_FLOPS_FILE"
    """Where a trainer on CPU keeps the peak FLOP/s it measured for MFU (JSON by device and
    dtype), for the next attempts in the same pod to reuse (set by hlat-launch under InPlace:
    the probe takes a fraction of a second of every start)."""
    GANG_LEASE = "HLAT_GANG_LEASE"
    """Name of the job's restart record (a Lease, `labels.gang_lease_name`): set only under
    `restartStrategy: InPlace`, where the launcher polls it for a new attempt."""
    SPARE = "HLAT_SPARE"
    """Set (to 1) in a spare pod: its launcher starts no trainer until the restart record
    gives its pod a node rank."""
    SNAPSHOT_DIR = "HLAT_SNAPSHOT_DIR"
    """Where the trainer keeps its in-memory snapshots (checkpoint.memoryInterval): a directory
    on a memory file system that outlives the trainer process (set by hlat-launch: one per pod,
    under /dev/shm, removed when the launcher ends)."""
    LOG_FORMAT = "HLAT_LOG_FORMAT"
    """`json` (one object per step on stdout) or `bar` (progress bar); default by isatty."""


class ExitCode(IntEnum):
    """Trainer exit codes with a meaning to the operator."""

    OK = 0
    CONFIG_ERROR = 2
    """Bad spec, data, tokenizer or checkpoint: permanent, a restart cannot fix it."""
    FENCED = 3
    """The trainer's attempt is over (its Lease writes are refused: the operator moved on): it
    stopped itself, and committed no checkpoint after it learned so."""
    NODE_FAULT = 4
    """The node is at fault, not the job: its Neuron driver is older than the image's runtime
    supports (the launcher's check), or the Neuron runtime reported a hardware error. The
    operator restarts the gang off that node (no restart budget) and avoids it."""
