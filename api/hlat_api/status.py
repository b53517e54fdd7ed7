"""The PretrainJob status the operator writes and `kubectl get pj` shows.

Written only by the operator; the trainer never touches it (it reports through its Lease, see
`hlat_api.heartbeat`). Times are RFC 3339 strings, as Kubernetes stores them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from hlat_api.heartbeat import Activity

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
ConditionType = Literal[
    "Ready", "Running", "Restarting", "Suspended", "Succeeded", "Failed", "Schedulable",
    "Straggler", "Degraded",
]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_attribute_docstrings=True
    )


class Condition(_Model):
    """A Kubernetes-style condition."""

    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    """CamelCase machine-readable reason, e.g. NodeLost, InvalidSpec, BudgetExhausted."""
    message: str = ""
    """What happened, for a person."""
    last_transition_time: str | None = None


class Restarts(_Model):
    total: int = 0
    """Gang restarts so far."""
    counted: int = 0
    """Restarts that used budget (infrastructure faults may not count)."""
    in_place: int | None = None
    """Restarts done in place: the pods stayed, their launchers restarted the trainers
    (`faultTolerance.restartStrategy: InPlace`); only pods that were gone were recreated."""


class Spares(_Model):
    wanted: int = 0
    """faultTolerance.spareNodes."""
    ready: int = 0
    """Spare pods running, their launchers waiting with warm standby trainers."""
    promoted: int = 0
    """Spares that took over a lost node's rank so far."""


class Resize(_Model):
    """One change of an elastic job's size."""

    nodes: int
    """The size it changed to."""
    at: str
    """When the operator decided it (RFC 3339)."""
    reason: str
    """Shrunk (nodes missing for elastic.waitSeconds) or Grown (they returned)."""


class Size(_Model):
    """The nodes a job trains on: spec.nodes, or fewer while an elastic job (spec.elastic)
    is short of nodes."""

    nodes: int
    """Nodes the current attempt trains on."""
    desired: int
    """spec.nodes: the size it returns to."""
    text: str = ""
    """`nodes/desired`, e.g. 2/3 (`kubectl get pj` column Nodes)."""
    since: str | None = None
    """When it took that size (RFC 3339)."""
    resizes: list[Resize] = Field(default_factory=list)
    """The last changes, oldest first (at most 10)."""


class Failure(_Model):
    reason: str
    """Why the last attempt ended, e.g. PodFailed, NodeLost, HeartbeatTimeout, Evicted."""
    node: str | None = None
    pod: str | None = None
    exit_code: int | None = None
    message: str = ""
    time: str | None = None


class Progress(_Model):
    step: int = 0
    tokens: float = 0
    loss: float | None = None
    tokens_per_second: float | None = None
    total_steps: int | None = None
    """The run's length in steps (train.steps, or train.tokens over the tokens per step)."""
    summary: str | None = None
    """`step/totalSteps (percent)`, for `kubectl get pj`."""
    loss_text: str | None = None
    """The loss to 4 significant digits, for `kubectl get pj` (`loss` keeps every digit)."""
    validation_loss: float | None = None
    """The latest held-out validation loss (spec.eval), mean per token."""
    validation_step: int | None = None
    """The step after which `validationLoss` was taken."""
    validation_loss_text: str | None = None
    """`validationLoss` to 4 significant digits, for `kubectl get pj -o wide`."""
    eta_seconds: float | None = None
    """Steps left x the workers' recent mean step time (restarts not foreseen)."""


class CheckpointRef(_Model):
    step: int
    time: str | None = None


class AvoidedNode(_Model):
    """A node that failed this job and is kept out of its next attempts, for a while."""

    node: str
    failed_at: str
    """When the fault that implicated it was detected."""
    until: str
    """When it becomes usable again (faultTolerance.avoidFailedNodesSeconds after the fault)."""
    reason: str = ""
    """The fault's reason, e.g. NodeLost, HeartbeatTimeout."""


class Uptime(_Model):
    """The paper's Table 1 measure: time training over time since the job first started."""

    running_seconds: float = 0
    """Time in phase Running."""
    down_seconds: float = 0
    """Time in Pending or Restarting after the job first ran."""
    ratio: float | None = None
    """runningSeconds / (runningSeconds + downSeconds)."""


class Badput(_Model):
    """Seconds of wall time that did not train, by cause (see `Goodput`)."""

    pending: float = 0
    """Pods created to the trainer's launcher starting: scheduling, image pull, container
    start."""
    startup: float = 0
    """Launcher start to the model built (imports, rendezvous, set-up)."""
    compile: float = 0
    """Graph compilation (XLA/Neuron; 0 on eager backends)."""
    restore: float = 0
    """Loading the durable checkpoint an attempt resumed from."""
    memory_restore: float = 0
    """Loading the in-memory snapshot an attempt resumed from instead (no storage read)."""
    recompute: float = 0
    """Steps trained again after a restart (the work lost since the last checkpoint)."""
    checkpoint: float = 0
    """Durable saves blocking the training loop."""
    snapshot: float = 0
    """In-memory snapshots (checkpoint.memoryInterval) blocking the training loop."""
    data_wait: float = 0
    """The training loop waiting for the data loader."""
    evaluation: float = 0
    """The held-out validation loss (spec.eval) computed between steps."""
    final_checkpoint: float = 0
    """Waiting for the last asynchronous write after the last step."""
    detection: float = 0
    """The workers' last report before a fault to the operator acting on it (the work of the
    last moments is in here too, unless the next gang resumed past it: then it is productive)."""
    teardown: float = 0
    """Deleting a failed gang until none of its pods is left."""
    backoff: float = 0
    """The restart backoff, after the old gang is gone."""
    resize: float = 0
    """A planned resize (spec.elastic: shrinking once the wait for a node is over, growing
    back): deleting the gang until none of its pods is left. The new gang's start is in pending,
    startup, compile and restore like any attempt's."""
    straggler: float = 0
    """Training time lost to a slow node (spec.faultTolerance.stragglers): while a node is
    flagged (condition Straggler), and over its window once it is, the part of each step by
    which its compute exceeds the median of the other nodes' (the time they wait for it),
    moved out of productive."""
    other: float = 0
    """The rest of an ended attempt the workers did not report (e.g. a finished gang's last
    report to the operator seeing it done)."""
    unreported: float = 0
    """Provisional: time of the running attempt not reported yet (before the workers' first
    report, or since their last, at most a heartbeat period while they train); it moves to its
    cause when known."""


class Breakdown(_Model):
    productive: float = 0
    badput: Badput = Field(default_factory=Badput)


class AttemptLedger(_Model):
    """The running attempt's accounting, kept in status so that an operator restart neither
    loses nor double counts it."""

    attempt: int
    window_seconds: float = 0
    """Time this attempt spent Pending or Running (the operator's clock)."""
    pending_seconds: float | None = None
    """Fixed at the workers' first report: the window then, less what they reported and the
    time since their report."""
    reported: Activity | None = None
    """Node rank 0's latest per-activity seconds."""
    carried_seconds: float = 0
    """Productive seconds of earlier attempts this one reported (its lead's `carriedSeconds`)
    and that were moved from their end's cause (detection, other) to productive: each once."""


class Goodput(_Model):
    """Runtime goodput: productive training seconds over wall seconds since the job's first
    gang was created (Suspended time excluded), with the rest by cause. Productive means
    steps no earlier attempt had finished, less data wait and compilation: the measure of
    Google's ML Goodput. Side by side with `Uptime`, the paper's measure, which counts every
    Running second as up."""

    ratio: float | None = None
    """productiveSeconds / wallSeconds."""
    wall_seconds: float = 0
    """Since the first gang was created, Suspended time excluded."""
    productive_seconds: float = 0
    """Steps no earlier attempt had finished, less data wait and compilation."""
    badput_seconds: Badput = Field(default_factory=Badput)
    """The rest of the wall time, by cause; productiveSeconds plus all of them is wallSeconds."""
    lost_work_seconds: float = 0
    """Training time thrown away by restarts: lost steps x the step time when each fault
    hit. With in-memory snapshots (checkpoint.memoryInterval) a restart's share is added once
    its next attempt says where it resumed: this figure never goes down."""
    checkpoint_age_seconds: float | None = None
    """Time since the latest complete checkpoint was first reported."""
    capacity: float | None = None
    """nodeSeconds / desiredNodeSeconds: the share of the nodes asked for that the job trained
    on while Running (1 unless an elastic job ran short of nodes). Time at a reduced size is
    productive in `ratio`; this says at what size."""
    node_seconds: float = 0
    """Seconds in phase Running x the nodes the job trained on."""
    desired_node_seconds: float = 0
    """Seconds in phase Running x spec.nodes."""
    settled: Breakdown = Field(default_factory=Breakdown)
    """Attempts that ended and the time between them: final figures."""
    current: AttemptLedger | None = None


EvaluationPhase = Literal["Running", "Succeeded", "Failed"]


class Evaluation(_Model):
    """One evaluation job on a durable checkpoint (spec.evaluation)."""

    step: int
    tokens: float = 0
    """Tokens trained by that checkpoint: step x tokens per step."""
    job: str
    """The Kubernetes Job that runs it."""
    phase: EvaluationPhase = "Running"
    results: dict[str, float] = Field(default_factory=dict)
    """What the evaluator wrote (HLAT_EVAL_RESULT), its numbers by name."""
    message: str | None = None
    """Why it failed, or why its results could not be read."""


class PretrainJobStatus(_Model):
    phase: Phase = "Pending"
    reason: str | None = None
    """Why the job is in its phase, one word (`kubectl get pj` column Why): the reason of the
    phase's condition, e.g. Suspended: Queued, EvictedByKueue or Suspended (spec.suspend);
    Pending: the Schedulable condition's while it is False (TopologyUnavailable, ...), else
    what started the attempt. The message is on the condition."""
    conditions: list[Condition] = Field(default_factory=list)
    attempt: int = 0
    restarts: Restarts = Field(default_factory=Restarts)
    last_failure: Failure | None = None
    progress: Progress = Field(default_factory=Progress)
    latest_checkpoint: CheckpointRef | None = None
    uptime: Uptime = Field(default_factory=Uptime)
    goodput: Goodput = Field(default_factory=Goodput)
    lost_steps: int = 0
    """Steps computed again after restarts (progress lost since the last checkpoint)."""
    spares: Spares | None = None
    """Spare pods (faultTolerance.spareNodes), when the job asks for any."""
    size: Size | None = None
    """The size the job trains at (below spec.nodes only for an elastic job short of nodes),
    with its changes."""
    avoided_nodes: list[AvoidedNode] = Field(default_factory=list)
    """Nodes kept out of the next attempts; the next gang may still use some of them when
    fewer usable nodes than `nodes` would remain (the least recently failed first)."""
    evaluations: list[Evaluation] = Field(default_factory=list)
    """Evaluation jobs on durable checkpoints (spec.evaluation), oldest first, the newest
    evaluation.keep of them."""
    accounted_at: str | None = None
    """Time up to which uptime and goodput are accounted (written with them, microseconds)."""
    start_time: str | None = None
    completion_time: str | None = None
    observed_generation: int | None = None
