"""What the operator sees of a job: small frozen dataclasses, parsed from raw API payloads.

reconcile decides from these alone, so its tests build them directly, and the parsing of
Kubernetes' sprawling Pod/Node/Lease payloads (pure functions here) is tested once, apart.
`OperatorState` is the bookkeeping the status model does not hold, stored as JSON in the
`hlat.dev/operator-state` annotation of the PretrainJob; everything else is derived from the
observed objects and the status on every pass, so an operator restart mid-recovery resumes
where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hlat_api import labels
from hlat_api.heartbeat import Heartbeat
from hlat_api.status import PretrainJobStatus
from hlat_operator.builders import AVOIDED_ANNOTATION, JobRef
from hlat_operator.evaluations import ObservedEvaluation
from hlat_operator.nodehealth import NodeProblem, label_problem, node_problems
from hlat_operator.queueing import TERMINATED_BY_KUEUE, Queueing

UNREACHABLE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
UNPLACED_REASONS = ("Unschedulable", "SchedulingGated")
"""PodScheduled=False reasons of a pod that waits for a node: no node fits, or an admission
controller (Kueue's pod integration, for one) holds it with a scheduling gate."""


def parse_time(value: str | None) -> datetime | None:
    """RFC 3339 (Time or MicroTime) to an aware datetime; None when absent or malformed."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_micro_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class ObservedPod:
    name: str
    attempt: int | None
    """From the attempt label; None for a pod without one (not ours to judge)."""
    rank: int | None = None
    phase: str = "Pending"
    """Pending | Running | Succeeded | Failed | Unknown: the worker's, which is the trainer
    container's once it ended (a sidecar may keep the pod itself Running)."""
    exit_code: int | None = None
    """Of the trainer container, once it terminated."""
    reason: str | None = None
    """Pod-level reason (Evicted, Preempting, ...) or the container's (OOMKilled, Error)."""
    message: str = ""
    node: str | None = None
    deletion_timestamp: datetime | None = None
    ready: bool = False
    started_at: datetime | None = None
    """When the trainer container started (else the pod's startTime), or, for a pod an
    in-place restart moved to its current attempt, when it was moved (`labels.ATTEMPT_STARTED`)."""
    created_at: datetime | None = None
    finished_at: datetime | None = None
    """When the trainer container ended (its terminated state's finishedAt, whole seconds)."""
    disruption: str | None = None
    """Reason of a DisruptionTarget condition (PreemptionByScheduler, EvictionByEvictionAPI, ...)."""
    unschedulable_since: datetime | None = None
    """Since when the pod has waited for a node (PodScheduled=False, reason Unschedulable or
    SchedulingGated); None once placed or before the scheduler looked at it."""
    schedule_message: str = ""
    """The scheduler's message, e.g. `0/3 nodes are available: 3 Insufficient cpu.`"""
    avoided: tuple[str, ...] | None = None
    """The nodes its affinity avoids (the operator's annotation); None: not annotated."""
    lingering: bool = False
    """The trainer container ended but the pod still runs (a sidecar that does not stop with
    it): finished for the job, yet holding its node until deleted."""
    spare: bool = False
    """A spare pod (faultTolerance.spareNodes): no attempt or rank until promoted."""
    hostname: str | None = None
    """spec.hostname (`<job>-<index>`, or a spare's)."""
    terminated_by_kueue: bool = False
    """Failed by Kueue before it ran: placed by topology on a node Kueue then found unhealthy
    (`queueing.TERMINATED_BY_KUEUE`)."""

    @property
    def terminating(self) -> bool:
        return self.deletion_timestamp is not None

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class ObservedNode:
    name: str
    ready: bool = True
    not_ready_since: datetime | None = None
    unreachable: bool = False
    health: str | None = None
    """The HyperPod node-health-status label, if any."""
    labels: Mapping[str, str] = field(default_factory=dict)
    cordoned: bool = False
    """spec.unschedulable (kubectl cordon)."""
    problems: tuple[NodeProblem, ...] = ()
    """What its health reporters say is wrong (conditions, HyperPod's label): nodehealth."""

    @property
    def problem(self) -> NodeProblem | None:
        """The first problem (a node built without `problems` still has its label's)."""
        return self.problems[0] if self.problems else label_problem(self.health)

    @property
    def healthy(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class ObservedLease:
    name: str
    renew_time: datetime | None = None
    heartbeat: Heartbeat | None = None
    clock_offset: float = 0.0
    """Seconds the writer's clock was found ahead of the API server's (0 within tolerance);
    `renew_time` and the heartbeat's `progress_time` are already corrected by it."""


class OperatorState(BaseModel):
    """Bookkeeping beyond PretrainJobStatus, in the `hlat.dev/operator-state` annotation."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    accounted_at: str | None = None
    """Where earlier versions kept status.accountedAt (read when the status has none)."""
    checkpoint_at_attempt_start: int | None = None
    """Latest complete checkpoint step when the current attempt was created."""
    no_progress_streak: int = 0
    """Attempts in a row that ended without a new complete checkpoint."""
    faulted_attempt: int | None = None
    """The attempt whose fault is already counted in this state (makes recounting a no-op)."""
    ready_attempt: int | None = None
    """The attempt that became Ready (all workers training), for time-to-recover."""
    lost_attempt: int | None = None
    """The attempt whose resumed step settles the last restart's loss: the restart counted
    `lost_counted` steps back to `lost_basis` (the snapshot every worker held); an attempt that
    resumed from an older snapshot or the durable checkpoint lost more, one that resumed from a
    newer snapshot fewer. The lost work (steps x `lost_step_seconds`) goes into status only then,
    so that it never has to go back."""
    peer_lost: list[str] = []
    """Pods found lost by their peers (`faults.unreachable_fault`) that still exist: treated as
    on a dead node whatever their Node says (its kubelet, gone too, will not confirm)."""
    lost_basis: int = 0
    lost_counted: int = 0
    lost_step_seconds: float = 0.0
    high_step: int = 0
    """The highest step node rank 0 of any attempt reported: the next gang's recomputed work
    ends there."""
    in_place_next: int | None = None
    """The attempt an in-place restart is preparing (the pods that are gone go first)."""
    in_place_attempt: int | None = None
    """The latest attempt started in place (its kept pods are adopted, not torn down)."""
    spare_serial: int = 0
    """The next spare pod's number (spare pod names are never reused)."""
    slow_since: dict[str, str] = Field(default_factory=dict)
    """Nodes of the attempt computing over the straggler threshold, each since when (RFC 3339)."""
    slow_under_since: dict[str, str] = Field(default_factory=dict)
    """Those of them back under it for now (a dip shorter than the grace keeps their since),
    each since when (RFC 3339)."""
    stop_asked_since: str | None = None
    """When the running attempt was asked to stop (Kueue evicted it, or spec.suspend), while
    its workers write the checkpoint the operator asked for before they stop (RFC 3339)."""
    stop_after_checkpoint: int | None = None
    """The step the checkpoint asked for is at or after (the step the workers had reported,
    plus one): once a checkpoint at or after it is complete, they stop."""
    deactivated_workload: bool = False
    """The operator set the job's Kueue Workload inactive for spec.suspend (so that a suspended
    job holds no quota); it activates it again when the job resumes. A Workload someone else
    deactivated stays so."""
    size: int | None = None
    """An elastic job's size while below spec.nodes (None: spec.nodes)."""
    grow_after: int | None = None
    """An elastic job below its size saw nodes for a larger one when this checkpoint step was
    the latest: it grows once a newer one is complete (-1: none yet)."""
    kueue_remakes: int = 0
    """Pods of `kueue_remakes_attempt` Kueue failed before they ran and the operator made
    again (`reconcile.KUEUE_REMAKES_PER_ATTEMPT` bounds them)."""
    kueue_remakes_attempt: int | None = None
    in_place_failures: int = 0
    """In-place attempts in a row that ended before all their workers trained: at
    `reconcile.IN_PLACE_FAILURES_BEFORE_RECREATE` the next restart recreates the gang."""

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str] | None) -> OperatorState:
        raw = (annotations or {}).get(labels.STATE_ANNOTATION)
        if not raw:
            return cls()
        try:
            return cls.model_validate(json.loads(raw))
        except (ValueError, ValidationError):
            return cls()

    def to_annotation(self) -> str:
        return self.model_dump_json(exclude_defaults=True)


@dataclass(frozen=True)
class Observed:
    """Everything decide() looks at besides the spec and status."""

    job: JobRef
    pods: list[ObservedPod] = field(default_factory=list)
    nodes: dict[str, ObservedNode] = field(default_factory=dict)
    nodes_known: bool = True
    """False until the node list was read once: a node missing from an empty cache is not lost."""
    leases: dict[str, ObservedLease] = field(default_factory=dict)
    state: OperatorState = field(default_factory=OperatorState)
    generation: int | None = None
    resource_version: str | None = None
    creation_time: datetime | None = None
    queueing: Queueing | None = None
    """The job's Kueue queue and Workload, when it is labelled with a queue (else None)."""
    evaluations: dict[int, ObservedEvaluation] | None = None
    """Its evaluation Jobs by checkpoint step (evaluations.observe_jobs); None: not read (a job
    without spec.evaluation and none running)."""
    seeing_since: datetime | None = None
    """Since when the operator sees: its own start, or its getting the API server back after
    losing it (None: unknown). While it was away (or not yet running) no renewal or kubelet
    report could reach it, so silence from before this moment is no evidence: timeouts run
    again from here (faults.detect_fault)."""

    def lease_of(self, pod: ObservedPod) -> ObservedLease | None:
        """The heartbeat Lease of the pod's node rank in the pod's attempt (a pod kept by an
        in-place restart carries the attempt it serves now, not the one it was created for)."""
        if pod.attempt is None or pod.rank is None:
            return None
        return self.leases.get(labels.worker_lease_name(self.job.name, pod.attempt, pod.rank))

    def spare_pods(self) -> list[ObservedPod]:
        return [p for p in self.pods if p.spare]

    def pods_of(self, attempt: int) -> list[ObservedPod]:
        return [p for p in self.pods if p.attempt == attempt]


# --- parsing raw payloads --------------------------------------------------------------------


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def pod_from_raw(raw: Mapping[str, Any], container: str = "trainer") -> ObservedPod:
    meta, status = raw.get("metadata") or {}, raw.get("status") or {}
    pod_labels = meta.get("labels") or {}
    statuses = status.get("containerStatuses") or []
    mine = next(
        (c for c in statuses if c.get("name") == container), statuses[0] if statuses else {}
    )
    state = mine.get("state") or {}
    term = state.get("terminated") or {}
    running = state.get("running") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    disruption = conditions.get("DisruptionTarget") or {}
    scheduled = conditions.get("PodScheduled") or {}
    stuck = scheduled.get("status") == "False" and scheduled.get("reason") in UNPLACED_REASONS
    gates = [g.get("name", "") for g in (raw.get("spec") or {}).get("schedulingGates") or []]
    note = f" (scheduling gates: {', '.join(gates)})" if gates else ""
    avoided = (meta.get("annotations") or {}).get(AVOIDED_ANNOTATION)
    phase = status.get("phase") or "Pending"
    lingering = phase == "Running" and bool(term) and mine.get("name") == container
    if lingering:  # the trainer is done: its exit code decides, whatever the sidecars do
        phase = "Succeeded" if _int(term.get("exitCode")) == 0 else "Failed"
    return ObservedPod(
        name=meta.get("name", ""),
        attempt=_int(pod_labels.get(labels.ATTEMPT)),
        rank=_int(pod_labels.get(labels.NODE_RANK)),
        phase=phase,
        exit_code=_int(term.get("exitCode")),
        reason=status.get("reason") or term.get("reason"),
        message=status.get("message") or term.get("message") or "",
        node=(raw.get("spec") or {}).get("nodeName"),
        deletion_timestamp=parse_time(meta.get("deletionTimestamp")),
        ready=(conditions.get("Ready") or {}).get("status") == "True",
        started_at=_latest(parse_time(running.get("startedAt") or term.get("startedAt"))
                           or parse_time(status.get("startTime")),
                           parse_time((meta.get("annotations") or {}).get(
                               labels.ATTEMPT_STARTED))),
        created_at=parse_time(meta.get("creationTimestamp")),
        finished_at=parse_time(term.get("finishedAt")),
        disruption=disruption.get("reason") if disruption.get("status") == "True" else None,
        unschedulable_since=parse_time(scheduled.get("lastTransitionTime")) if stuck else None,
        schedule_message=str(scheduled.get("message") or "") + note if stuck else "",
        avoided=None if avoided is None else tuple(n for n in avoided.split(",") if n),
        lingering=lingering,
        spare=labels.SPARE in pod_labels,
        hostname=(raw.get("spec") or {}).get("hostname"),
        terminated_by_kueue=(conditions.get(TERMINATED_BY_KUEUE) or {}).get("status") == "True",
    )


def _latest(*times: datetime | None) -> datetime | None:
    return max((t for t in times if t is not None), default=None)


def _ready_condition(raw: Mapping[str, Any]) -> dict[str, Any]:
    conditions = (raw.get("status") or {}).get("conditions") or []
    found: dict[str, Any] = next((c for c in conditions if c.get("type") == "Ready"), {})
    return found


def node_ready(raw: Mapping[str, Any]) -> bool:
    """Whether a raw Node's Ready condition is True."""
    return _ready_condition(raw).get("status") == "True"


def node_from_raw(raw: Mapping[str, Any]) -> ObservedNode:
    meta = raw.get("metadata") or {}
    ready = _ready_condition(raw)
    is_ready = ready.get("status") == "True"
    taints = (raw.get("spec") or {}).get("taints") or []
    return ObservedNode(
        name=meta.get("name", ""),
        ready=is_ready,
        not_ready_since=None if is_ready else parse_time(ready.get("lastTransitionTime")),
        unreachable=any(t.get("key") in UNREACHABLE_TAINTS for t in taints),
        health=(meta.get("labels") or {}).get(labels.NODE_HEALTH_LABEL),
        labels=dict(meta.get("labels") or {}),
        cordoned=bool((raw.get("spec") or {}).get("unschedulable")),
        problems=node_problems(raw),
    )


CLOCK_SKEW_TOLERANCE_SECONDS = 5.0
"""A writer's clock further than this from the API server's is corrected for (the server's
write times have a resolution of one second)."""


def lease_from_raw(raw: Mapping[str, Any]) -> ObservedLease:
    """A Lease as the operator reads it. Its `renewTime` and the heartbeat's `progress_time`
    are the worker's clock; the API server stamps each write in `managedFields` with its own.
    A worker clock off by more than the tolerance (a node whose time sync failed) would make
    a healthy worker look hung or hide a hung one: its times are shifted onto the server's."""
    meta, spec = raw.get("metadata") or {}, raw.get("spec") or {}
    renewed = parse_time(spec.get("renewTime"))
    beat = Heartbeat.from_annotations(meta.get("annotations"))
    written = [t for f in meta.get("managedFields") or [] if (t := parse_time(f.get("time")))]
    offset = 0.0
    if renewed is not None and written:
        ahead = (renewed - max(written)).total_seconds()
        if abs(ahead) > CLOCK_SKEW_TOLERANCE_SECONDS:
            offset = ahead
            shift = timedelta(seconds=offset)
            renewed -= shift
            if beat is not None and beat.progress_time is not None:
                beat = beat.model_copy(update={"progress_time": beat.progress_time - shift})
    return ObservedLease(name=meta.get("name", ""), renew_time=renewed, heartbeat=beat,
                         clock_offset=offset)


def status_from_raw(raw: Mapping[str, Any] | None) -> PretrainJobStatus:
    """The job's status; a malformed one (edited by hand) starts over rather than crashing."""
    try:
        return PretrainJobStatus.model_validate(dict(raw or {}))
    except ValidationError:
        return PretrainJobStatus()


def observe(
    body: Mapping[str, Any],
    pods: list[Mapping[str, Any]],
    nodes: list[Mapping[str, Any]] | None,
    leases: list[Mapping[str, Any]],
) -> Observed:
    """Build the Observed view from a PretrainJob body and raw lists (nodes None: unknown)."""
    meta = body.get("metadata") or {}
    job = JobRef(meta.get("name", ""), meta.get("namespace", ""), meta.get("uid", ""))
    parsed_nodes = [node_from_raw(n) for n in nodes or []]
    parsed_leases = [lease_from_raw(lease) for lease in leases]
    return Observed(
        job=job,
        pods=[pod_from_raw(p) for p in pods],
        nodes={n.name: n for n in parsed_nodes},
        nodes_known=nodes is not None,
        leases={lease.name: lease for lease in parsed_leases},
        state=OperatorState.from_annotations(meta.get("annotations")),
        generation=_int(meta.get("generation")),
        resource_version=meta.get("resourceVersion"),
        creation_time=parse_time(meta.get("creationTimestamp")),
    )
