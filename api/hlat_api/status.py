"""The PretrainJob status the operator writes and `kubectl get pj` shows.

Written only by the operator; the trainer never touches it (it reports through its Lease, see
`hlat_api.heartbeat`). Times are RFC 3339 strings, as Kubernetes stores them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
ConditionType = Literal[
    "Ready", "Running", "Restarting", "Suspended", "Succeeded", "Failed", "Schedulable"
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
    down_seconds: float = 0
    ratio: float | None = None


class PretrainJobStatus(_Model):
    phase: Phase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    attempt: int = 0
    restarts: Restarts = Field(default_factory=Restarts)
    last_failure: Failure | None = None
    progress: Progress = Field(default_factory=Progress)
    latest_checkpoint: CheckpointRef | None = None
    uptime: Uptime = Field(default_factory=Uptime)
    lost_steps: int = 0
    """Steps computed again after restarts (progress lost since the last checkpoint)."""
    avoided_nodes: list[AvoidedNode] = Field(default_factory=list)
    """Nodes kept out of the next attempts; the next gang may still use some of them when
    fewer usable nodes than `nodes` would remain (the least recently failed first)."""
    start_time: str | None = None
    completion_time: str | None = None
    observed_generation: int | None = None
