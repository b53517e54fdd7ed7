"""The operator's decisions: `decide(spec, status, observed, now, settings) -> Decision`.

Pure: no kopf, no Kubernetes client, no clock (`now` is an argument), so every restart,
backoff, budget, hang and uptime rule is unit-tested with a fake clock. The handlers call
`decide` on every event and timer tick and hand the Decision to the k8s module, which executes
its actions *in order* and stops at the first error (the next pass decides again).

Everything is derived from the observed objects and the status on every pass, never from
memory of an earlier pass, so an operator restarted mid-recovery carries on correctly:
- "Never two gangs": pods of an older attempt are deleted, and a new gang is created only
  when no pod of any attempt is left (terminating ones included). Pods of a *newer* attempt
  than the status knows mean the view is stale: decide nothing and look again shortly.
- Pod names are per attempt and deterministic, so creating a gang twice is a no-op.
- The status (attempt, phase, restart counts) is written before the objects of the next
  step, and fault accounting in the OperatorState annotation is keyed by attempt, so
  replaying a pass never counts a fault twice.

Phases: Pending (gang created, not all running) -> Running (all running) -> Succeeded (all
exited 0). A fault makes it Restarting: every pod of the attempt is deleted, the operator
waits until they are gone (force-deleting pods stuck on a dead node after a bound), backs
off exponentially, and creates attempt+1 (phase Pending, the Restarting condition stays True
until the new gang runs). Suspended deletes the pods and keeps progress; resuming creates a
new attempt. A Ready gang told to stop (spec.suspend, a Kueue eviction) is first asked for a
checkpoint, and stopped once it is complete (bounded). Failed and Succeeded are terminal.

Progress, checkpoints, uptime, goodput and lost steps are computed by
`hlat_operator.accounting`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from hlat_api import labels
from hlat_api.heartbeat import CHECKPOINT_REQUEST, EXPIRY_PERIODS, STARTING_PHASES, Heartbeat
from hlat_api.labels import Reason
from hlat_api.manifest import InvalidSpecError, parse_spec
from hlat_api.spec import PretrainJobSpec, TopologySpec
from hlat_api.status import (
    AvoidedNode,
    Condition,
    Failure,
    Phase,
    PretrainJobStatus,
    Resize,
    Size,
    Spares,
)
from hlat_operator import (
    accounting,
    builders,
    elastic,
    evaluations,
    queueing,
    stragglers,
    topology,
)
from hlat_operator.builders import RankPlacement
from hlat_operator.config import OperatorSettings
from hlat_operator.faults import (
    Fault,
    detect_fault,
    heartbeat_ages,
    node_dead,
    seconds_to_next_timeout,
)
from hlat_operator.kube import Object
from hlat_operator.observe import (
    Observed,
    ObservedNode,
    ObservedPod,
    OperatorState,
    format_micro_time,
    format_time,
    parse_time,
)

TERMINAL: tuple[Phase, ...] = ("Succeeded", "Failed")
ACTIVE: tuple[Phase, ...] = ("Pending", "Running")
"""An attempt's gang exists (its goodput window runs)."""
PHASE_CONDITIONS = ("Running", "Restarting", "Suspended", "Succeeded", "Failed")
IN_PLACE_FAILURES_BEFORE_RECREATE = 2
KUEUE_REMAKES_PER_ATTEMPT = 3
"""Pods of one attempt Kueue may fail before they run (`_remake_pods_kueue_failed`) and the
operator make again with no fault; the next counts as the attempt's fault (a restart against
the budget, with backoff), so that a loop of Kueue failing what the operator makes ends."""
TIMEOUT_CHECK_MARGIN_SECONDS = 0.1
"""A pass due at a heartbeat timeout runs this much after it, so the timeout has run out."""
"""In-place attempts in a row that fail before all their workers train, after which the next
restart recreates the gang (a pod may be broken in a way its launcher cannot see)."""

# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PatchState:
    """Write OperatorState as the job's `hlat.dev/operator-state` annotation."""

    annotation: str


@dataclass(frozen=True)
class PatchStatus:
    """Replace the job's status (the whole object, camelCase)."""

    status: dict[str, Any]
    resource_version: str | None = None
    """For optimistic concurrency: a stale view must lose (HTTP 409), not overwrite."""


@dataclass(frozen=True)
class EmitEvent:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class CreateObject:
    """Create `obj`; if it exists, leave it (replace=False) or replace it (replace=True)."""

    obj: Object
    replace: bool = False
    refused: str | None = None
    """For an object the job can do without (an evaluation Job): the reason of the Warning
    event that reports a failure to create it, after which the pass goes on (a refusal of
    any other object fails the job, `Rejected`; other errors fail the pass)."""


@dataclass(frozen=True)
class WriteWorkloadStatus:
    """Set these conditions on the job's Kueue Workload (and clear its admission)."""

    conditions: tuple[Mapping[str, str], ...]
    clear_admission: bool = False


@dataclass(frozen=True)
class DeletePod:
    name: str
    grace_seconds: int | None = None
    """None: the pod's own terminationGracePeriodSeconds; 0: force-delete."""


@dataclass(frozen=True)
class PatchPod:
    """Merge-patch a worker pod's labels and annotations (an in-place restart moves a kept pod
    to the new attempt)."""

    name: str
    labels: dict[str, str | None]
    """None removes the label (a promoted spare's `hlat.dev/spare`)."""
    annotations: dict[str, str]


@dataclass(frozen=True)
class PatchLease:
    """Merge-patch a worker Lease's annotations (the operator's checkpoint request); a Lease
    that is gone needs nothing."""

    name: str
    annotations: dict[str, str]


@dataclass(frozen=True)
class DeleteObject:
    kind: Literal["Lease", "PodDisruptionBudget"]
    name: str


@dataclass(frozen=True)
class DeleteJob:
    """ttlSecondsAfterFinished elapsed: delete the PretrainJob (and, by ownership, the rest)."""


@dataclass(frozen=True)
class SetWorkloadActive:
    """Set the job's Kueue Workload's spec.active (false: Kueue evicts it, and it holds no quota
    until it is active again)."""

    active: bool


Action = (PatchState | PatchStatus | EmitEvent | CreateObject | DeletePod | PatchPod | PatchLease
          | DeleteObject | DeleteJob | WriteWorkloadStatus | SetWorkloadActive)


@dataclass(frozen=True)
class Decision:
    actions: list[Action]
    """In order; the executor stops at the first failure."""
    requeue_after: float | None
    """Seconds until the next pass without an event; None: wait for one."""
    status: PretrainJobStatus
    """The status after this pass, whether or not it is written now (metrics read it)."""
    fault: Fault | None = None
    """The fault detected in this pass (it may have ended the job instead of restarting)."""
    restarted: bool = False
    """The fault led to a gang restart (restarts.total grew)."""
    recovered_seconds: float | None = None
    """Set on the pass a restarted gang became Ready: seconds since the fault."""
    heartbeat_ages: dict[str, float] = field(default_factory=dict)
    unschedulable_seconds: float = 0.0
    queued_seconds: float = 0.0
    """How long the job has waited for Kueue to admit it (again); 0 while admitted."""
    """How long the longest-waiting worker pod of the attempt has been unschedulable."""
    slowdowns: dict[str, float] = field(default_factory=dict)
    """Each node's compute time over the median of the other nodes' (stragglers.slowdowns)."""
    stragglers: list[str] = field(default_factory=list)
    """The nodes flagged now by the job's own rule (threshold and window): those the Straggler
    condition names."""


# --- the pass --------------------------------------------------------------------------------


class _Pass:
    """One decision in the making: the new status and state, and the actions so far."""

    def __init__(
        self,
        status: PretrainJobStatus,
        observed: Observed,
        now: datetime,
        settings: OperatorSettings,
    ) -> None:
        self.old, self.observed, self.now, self.settings = status, observed, now, settings
        self.status = status.model_copy(deep=True)
        self.state = observed.state
        self.actions: list[Action] = []
        self.events: list[EmitEvent] = []
        self.requeue: float | None = None
        self.fault: Fault | None = None
        self.restarted = False
        self.recovered: float | None = None
        self.force_write = False
        self.unschedulable = 0.0
        self.desired: PretrainJobSpec | None = None
        """The spec as written (an elastic job's size is spec.nodes there), beside the
        effective spec the pass works with (`_sized`)."""
        self.queued = 0.0
        self.lead: Heartbeat | None = None
        """Node rank 0's heartbeat of the attempt the status had when the pass began."""
        self.lost_work = 0.0
        self.snapshot_step = -1
        """The newest in-memory snapshot every worker of the attempt reports holding (-1:
        none): what a restart in place resumes from, when its pods are kept."""
        self.slowdowns: dict[str, float] = {}
        self.flagged: list[str] = []
        self.leaving: set[str] = set()
        """Pods this pass's restart must not keep, though nothing is wrong with them yet (a
        straggler's, moved off its node)."""
        self.straggler_share = 0.0
        """The share of each step a flagged slow node costs now (goodput's `straggler`
        cause)."""
        self.straggler_window_seconds = 0.0
        """On the pass that flags a node: what it cost over its window, until the last pass
        (known to be a straggler's only now)."""

    @property
    def stamp(self) -> str:
        return format_time(self.now)

    def after(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(EmitEvent("Warning" if warning else "Normal", reason, message))

    def condition(self, type_: str, true: bool, reason: str, message: str) -> None:
        conds = self.status.conditions
        value: Literal["True", "False"] = "True" if true else "False"
        for i, c in enumerate(conds):
            if c.type == type_:
                moved = c.status != value
                conds[i] = c.model_copy(
                    update={
                        "status": value,
                        "reason": reason if true or moved else c.reason,
                        "message": message if true or moved else c.message,
                        "last_transition_time": self.stamp if moved else c.last_transition_time,
                    }
                )
                return
        if true or type_ in ("Ready", "Schedulable"):
            conds.append(
                Condition.model_validate(
                    {
                        "type": type_,
                        "status": value,
                        "reason": reason,
                        "message": message,
                        "last_transition_time": self.stamp,
                    }
                )
            )

    def phase(self, phase: Phase, reason: str, message: str, warning: bool = False) -> None:
        """Move to `phase`, with its condition True and the other phase conditions False."""
        if self.status.phase == phase:
            return
        self.status.phase = phase
        for type_ in PHASE_CONDITIONS:
            keep_restarting = type_ == "Restarting" and phase == "Pending"
            if type_ == phase:
                self.condition(type_, True, reason, message)
            elif not keep_restarting:
                self.condition(type_, False, reason, message)
        if phase != "Running":
            self.condition("Ready", False, reason, message)
        if phase in TERMINAL:
            self.status.completion_time = self.stamp
        if phase in TERMINAL or phase == "Suspended":
            # drains may go ahead from now on; a budget left by a failed delete blocks nothing
            # (evicting a finished pod ignores budgets) and goes with the job
            self.actions.append(DeleteObject(
                "PodDisruptionBudget", builders.pod_disruption_budget_name(self.observed.job)))
        self.event(reason, message, warning)

    def finish(self, spec: PretrainJobSpec | None) -> Decision:
        self.status.reason = phase_reason(self.status)
        _account_uptime(self)
        _account_goodput(self)
        # microseconds: a stamp truncated to the second would add up to 1 s of uptime per
        # write (about +25% running time with 2 s status writes). In the status, so that the
        # figures and the time they run to are written together or not at all.
        self.status.accounted_at = format_micro_time(self.now)
        self.status.observed_generation = self.observed.generation
        write = _should_write(self)
        head: list[Action] = []
        # the state annotation only when the state changed (a fault, a new attempt): a
        # status refresh is one write, so one watch event for every client of the job
        if _state_moved(self):
            head.append(PatchState(self.state.to_annotation()))
        if write:
            head.append(
                PatchStatus(
                    merge_patch(_dump(self.old), _dump(self.status)),
                    self.observed.resource_version,
                )
            )
        ages = heartbeat_ages(self.observed, self.status.attempt, self.now) if spec else {}
        return Decision(
            actions=[*head, *self.events, *self.actions],
            requeue_after=self.requeue,
            status=self.status
            if write
            else self.old.model_copy(
                update={"progress": self.status.progress, "uptime": self.status.uptime,
                        "goodput": self.status.goodput}  # accounted_at stays: not written
            ),
            fault=self.fault,
            restarted=self.restarted,
            recovered_seconds=self.recovered,
            heartbeat_ages=ages,
            unschedulable_seconds=self.unschedulable,
            queued_seconds=self.queued,
            slowdowns=self.slowdowns,
            stragglers=self.flagged,
        )


def _dump(status: PretrainJobStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` as a JSON merge patch (RFC 7386) over `old`: a key `old` has and `new` lacks is
    sent as null, which deletes it (a patch that leaves it out would keep it)."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        patch[key] = (merge_patch(before, value)
                      if isinstance(value, dict) and isinstance(before, dict) else value)
    patch.update({key: None for key in old if key not in new})
    return patch


def decide(
    spec: Mapping[str, Any] | PretrainJobSpec,
    status: PretrainJobStatus,
    observed: Observed,
    now: datetime,
    settings: OperatorSettings,
) -> Decision:
    """The next step for one PretrainJob. `spec` may be raw (as stored): invalid is Failed."""
    p = _Pass(status, observed, now, settings)
    if status.phase in TERMINAL:
        _terminal(p, spec)
        _finish_workload(p)
        _evaluate(p, spec)
        return p.finish(None)
    parsed = _parse(p, spec)
    if parsed is None:
        return p.finish(None)
    _update_progress(p, parsed)
    _expire_avoided(p, parsed)
    if parsed.suspend and not _checkpoint_before_stop(p, parsed, Reason.SUSPENDED,
                                                      "spec.suspend is true"):
        _suspend(p)
        _suspend_workload(p)
        return p.finish(parsed)
    admitted = _admission(p, parsed)
    if admitted is not None:
        admitted = _sized(p, parsed, admitted)
    if admitted is None:
        pass  # held by Kueue
    elif status.phase == "Suspended":
        _resume(p, admitted)
    elif _deadline_passed(p, admitted):
        pass
    elif status.phase == "Restarting":
        _restarting(p, admitted)
    else:
        _active(p, admitted)
    _evaluate(p, parsed)
    return p.finish(admitted or parsed)


def _evaluate(p: _Pass, spec: Mapping[str, Any] | PretrainJobSpec) -> None:
    """Evaluation Jobs on durable checkpoints (spec.evaluation): start one on the latest
    checkpoint when it is due, and report those that finished. They never change the phase,
    and go on after the training ended (the last checkpoint's evaluation runs then)."""
    if p.observed.evaluations is None:
        return
    if not isinstance(spec, PretrainJobSpec):
        try:
            spec = parse_spec(spec)
        except InvalidSpecError:
            return
    latest = p.status.latest_checkpoint.step if p.status.latest_checkpoint else None
    job = p.observed.job
    # a spec never edited had spec.evaluation from the start: every due checkpoint was held
    plan = evaluations.plan(spec, job.name, p.status.evaluations, p.observed.evaluations,
                            latest, from_start=p.observed.generation == 1)
    p.status.evaluations = plan.entries
    for done in plan.finished:
        if done.phase == "Succeeded":
            scores = ", ".join(f"{k} {v:.6g}" for k, v in done.results.items())
            p.event(Reason.EVALUATED, f"checkpoint step {done.step}: {scores}")
        else:
            p.event(Reason.EVALUATION_FAILED, f"checkpoint step {done.step} (Job {done.job}): "
                    f"{done.message}; the training goes on", warning=True)
    for step in plan.start:
        assert spec.evaluation is not None
        obj = builders.build_evaluation_job(job, spec, step, p.settings)
        p.actions.append(CreateObject(obj, refused=Reason.EVALUATION_FAILED))
        p.event(Reason.EVALUATING, f"evaluating the checkpoint of step {step} with Job "
                f"{obj['metadata']['name']} ({' '.join(spec.evaluation.command)})")


def phase_reason(status: PretrainJobStatus) -> str | None:
    """status.reason: the reason of the phase's condition (Pending has none of its own: the
    Schedulable condition's while False, else the reason the phase conditions went False with
    when the job became Pending)."""
    by_type = {c.type: c for c in status.conditions}
    if status.phase == "Pending":
        held = by_type.get("Schedulable")
        if held is not None and held.status == "False":
            return held.reason
        running = by_type.get("Running")
        return running.reason if running is not None else None
    cond = by_type.get(status.phase)
    return cond.reason if cond is not None and cond.status == "True" else None


def reject(
    status: PretrainJobStatus,
    observed: Observed,
    now: datetime,
    settings: OperatorSettings,
    message: str,
) -> Decision:
    """The API server refused, for good, an object the job needs: end it Failed with the
    server's message (and stop whatever pods it has), rather than retry forever."""
    p = _Pass(status, observed, now, settings)
    if status.phase not in TERMINAL:
        _fail(p, Reason.REJECTED, f"the API server refused an object the job needs: {message}")
    return p.finish(None)


def _parse(p: _Pass, spec: Mapping[str, Any] | PretrainJobSpec) -> PretrainJobSpec | None:
    try:
        parsed = spec if isinstance(spec, PretrainJobSpec) else parse_spec(spec)
    except InvalidSpecError as err:
        message = "; ".join(f"{path}: {reason}" for path, reason in err.problems)
        _fail(p, Reason.INVALID_SPEC, message)
        return None
    if builders.resolve_image(parsed, p.settings) is None:
        _fail(
            p,
            Reason.INVALID_SPEC,
            "spec.image: required (the trainer image) and the "
            "operator has no default image (HLAT_OPERATOR_DEFAULT_IMAGE)",
        )
        return None
    problem = builders.checkpoint_volume_problem(parsed)
    if problem is not None:
        _fail(p, Reason.INVALID_SPEC, problem)
        return None
    return parsed


def _fail(p: _Pass, reason: Reason, message: str) -> None:
    p.phase("Failed", reason, message, warning=True)
    _teardown(p, p.observed.pods, keep_finished=True)


# --- terminal, suspend, deadline ---------------------------------------------------------------


def _terminal(p: _Pass, spec: Mapping[str, Any] | PretrainJobSpec) -> None:
    """Finished jobs keep their finished pods (logs); stragglers are stopped; TTL applies."""
    _teardown(p, p.observed.pods, keep_finished=True)
    raw_ttl = (
        spec.ttl_seconds_after_finished
        if isinstance(spec, PretrainJobSpec)
        else (spec.get("ttlSecondsAfterFinished"))
    )
    done = parse_time(p.status.completion_time)
    if isinstance(raw_ttl, int) and done is not None:
        left = raw_ttl - (p.now - done).total_seconds()
        if left <= 0:
            p.actions.append(DeleteJob())
        else:
            p.after(left)


def _suspend(p: _Pass) -> None:
    if p.status.phase != "Suspended":
        p.phase("Suspended", Reason.SUSPENDED, "spec.suspend is true: pods deleted, progress kept")
    if not _teardown(p, p.observed.pods):
        p.after(p.settings.fast_requeue_seconds)


def _resume(p: _Pass, spec: PretrainJobSpec) -> None:
    if not _teardown(p, p.observed.pods):
        p.after(p.settings.fast_requeue_seconds)
        return
    ran_before = p.status.start_time is not None
    _new_attempt(p, spec, p.status.attempt + 1 if ran_before else p.status.attempt)
    q = p.observed.queueing
    if q is None:
        p.phase("Pending", Reason.RESUMED, f"resumed as attempt {p.status.attempt}")
        return
    how = (f"resumed as attempt {p.status.attempt} from the latest complete checkpoint"
           if ran_before else f"attempt {p.status.attempt} starts")
    p.phase("Pending", Reason.ADMITTED, f"{queueing.admitted_message(q)}; {how}")


# --- Kueue -----------------------------------------------------------------------------------


def _admission(p: _Pass, spec: PretrainJobSpec) -> PretrainJobSpec | None:
    """A job in a Kueue queue runs only while its Workload is admitted: the spec with the
    admission's flavors applied then; None while it waits or after an eviction (phase
    Suspended, no pods, nothing counted). Not in a queue: the spec as it is."""
    q = p.observed.queueing
    if q is None:
        _stop_no_longer_asked(p, spec)
        return spec
    if p.state.deactivated_workload:  # resumed: back into the queue
        p.state = p.state.model_copy(update={"deactivated_workload": False})
        if q.workload is not None and not q.workload.active:
            p.actions.append(SetWorkloadActive(True))
            _hold(p, Reason.QUEUED, f"spec.suspend is false: Workload {q.workload.name} "
                  f"activated again, waiting in LocalQueue {q.queue} for Kueue to admit it")
            return None
    match queueing.state(q):
        case "admitted":
            _stop_no_longer_asked(p, spec)
            return queueing.admitted_spec(spec, q)
        case "evicted" if _checkpoint_before_stop(p, spec, Reason.EVICTED_BY_KUEUE,
                                                  queueing.eviction(q)):
            return queueing.admitted_spec(spec, q)
        case "absent" if q.priority_class and q.priority is None:
            _hold(p, Reason.QUEUED, f"WorkloadPriorityClass {q.priority_class} (the label "
                  f"{queueing.PRIORITY_LABEL}) not found: create it or remove the label")
        case "absent":
            p.actions.append(CreateObject(queueing.build_workload(p.observed.job, spec, q,
                                                                  p.settings)))
            _hold(p, Reason.QUEUED, queueing.wait_message(q))
        case "evicted":
            if _hold(p, Reason.EVICTED_BY_KUEUE, queueing.eviction_message(q)):
                p.actions.append(WriteWorkloadStatus(tuple(queueing.released_conditions(q)),
                                                     clear_admission=True))
        case _:
            _hold(p, Reason.QUEUED, queueing.wait_message(q))
    return None


def _sized(p: _Pass, desired: PretrainJobSpec, spec: PretrainJobSpec) -> PretrainJobSpec:
    """The spec at the job's current size (spec.elastic: the size is state, changed by
    `_shrink` and `_grow`)."""
    p.desired = desired
    nodes = p.state.size or desired.nodes
    old = p.status.size
    if old is None or (old.nodes, old.desired) != (nodes, desired.nodes):
        p.status.size = _size(nodes, desired.nodes, p.stamp if old is not None else None,
                              old.resizes if old is not None else [])
    return elastic.effective(spec, p.state.size)


def _as_written(p: _Pass, spec: PretrainJobSpec) -> PretrainJobSpec:
    """The trainers' ConfigMap: an elastic job's spec at its full size, with its `elastic`,
    whatever size the attempt runs at. The trainers size it from the world they were started
    in (`PretrainJobSpec.at_world`), so a job resized in place (its pods, and their mounted
    copy of the file, kept) needs no new file; a kubelet refreshes a mounted ConfigMap only
    at its sync period, up to a minute or more later."""
    d = p.desired
    if d is None or d.elastic is None or spec.elastic is not None:
        return spec
    return spec.model_copy(update={"nodes": d.nodes, "elastic": d.elastic})


def _size(nodes: int, desired: int, since: str | None, resizes: list[Resize]) -> Size:
    return Size(nodes=nodes, desired=desired, text=f"{nodes}/{desired}", since=since,
                resizes=resizes[-elastic.MAX_RESIZES:])


def _elastic(p: _Pass, desired: PretrainJobSpec) -> bool:
    return elastic.applies(desired, p.observed.queueing is not None)


def _shrink(p: _Pass, spec: PretrainJobSpec) -> bool:
    """An elastic job whose pods could not all be placed for elastic.waitSeconds restarts on
    the largest size the usable nodes hold (that keeps the global batch, not below minNodes)."""
    d = p.desired
    if d is None or d.elastic is None or not _elastic(p, d) or p.unschedulable <= 0:
        return False
    wait, waited = d.elastic.wait_seconds, max(p.unschedulable, _since_node_fault(p))
    if waited < wait:
        p.after(wait - waited)
        return False
    if not p.observed.nodes_known:
        return False
    count = _usable_count(p, d)
    target = elastic.shrink_to(d, spec.nodes, count)
    if target is None:
        return False  # below minNodes: Schedulable=False says why it waits
    _shrink_to(p, spec, target, count, waited)
    return True


def _usable_count(p: _Pass, desired: PretrainJobSpec) -> int:
    """How many nodes an elastic job may train on now (`elastic.usable`)."""
    return elastic.usable(p.observed.nodes.values(), builders.node_selector(desired),
                          _failed_nodes(p, desired))


def _shrink_to(p: _Pass, spec: PretrainJobSpec, target: int, count: int, waited: float
               ) -> None:
    d = p.desired
    assert d is not None and d.elastic is not None
    _resize(p, d, target, Reason.SHRUNK,
            f"{count} usable nodes for {spec.nodes} workers, short for {waited:.0f}s "
            f"(elastic.waitSeconds={d.elastic.wait_seconds:g}): restarting on {target} of "
            f"{d.nodes} nodes from the latest complete checkpoint, the same global batch"
            f"{elastic.pace(d, target)}")


def _shrink_off_lost(p: _Pass, spec: PretrainJobSpec, gone: list[ObservedPod]) -> bool:
    """An elastic job restarting in place after a node loss, with no node to take the lost
    rank (no spare, no free node) and nothing else in the way (any pod still going is on a
    dead node: its kubelet will never confirm it gone), waits in Restarting until
    elastic.waitSeconds have passed since the loss, then shrinks, keeping the pods that run:
    True while it waits or once it resized. A node that comes in the meantime ends the wait
    (False: the restart goes on as before). Not an attempt with a pod of the lost rank that no
    node takes, after the force-delete of the lost one (60 s by default), and then a second
    restart: the kept trainers restart once, at the new size, from their warm standbys."""
    d = p.desired
    failure = p.status.last_failure
    if (d is None or d.elastic is None or not _elastic(p, d) or not p.observed.nodes_known
            or failure is None or failure.reason not in labels.NODE_REASONS
            or not _only_dead_left(p, gone)):
        return False
    count = _usable_count(p, d)
    target = elastic.shrink_to(d, spec.nodes, count) if count < spec.nodes else None
    if target is None:
        return False  # a node to take the lost rank, or none below minNodes: as before
    since = parse_time(failure.time) or p.now
    waited, wait = (p.now - since).total_seconds(), d.elastic.wait_seconds
    if waited < wait:
        said = (f"{count} usable nodes for {spec.nodes} workers: waiting for a node until "
                f"{format_time(since + timedelta(seconds=wait))} (elastic.waitSeconds={wait:g} "
                f"from the loss), then restarting on {target} nodes")
        shown = next((c for c in p.status.conditions if c.type == "Restarting"), None)
        if shown is None or shown.message != said:
            p.condition("Restarting", True, failure.reason, said)
            p.event(Reason.UNSCHEDULABLE, said, warning=True)
        p.after(wait - waited)
        return True
    _shrink_to(p, spec, target, count, waited)
    return True


def _since_node_fault(p: _Pass) -> float:
    """Seconds since the node-level fault that ended the previous attempt (0 for any other
    start): a job short of nodes because one was lost has waited since the loss was found,
    not only since the new gang's pod was found unplaceable."""
    failure = p.status.last_failure
    if (failure is None or failure.reason not in labels.NODE_REASONS
            or p.state.faulted_attempt != p.status.attempt - 1):
        return 0.0
    since = parse_time(failure.time)
    return (p.now - since).total_seconds() if since is not None else 0.0


def _grow(p: _Pass, spec: PretrainJobSpec) -> bool:
    """An elastic job below spec.nodes whose usable nodes hold a larger size restarts on it
    once a checkpoint newer than the latest when it saw them is complete (no work lost),
    asked for from the workers at once (`_ask_checkpoint`)."""
    d = p.desired
    if (d is None or d.elastic is None or not _elastic(p, d) or spec.nodes >= d.nodes
            or not p.observed.nodes_known):
        return False
    count = _usable_count(p, d)
    target = elastic.grow_to(d, spec.nodes, count)
    latest = p.status.latest_checkpoint.step if p.status.latest_checkpoint else -1
    if target is None:
        if p.state.grow_after is not None:
            p.state = p.state.model_copy(update={"grow_after": None})
        return False
    if p.state.grow_after is None:
        p.state = p.state.model_copy(update={"grow_after": latest})
        after = (f"a checkpoint newer than step_{latest}" if latest >= 0
                 else "its first checkpoint")
        p.event(Reason.GROWN, f"{count} usable nodes: growing to {target} of {d.nodes} nodes "
                f"once {after} is complete (asked for now)")
    seen = p.state.grow_after
    if seen is not None and latest <= seen:
        # asked for now, not an interval on: one request value until it completes
        _ask_checkpoint(p, max(seen, 0) + 1)
        p.after(queueing.POLL_SECONDS)
        return False
    _resize(p, d, target, Reason.GROWN,
            f"{count} usable nodes and checkpoint step_{latest} complete: restarting on "
            f"{target} of {d.nodes} nodes from it{elastic.pace(d, target)}")
    return True


def _resize(p: _Pass, desired: PretrainJobSpec, target: int, reason: Reason,
            message: str) -> None:
    """A planned restart at `target` nodes: no restart budget, no backoff. Under InPlace the
    pods running on usable nodes stay (up to `target` of them, lowest ranks first) and their
    launchers restart the trainers at the new size (`_in_place_attempt`: the ranks beyond it
    move down to the free ones, the record says the size; a pod made when it grows back
    takes a free host name where a moved pod keeps its rank's: `_host_indices`); the others,
    and the pods no node took, are deleted. Otherwise the gang is recreated."""
    kept = sorted((pod for pod in p.observed.pods if not pod.spare and pod.node
                   and pod.phase == "Running" and _keepable(p, pod, p.status.attempt)),
                  key=lambda pod: pod.rank or 0)[:target]
    in_place = (builders.in_place(desired)
                and p.state.in_place_failures < IN_PLACE_FAILURES_BEFORE_RECREATE)
    p.state = p.state.model_copy(update={
        "size": None if target == desired.nodes else target, "grow_after": None,
        "in_place_next": p.status.attempt + 1 if in_place else None, **_NO_SPELLS})
    old = p.status.size.resizes if p.status.size is not None else []
    p.status.size = _size(target, desired.nodes, p.stamp,
                          [*old, Resize(nodes=target, at=p.stamp, reason=str(reason))])
    p.condition("Degraded", target < desired.nodes, reason,
                message if target < desired.nodes else f"back to all {target} nodes")
    said = message + ("; the pods stay, their trainers restart at the new size" if in_place
                      else "")
    if p.status.phase == "Restarting":  # a shrink while the restart after a loss waited
        p.condition("Restarting", True, reason, said)
        p.event(reason, said)
    else:
        p.phase("Restarting", reason, said)
    if in_place:
        p.leaving |= {pod.name for pod in p.observed.pods if not pod.spare} - {
            pod.name for pod in kept}
        _teardown(p, _gone(p, desired))
    else:
        _teardown(p, p.observed.pods)
    p.after(p.settings.fast_requeue_seconds)


def _suspend_workload(p: _Pass) -> None:
    """A suspended job in a queue gives its quota back: its Workload is deactivated (Kueue
    evicts it, reason Deactivated) and, once the pods are gone, its reservation released, as
    after any eviction; `_admission` activates it again when the job resumes."""
    q = p.observed.queueing
    w = q.workload if q is not None else None
    if q is None or w is None:
        return
    if w.active:
        if not p.state.deactivated_workload:
            p.state = p.state.model_copy(update={"deactivated_workload": True})
            p.event(Reason.SUSPENDED, f"spec.suspend is true: Workload {w.name} deactivated, "
                    f"its quota in LocalQueue {q.queue} released")
        p.actions.append(SetWorkloadActive(False))
        p.after(queueing.POLL_SECONDS)
    elif queueing.state(q) == "evicted" and not p.observed.pods:
        p.actions.append(WriteWorkloadStatus(tuple(queueing.released_conditions(q)),
                                             clear_admission=True))
    elif queueing.state(q) == "evicted":
        p.after(queueing.POLL_SECONDS)


def _checkpoint_before_stop(p: _Pass, spec: PretrainJobSpec, reason: Reason, why: str) -> bool:
    """Whether a running attempt told to stop (Kueue evicted it; spec.suspend) trains on until
    a checkpoint it was asked for is complete (meanwhile the pass goes on as for a running
    job: a fault ends the wait): only a Ready gang with steps left, asked once
    (`CHECKPOINT_REQUEST` on its Leases: the step it has reported, plus one; its workers agree
    on a step at or after it and save it), and only until a checkpoint at or after that step
    is complete or settings.eviction_checkpoint_seconds have passed (a trainer that does not
    answer). The job then resumes where it stopped, not a checkpoint interval back."""
    latest = p.status.latest_checkpoint.step if p.status.latest_checkpoint else -1
    bound = p.settings.eviction_checkpoint_seconds
    since = parse_time(p.state.stop_asked_since)
    if since is not None:
        until = p.state.stop_after_checkpoint
        waited = (p.now - since).total_seconds()
        if (until is None or latest >= until or waited >= bound
                or p.status.phase != "Running"):  # a fault meanwhile: nothing to wait for
            return False
        _ask_checkpoint(p, until)  # again: a write lost is retried, an unchanged one
        p.after(min(queueing.POLL_SECONDS, bound - waited))  # changes nothing
        return True
    ready = _has_condition(p, "Ready", "True") and p.status.phase == "Running"
    step = p.status.progress.step
    if not ready or bound <= 0 or step >= spec.total_steps:
        return False
    until = step + 1
    p.state = p.state.model_copy(update={"stop_asked_since": p.stamp,
                                         "stop_after_checkpoint": until})
    _ask_checkpoint(p, until)
    p.event(reason, f"{why}; the workers write a checkpoint now (step {until} or later) and "
            f"stop once it is complete, within {bound:g}s")
    p.after(queueing.POLL_SECONDS)
    return True


def _ask_checkpoint(p: _Pass, request: int) -> None:
    """Ask the attempt's workers for a checkpoint now: `request` on the Lease of each node rank
    that has a pod (node local rank 0's heartbeat reads it from its next renewal's answer)."""
    job, attempt = p.observed.job, p.status.attempt
    ranks = sorted({pod.rank for pod in p.observed.pods
                    if pod.attempt == attempt and pod.rank is not None and not pod.spare})
    for rank in ranks:
        p.actions.append(PatchLease(labels.worker_lease_name(job.name, attempt, rank),
                                    {CHECKPOINT_REQUEST: str(request)}))


def _stop_no_longer_asked(p: _Pass, spec: PretrainJobSpec) -> None:
    """The job runs on (admitted again; spec.suspend false again): a stop asked for is over."""
    if p.state.stop_asked_since is not None and not spec.suspend:
        p.state = p.state.model_copy(update={"stop_asked_since": None,
                                             "stop_after_checkpoint": None})


def _hold(p: _Pass, reason: Reason, message: str) -> bool:
    """Phase Suspended for `reason` (its message kept current) with no pods; True once none is
    left."""
    if p.status.phase != "Suspended":
        p.phase("Suspended", reason, message)
    else:
        p.condition("Suspended", True, reason, message)
    held = next((c for c in p.status.conditions if c.type == "Suspended"), None)
    since = parse_time(held.last_transition_time if held else None)
    p.queued = (p.now - since).total_seconds() if since is not None else 0.0
    if _teardown(p, p.observed.pods):
        return True
    p.after(p.settings.fast_requeue_seconds)
    return False


def _finish_workload(p: _Pass) -> None:
    """An ended job's Workload is Finished, which frees its quota."""
    q = p.observed.queueing
    if q is None or q.workload is None or q.workload.true("Finished"):
        return
    said = next((c.message for c in p.status.conditions if c.type == p.status.phase), "")
    p.actions.append(WriteWorkloadStatus(tuple(queueing.finished_conditions(p.status.phase,
                                                                            said))))
    p.after(queueing.POLL_SECONDS)


def _deadline_passed(p: _Pass, spec: PretrainJobSpec) -> bool:
    start = parse_time(p.status.start_time)
    limit = spec.active_deadline_seconds
    if limit is None or start is None:
        return False
    left = limit - (p.now - start).total_seconds()
    if left > 0:
        p.after(left)
        return False
    _fail(p, Reason.DEADLINE_EXCEEDED, f"ran longer than activeDeadlineSeconds={limit}")
    return True


# --- tearing a gang down ---------------------------------------------------------------------


def _teardown(p: _Pass, pods: list[ObservedPod], keep_finished: bool = False) -> bool:
    """Delete these pods; True once none is left. Pods stuck terminating on a dead node past
    the bound are force-deleted: their kubelet will never confirm. `keep_finished` keeps the
    pods whose trainer ended (their logs), except those a sidecar keeps running."""
    left = False
    for pod in pods:
        if keep_finished and pod.finished and not pod.lingering:  # kept for their logs
            continue
        left = True
        if not pod.terminating:
            p.actions.append(DeletePod(pod.name))
            continue
        assert pod.deletion_timestamp is not None
        stuck = (p.now - pod.deletion_timestamp).total_seconds()
        dead = pod.node is None or _on_dead_node(p, pod)
        if stuck >= p.settings.force_delete_after_seconds and dead:
            p.actions.append(DeletePod(pod.name, grace_seconds=0))
            p.event(
                Reason.FORCE_DELETED,
                f"pod {pod.name} was stuck terminating on "
                f"unreachable node {pod.node} for {stuck:.0f}s",
                warning=True,
            )
    return not left


def _newer_pods(p: _Pass) -> bool:
    """Pods of an attempt the status does not know yet: our view of the job is stale."""
    return any(
        pod.attempt is not None and pod.attempt > p.status.attempt for pod in p.observed.pods
    )


def _restarting(p: _Pass, spec: PretrainJobSpec) -> None:
    if _newer_pods(p):
        p.after(p.settings.fast_requeue_seconds)
        return
    in_place = p.state.in_place_next == p.status.attempt + 1
    gone = _gone(p, spec) if in_place else p.observed.pods
    torn_down = _teardown(p, gone)
    if in_place and _shrink_off_lost(p, spec, gone):
        return
    if not torn_down and not (in_place and _spares_cover(p, spec, gone)):
        p.after(p.settings.fast_requeue_seconds)
        return
    delay = spec.fault_tolerance.backoff.delay_seconds(p.state.no_progress_streak)
    if _resizing(p.status):
        delay = 0.0  # a planned resize: nothing failed
    failure = p.status.last_failure
    since = parse_time(failure.time if failure else None) or p.now
    left = delay - (p.now - since).total_seconds()
    if left > 0:
        waiting = next((c for c in p.status.conditions if c.type == "Restarting"), None)
        if waiting is not None and waiting.reason != Reason.BACKOFF:
            p.condition(
                "Restarting",
                True,
                Reason.BACKOFF,
                f"the old gang is gone; attempt "
                f"{p.status.attempt + 1} starts after a {delay:g}s backoff",
            )
        p.after(left)
        return
    waited = f"after {delay:g}s backoff" if delay else "at once (the last attempt made progress)"
    if in_place:
        how = _in_place_attempt(p, spec, p.status.attempt + 1)
        p.phase("Pending", Reason.CREATED,
                f"attempt {p.status.attempt} restarted in place {waited}: {how}; resuming "
                "from the latest complete checkpoint")
        return
    _new_attempt(p, spec, p.status.attempt + 1)
    p.phase("Pending", Reason.CREATED,
            f"attempt {p.status.attempt} created {waited}, resuming from the latest complete "
            "checkpoint")


# --- creating a gang -------------------------------------------------------------------------


def _failed_nodes(p: _Pass, spec: PretrainJobSpec) -> set[str]:
    """The job's avoid list as it stands (faultTolerance.avoidFailedNodes): failed nodes
    within their expiry."""
    return ({e.node for e in p.status.avoided_nodes}
            if spec.fault_tolerance.avoid_failed_nodes else set())


def _avoided_nodes(p: _Pass, spec: PretrainJobSpec) -> list[str]:
    """Nodes the next pods must not use: unhealthy ones, and the job's failed ones still
    within their expiry, unless that leaves fewer usable nodes than the job needs: then the
    least recently failed are let back first (a gang that cannot be placed helps nobody). An
    elastic job needs only its smallest size: short of nodes, it shrinks rather than go back to
    a node that failed it."""
    unhealthy = {n.name for n in p.observed.nodes.values() if not n.healthy}
    entries = p.status.avoided_nodes if spec.fault_tolerance.avoid_failed_nodes else []
    avoid = {e.node for e in entries}
    need = spec.nodes
    d = p.desired
    if d is not None and d.elastic is not None and _elastic(p, d):
        need = min(need, elastic.smallest(d))
    if p.observed.nodes_known:
        selector = builders.node_selector(spec)
        usable = {n.name for n in p.observed.nodes.values()
                  if elastic.can_host(n, selector) and n.name not in unhealthy}
        for entry in sorted(entries, key=lambda e: e.failed_at):
            if len(usable - avoid) >= need:
                break
            avoid.discard(entry.node)
    return sorted(avoid | unhealthy)


def _expire_avoided(p: _Pass, spec: PretrainJobSpec) -> None:
    """Drop avoided nodes whose time is up; wake up when the next one's is."""
    kept = []
    for entry in p.status.avoided_nodes:
        until = parse_time(entry.until)
        if until is not None and until <= p.now:
            p.event(Reason.SCHEDULED, f"node {entry.node} is no longer avoided "
                    f"(faultTolerance.avoidFailedNodesSeconds passed since it failed)")
            continue
        kept.append(entry)
        if until is not None:
            p.after((until - p.now).total_seconds())
    p.status.avoided_nodes = kept


def _new_attempt(p: _Pass, spec: PretrainJobSpec, attempt: int) -> None:
    """Move the status to `attempt` and create its gang (the status is written first)."""
    p.status.attempt = attempt
    p.status.start_time = p.status.start_time or p.stamp
    ckpt = p.status.latest_checkpoint.step if p.status.latest_checkpoint else None
    p.state = p.state.model_copy(update={"checkpoint_at_attempt_start": ckpt})
    p.force_write = True
    job = p.observed.job
    p.actions += [
        CreateObject(o)
        for o in (
            builders.build_service(job, p.settings),
            builders.build_service_account(job),
        )
    ]
    p.actions.append(CreateObject(builders.build_config_map(job, _as_written(p, spec)),
                                   replace=True))
    p.actions.append(CreateObject(builders.build_role(job, spec, attempt), replace=True))
    # after the Role: the API server resolves a binding's roleRef (RBAC escalation check),
    # and a binding to a Role that does not exist yet is rejected with 404 for the operator
    p.actions.append(CreateObject(builders.build_role_binding(job, spec), replace=True))
    if builders.uses_volcano(spec, p.settings):  # minMember: the size of this attempt
        p.actions.append(CreateObject(builders.build_pod_group(job, spec), replace=True))
    p.actions.append(CreateObject(builders.build_pod_disruption_budget(job, spec)))
    _attempt_leases(p, spec, attempt)
    placement = _topology(p, spec, range(spec.nodes))
    if placement is None:
        return  # no domain holds the gang yet: the pods come once one does (_create_missing)
    _say_placed(p, spec, placement)
    pods = builders.build_worker_pods(job, spec, attempt, p.settings, _avoided_nodes(p, spec),
                                      _steps_done(p), placement)
    p.actions += [CreateObject(pod) for pod in pods]


TOPOLOGY_RETRY_SECONDS = 10.0
"""How often a job waiting for a network-topology domain looks at the nodes again."""


def _topology(p: _Pass, spec: PretrainJobSpec, ranks: Iterable[int]
              ) -> dict[int, RankPlacement] | None:
    """Where each of `ranks`' pods goes under spec.scheduling.topology (unset: {}). A new
    gang gets a plan (topology.plan); a rank created again in a live gang goes next to its
    neighbours, in their domain. None: the required level has no domain with enough usable
    nodes (the Schedulable condition and an Event say so; looked at again shortly)."""
    topo = spec.scheduling.topology
    ranks = sorted(ranks)
    if topo is None or not ranks:
        return {}
    usable = _usable_nodes(p, spec)
    live = [pod for pod in p.observed.pods
            if pod.node and not pod.terminating and not pod.finished]
    gang = {pod.rank: p.observed.nodes[pod.node] for pod in live
            if not pod.spare and pod.rank is not None and pod.rank not in ranks
            and pod.node in p.observed.nodes}
    if gang:
        taken = {pod.node for pod in live}
        free = [n for n in usable if n.name not in taken]
        out: dict[int, RankPlacement] = {}
        for rank in ranks:
            out[rank] = place = topology.replacement(rank, free, gang, topo)
            if place.node:
                free = [n for n in free if n.name != place.node]
        return out
    ranked = topology.plan(usable, spec.nodes, topo) if p.observed.nodes_known else None
    if ranked is None and topo.preferred and not topo.slice_size:
        return {}  # fewer usable nodes than ranks, or none known yet: the scheduler's choice
    if ranked is None:
        _topology_waits(p, spec, usable)
        return None
    planned = topology.placements(ranked, topo)
    return {rank: planned[rank] for rank in ranks}


def _usable_nodes(p: _Pass, spec: PretrainJobSpec) -> list[ObservedNode]:
    """The nodes a worker of this job may run on now: of its instance type, healthy, not
    avoided."""
    return elastic.usable_nodes(p.observed.nodes.values(), builders.node_selector(spec),
                                set(_avoided_nodes(p, spec)))


def _domain_lost(p: _Pass, spec: PretrainJobSpec) -> str | None:
    """Under a required topology level, whether the gang must move: its domain (that of its
    pods' nodes) no longer has `spec.nodes` usable nodes (one lost, unhealthy or avoided)
    while another domain has. Then an in-place restart would leave the lost ranks' pods
    unschedulable for good, and the gang is recreated and planned afresh; says where to. None
    otherwise (where no domain holds the gang, it waits in its own for the node to return)."""
    topo = spec.scheduling.topology
    if topo is not None and topo.slice_size and p.observed.nodes_known:
        return _slice_domain_lost(p, spec, topo)
    if topo is None or topo.required is None or not p.observed.nodes_known:
        return None
    level, nodes = topo.required, p.observed.nodes
    values = {nodes[pod.node].labels.get(level, "") for pod in p.observed.pods
              if pod.node in nodes and not pod.spare and pod.rank is not None} - {""}
    if len(values) != 1:
        return None
    value = values.pop()
    usable = _usable_nodes(p, spec)
    left = sum(n.labels.get(level) == value for n in usable)
    if left >= spec.nodes:
        return None
    ranked = topology.plan(usable, spec.nodes, topo)
    if ranked is None:
        return None
    return (f"its domain {level}={value} has {left} usable nodes of the {spec.nodes} it needs, "
            f"so it moves to {level}={ranked[0].labels.get(level, '')}")


def _slice_domain_lost(p: _Pass, spec: PretrainJobSpec, topo: TopologySpec) -> str | None:
    """`_domain_lost` with slices (`sliceSize`): a domain of the slice level no longer has
    usable nodes for the gang's slices there (an UltraServer lost a node) while whole slices
    can be had elsewhere; says where to."""
    level, size, nodes = topology.slice_level(topo), topo.slice_size or 1, p.observed.nodes
    need: dict[str, int] = {}
    for first in range(0, spec.nodes, size):
        values = {nodes[pod.node].labels.get(level, "") for pod in p.observed.pods
                  if pod.node in nodes and not pod.spare and pod.rank is not None
                  and first <= pod.rank < first + size} - {""}
        if len(values) == 1:
            value = values.pop()
            need[value] = need.get(value, 0) + size
    usable = _usable_nodes(p, spec)
    short = [(value, wanted, sum(n.labels.get(level) == value for n in usable))
             for value, wanted in sorted(need.items())]
    short = [row for row in short if row[2] < row[1]]
    if not short:
        return None
    ranked = topology.plan(usable, spec.nodes, topo)
    if ranked is None:
        return None
    value, wanted, left = short[0]
    to = sorted({n.labels.get(level, "") for n in ranked})
    return (f"its domain {level}={value} has {left} usable nodes of the {wanted} its slices of "
            f"{size} need, so it moves to {', '.join(f'{level}={v}' for v in to)}")


def _topology_waits(p: _Pass, spec: PretrainJobSpec, usable: list[ObservedNode]) -> None:
    topo = spec.scheduling.topology
    assert topo is not None  # preferred waits only for whole slices
    level = topology.slice_level(topo)
    field = "required" if topo.required is not None else "preferred"
    if p.observed.nodes_known:
        value, size = topology.largest_domain(usable, level)
        holds = (f"domains hold whole slices of {topo.slice_size} for {spec.nodes} nodes"
                 if topo.slice_size else f"domain has {spec.nodes} usable nodes")
        why = (f"no {level} {holds} (the largest, {value}, has {size})" if value else
               f"no usable node carries the label {level} (EKS sets the "
               f"network-node-layer labels on trn1, trn2 and p5 nodes)")
    else:
        why = "the node list was not read yet"
    message = (f"scheduling.topology.{field}: {why}; no worker pods are created until one "
               f"does (looked at again every {TOPOLOGY_RETRY_SECONDS:g}s)")
    if not any(c.type == "Schedulable" and c.message == message for c in p.status.conditions):
        p.event(Reason.TOPOLOGY_UNAVAILABLE, message, warning=True)
    p.condition("Schedulable", False, Reason.TOPOLOGY_UNAVAILABLE, message)
    p.after(TOPOLOGY_RETRY_SECONDS)


def _say_placed(p: _Pass, spec: PretrainJobSpec, placement: dict[int, RankPlacement]) -> None:
    topo = spec.scheduling.topology
    if topo is None or not placement:
        return
    first = placement[min(placement)]
    where = (f"in {first.required[0]}={first.required[1]}" if first.required
             else f"preferring as few {topo.preferred} domains as hold them")
    nodes = ", ".join(f"{r}: {placement[r].node}" for r in sorted(placement))
    p.event(Reason.PLACED, f"{len(placement)} worker pods placed by network topology {where}; "
            f"planned nodes by rank (consecutive ranks share the lowest switch): {nodes}")


def _attempt_leases(p: _Pass, spec: PretrainJobSpec, attempt: int) -> None:
    """The attempt's heartbeat Leases (the older ones deleted) and, under InPlace, the
    restart record, written last: the launchers act on it."""
    job = p.observed.job
    keep = set(builders.lease_names(job, spec, attempt)) | {labels.gang_lease_name(job.name)}
    p.actions += [
        DeleteObject("Lease", name) for name in sorted(p.observed.leases) if name not in keep
    ]
    p.actions += [
        CreateObject(lease) for lease in builders.build_leases(job, spec, attempt, p.settings)
    ]
    if builders.in_place(spec):
        p.actions.append(CreateObject(
            builders.build_gang_lease(job, attempt, _steps_done(p)), replace=True))


def _in_place_attempt(p: _Pass, spec: PretrainJobSpec, attempt: int) -> str:
    """Move the kept pods to `attempt` and create the missing ranks' pods; returns what it did
    (the ranks kept, the spares promoted, the pods created), for the phase's one event.
    Order: status, then the Role naming only the new attempt's Leases (a trainer of the old
    one can no longer renew), the Leases, the pods, and the restart record last (the
    launchers restart their trainers when they read it)."""
    p.status.attempt = attempt
    p.status.restarts.in_place = (p.status.restarts.in_place or 0) + 1
    ckpt = p.status.latest_checkpoint.step if p.status.latest_checkpoint else None
    p.state = p.state.model_copy(update={
        "checkpoint_at_attempt_start": ckpt, "in_place_next": None, "in_place_attempt": attempt})
    p.force_write = True
    job = p.observed.job
    p.actions.append(CreateObject(builders.build_config_map(job, _as_written(p, spec)),
                                   replace=True))
    p.actions.append(CreateObject(builders.build_role(job, spec, attempt), replace=True))
    p.actions.append(CreateObject(builders.build_role_binding(job, spec), replace=True))
    # a no-op (AlreadyExists) but for a job started by an operator that made no budget
    p.actions.append(CreateObject(builders.build_pod_disruption_budget(job, spec)))
    keep = set(builders.lease_names(job, spec, attempt)) | {labels.gang_lease_name(job.name)}
    p.actions += [DeleteObject("Lease", n) for n in sorted(p.observed.leases) if n not in keep]
    p.actions += [CreateObject(lease)
                  for lease in builders.build_leases(job, spec, attempt, p.settings)]
    if builders.uses_volcano(spec, p.settings):  # minMember: this attempt's size
        p.actions.append(CreateObject(builders.build_pod_group(job, spec), replace=True))
    kept = _adopt(p, spec)
    moved = _compact(p, spec, kept)
    promoted = _promote_spares(p, spec, kept | set(moved.values()))
    renamed = {**moved, **promoted}
    master = _master(p, spec, renamed)
    created = _create_ranks(p, spec, kept | set(moved.values()) | set(promoted.values()),
                            master)
    p.actions.append(CreateObject(builders.build_gang_lease(
        job, attempt, _steps_done(p), {**_ranks(p, renamed), **created}, master, spec.nodes),
        replace=True))
    spared = (f", spares {', '.join(f'{n} -> rank {r}' for n, r in sorted(promoted.items()))}"
              if promoted else "")
    down = (f", {', '.join(f'{n} -> rank {r}' for n, r in sorted(moved.items()))} (the "
            f"ranks of {spec.nodes} nodes)" if moved else "")
    return (f"pods of node ranks {sorted(kept) or 'none'} kept{down}{spared}, {len(created)} "
            "created")


def _compact(p: _Pass, spec: PretrainJobSpec, have: set[int]) -> dict[str, int]:
    """A job resized in place to fewer nodes: the kept pods whose rank is beyond the new size
    take the ranks no kept pod holds, in rank order (label patch); returns pod -> rank."""
    missing = [r for r in range(spec.nodes) if r not in have]
    over = sorted((pod for pod in p.observed.pods
                   if not pod.spare and pod.rank is not None and pod.rank >= spec.nodes
                   and pod.name not in p.leaving and _keepable(p, pod, p.status.attempt)),
                  key=lambda pod: pod.rank or 0)
    out: dict[str, int] = {}
    for rank, pod in zip(missing, over, strict=False):
        out[pod.name] = rank
        p.actions.append(PatchPod(pod.name, {labels.NODE_RANK: str(rank)}, {}))
    return out


def _promote_spares(p: _Pass, spec: PretrainJobSpec, have: set[int]) -> dict[str, int]:
    """Give the ranks no kept pod holds to ready spares (label patch); returns pod -> rank."""
    missing = [r for r in range(spec.nodes) if r not in have]
    ready = sorted((pod for pod in p.observed.spare_pods() if _ready_spare(p, pod)),
                   key=lambda pod: pod.name)
    out: dict[str, int] = {}
    for rank, pod in zip(missing, ready, strict=False):
        out[pod.name] = rank
        p.actions.append(PatchPod(pod.name, {labels.ATTEMPT: str(p.status.attempt),
                                             labels.NODE_RANK: str(rank), labels.SPARE: None},
                                  {labels.ATTEMPT_STARTED: format_micro_time(p.now)}))
    if out:
        spares = p.status.spares or Spares(wanted=spec.fault_tolerance.spare_nodes)
        p.status.spares = spares.model_copy(update={"promoted": spares.promoted + len(out)})
    return out


def _ranks(p: _Pass, promoted: dict[str, int]) -> dict[str, int]:
    """Node rank per pod of the attempt (a launcher whose pod is named here takes that rank)."""
    ranks = {pod.name: pod.rank for pod in p.observed.pods
             if not pod.spare and pod.rank is not None and _keepable(p, pod, p.status.attempt)}
    return {**ranks, **promoted}


def _master(p: _Pass, spec: PretrainJobSpec, promoted: dict[str, int]) -> str | None:
    """Node rank 0's address when a spare took rank 0, or a kept pod holding rank 0 has a
    hostname other than rank 0's (it was a spare)."""
    job = p.observed.job
    service = labels.service_name(job.name)
    for name, rank in promoted.items():
        if rank == 0:
            pod = next(q for q in p.observed.pods if q.name == name)
            return f"{pod.hostname}.{service}" if pod.hostname else None
    for pod in p.observed.pods:
        if (pod.rank == 0 and not pod.spare and _keepable(p, pod, p.status.attempt)
                and pod.hostname and pod.hostname != labels.worker_hostname(job.name, 0)):
            return f"{pod.hostname}.{service}"
    return None


def _adopt(p: _Pass, spec: PretrainJobSpec) -> set[int]:
    """Move the keepable pods of earlier attempts to the status's attempt (one per rank; a
    rank already in the attempt keeps its pod); returns the ranks the attempt has."""
    attempt = p.status.attempt
    have = {pod.rank for pod in p.observed.pods_of(attempt) if _keepable(p, pod, attempt)}
    for pod in sorted(p.observed.pods, key=lambda q: -(q.attempt or 0)):
        if pod.attempt == attempt or not _keepable(p, pod, attempt) or pod.rank in have:
            continue
        assert pod.rank is not None
        have.add(pod.rank)
        p.actions.append(PatchPod(pod.name, {labels.ATTEMPT: str(attempt)},
                                  {labels.ATTEMPT_STARTED: format_micro_time(p.now)}))
    return {r for r in have if r is not None and r < spec.nodes}


def _create_ranks(p: _Pass, spec: PretrainJobSpec, have: set[int], master: str | None
                  ) -> dict[str, int]:
    """Create the pods of the ranks not in `have`, told node rank 0's address (`master`);
    returns pod -> rank of those created."""
    wanted = [r for r in range(spec.nodes) if r not in have]
    placement = _topology(p, spec, wanted)
    if placement is None:
        return {}
    pods = builders.build_worker_pods(p.observed.job, spec, p.status.attempt, p.settings,
                                      _avoided_nodes(p, spec), _steps_done(p), placement,
                                      master, _host_indices(p, wanted))
    missing = {rank: pod for rank, pod in enumerate(pods) if rank not in have}
    p.actions += [CreateObject(pod) for pod in missing.values()]
    return {pod["metadata"]["name"]: rank for rank, pod in missing.items()}


def _host_indices(p: _Pass, ranks: Iterable[int]) -> dict[int, int]:
    """The index in the name and host name of each new pod of `ranks`
    (`builders.build_worker_pod`): its rank, unless a live pod of the job has that host name
    (one that moved down a rank at a shrink keeps its own), then the lowest index above 0 that
    no live pod has (0 stays rank 0's: the default rendezvous address). A pod terminating or
    leaving gives its name up, as when a lost rank's pod is made again. Deterministic from the
    pods there are, so a pass that creates the rest of an attempt's pods names them alike."""
    job = p.observed.job.name
    held = {pod.hostname for pod in p.observed.pods if pod.hostname and not pod.terminating
            and not pod.finished and pod.name not in p.leaving}
    out: dict[int, int] = {}
    for rank in sorted(ranks):
        if labels.worker_hostname(job, rank) not in held:
            out[rank] = rank
    for rank in sorted(ranks):
        if rank in out:
            continue
        index = 1
        while labels.worker_hostname(job, index) in held or index in out.values():
            index += 1
        out[rank] = index
    return out


def _steps_done(p: _Pass) -> int:
    """The highest step node rank 0 of any attempt reported finishing: the next gang's steps
    up to it are recomputed work. Rank 0's, because its report carries the time those steps
    took (goodput counts each step's time once, from the report that covers it)."""
    return p.state.high_step


def _create_missing(p: _Pass, spec: PretrainJobSpec) -> None:
    """Pending with pods missing (first pass, or the operator stopped mid-creation)."""
    present = {pod.rank for pod in p.observed.pods_of(p.status.attempt)}
    if not present:
        if _topology(p, spec, range(spec.nodes)) is None:
            return  # waiting for a topology domain (said in Schedulable)
        _new_attempt(p, spec, p.status.attempt)
        if p.status.phase == "Pending" and not any(
            c.type == "Restarting" and c.status == "True" for c in p.status.conditions
        ):
            p.event(
                Reason.CREATED, f"created {spec.nodes} worker pods (attempt {p.status.attempt})"
            )
        return
    placement = _topology(p, spec, (r for r in range(spec.nodes) if r not in present))
    if placement is None:
        return
    wanted = [r for r in range(spec.nodes) if r not in present]
    pods = builders.build_worker_pods(
        p.observed.job, spec, p.status.attempt, p.settings, _avoided_nodes(p, spec),
        _steps_done(p), placement, _master(p, spec, {}), _host_indices(p, wanted)
    )
    p.actions += [CreateObject(pod) for rank, pod in enumerate(pods) if rank not in present]


# --- placement -------------------------------------------------------------------------------


def _check_placement(p: _Pass, spec: PretrainJobSpec, pods: list[ObservedPod]) -> None:
    """Pods the scheduler cannot place: say so after the bound (Schedulable=False, with the
    scheduler's message, and an Event), and recreate those whose avoid rule is out of date
    (node affinity is immutable; an unplaced pod is deleted at once)."""
    stuck = [pod for pod in pods if pod.unschedulable_since is not None and not pod.terminating]
    if not stuck:
        if pods and all(pod.node for pod in pods) and _has_condition(p, "Schedulable", "False"):
            p.condition("Schedulable", True, Reason.SCHEDULED,
                        f"all {len(pods)} worker pods are placed")
        return
    avoid = set(_avoided_nodes(p, spec))
    for pod in stuck:
        if pod.avoided is not None and set(pod.avoided) != avoid:
            p.actions.append(DeletePod(pod.name, grace_seconds=0))
            p.event(Reason.UNSCHEDULABLE, f"pod {pod.name} is recreated to avoid "
                    f"{sorted(avoid) or 'no node'} instead of {sorted(pod.avoided) or 'no node'}")
    oldest = min(stuck, key=lambda pod: pod.unschedulable_since or p.now)
    since = oldest.unschedulable_since or p.now
    waited = (p.now - since).total_seconds()
    p.unschedulable = waited
    bound = p.settings.unschedulable_after_seconds
    if waited < bound:
        p.after(bound - waited)
        return
    message = (f"{len(stuck)} of {spec.nodes} worker pods cannot be placed for {waited:.0f}s: "
               f"{oldest.schedule_message or 'the scheduler gave no reason'}")
    if not _has_condition(p, "Schedulable", "False"):
        p.event(Reason.UNSCHEDULABLE, message, warning=True)
    p.condition("Schedulable", False, Reason.UNSCHEDULABLE, message)


def _has_condition(p: _Pass, type_: str, value: str) -> bool:
    return any(c.type == type_ and c.status == value for c in p.status.conditions)


# --- a live gang -----------------------------------------------------------------------------


def _active(p: _Pass, spec: PretrainJobSpec) -> None:
    attempt = p.status.attempt
    if _newer_pods(p):
        p.after(p.settings.fast_requeue_seconds)
        return
    older = [pod for pod in p.observed.pods
             if not pod.spare and (pod.attempt is None or pod.attempt < attempt)]
    if older and p.state.in_place_attempt == attempt:  # a pass cut short after its status
        _adopt(p, spec)
        older = [pod for pod in older if not _keepable(p, pod, attempt)]
    if not _teardown(p, older):
        p.after(p.settings.fast_requeue_seconds)  # never two gangs: the old one goes first
        # an in-place attempt does not wait for pods its restart left on dead nodes (fenced:
        # the Role names none of their Leases; force-deleted after the bound meanwhile)
        if p.state.in_place_attempt != attempt or not all(_on_dead_node(p, pod)
                                                           for pod in older):
            return
    if _remake_pods_kueue_failed(p):
        return
    fault = detect_fault(spec, attempt, p.status.phase, p.observed, p.now, p.settings)
    if fault is not None:
        _on_fault(p, spec, fault)
        return
    pods = p.observed.pods_of(attempt)
    if p.status.phase == "Pending":
        _check_placement(p, spec, pods)
        if _shrink(p, spec):
            return
    if p.status.phase == "Pending" and len(pods) < spec.nodes:
        _create_missing(p, spec)
        p.after(p.settings.resync_seconds)
        return
    _ensure_spares(p, spec)  # once the gang's objects (service account, Role) exist
    if len(pods) >= spec.nodes and all(pod.phase == "Succeeded" for pod in pods):
        p.phase(
            "Succeeded",
            Reason.COMPLETED,
            f"all {spec.nodes} workers finished {spec.total_steps} steps",
        )
        p.force_write = True
        return
    if p.status.phase == "Pending" and all(pod.phase in ("Running", "Succeeded") for pod in pods):
        p.phase("Running", Reason.RUNNING, f"all {spec.nodes} workers of attempt {attempt} run")
        p.condition("Restarting", False, Reason.RUNNING, "the new gang runs")
    if p.status.phase == "Running":
        _update_ready(p, spec, pods)
        if _grow(p, spec):
            return
        _judge_stragglers(p, spec, pods)
        left = seconds_to_next_timeout(spec, attempt, p.observed, p.now, p.settings)
        if left is not None:  # judged when the first timeout runs out, not a resync later
            p.after(left + TIMEOUT_CHECK_MARGIN_SECONDS)
    p.after(p.settings.resync_seconds)


def _remake_pods_kueue_failed(p: _Pass) -> bool:
    """Pods of the attempt that Kueue failed before they ran (made again after a node loss,
    Kueue's ungater placed them by the topology assignment of the day, on the lost node; then
    Kueue found the node unhealthy: `ObservedPod.terminated_by_kueue`) are no fault of the
    job, for neither budget nor backoff: each is deleted at once, and made again gated once
    gone (`_create_missing`), for the ungater to place on the node Kueue assigned in the lost
    one's place (where Kueue found none, it evicts the Workload). At most
    KUEUE_REMAKES_PER_ATTEMPT in an attempt: past them such a pod is left to fault detection.
    Whether any was made again or is going."""
    attempt = p.status.attempt
    taken = [pod for pod in p.observed.pods_of(attempt) if pod.terminated_by_kueue]
    made = p.state.kueue_remakes if p.state.kueue_remakes_attempt == attempt else 0
    fresh = [pod for pod in taken if not pod.terminating]
    if made + len(fresh) > KUEUE_REMAKES_PER_ATTEMPT:
        p.event(Reason.REPLACED_BY_KUEUE,
                f"Kueue failed {made + len(fresh)} pods of attempt {attempt} before they ran "
                f"(pod {fresh[0].name}, node rank {fresh[0].rank}, the latest): over "
                f"{KUEUE_REMAKES_PER_ATTEMPT} made again, it counts as a fault of the attempt",
                warning=True)
        return False
    for pod in fresh:
        p.actions.append(DeletePod(pod.name, grace_seconds=0))
        p.event(Reason.REPLACED_BY_KUEUE,
                f"Kueue failed pod {pod.name} (node rank {pod.rank}) before it ran: its "
                "topology assignment named a node Kueue found unhealthy; the pod is made "
                "again for the node Kueue assigns in its place (no restart)")
    if fresh:
        p.state = p.state.model_copy(update={"kueue_remakes": made + len(fresh),
                                             "kueue_remakes_attempt": attempt})
    if taken:
        p.after(p.settings.fast_requeue_seconds)
    return bool(taken)


def _all_training(p: _Pass, pods: list[ObservedPod]) -> bool:
    """Every pod's worker reports training (past its start and compilation)."""
    beats = [_beat_of(p, pod) for pod in pods]
    return all(
        b is not None and b.phase not in STARTING_PHASES for b in beats
    )


def _update_ready(p: _Pass, spec: PretrainJobSpec, pods: list[ObservedPod]) -> None:
    if not _all_training(p, pods):
        return
    p.condition("Ready", True, Reason.TRAINING, f"all {spec.nodes} workers report training")
    attempt = p.status.attempt
    if p.state.ready_attempt != attempt:
        failure = p.status.last_failure
        since = parse_time(failure.time if failure else None)
        if attempt > 0 and since is not None:
            p.recovered = (p.now - since).total_seconds()
        p.state = p.state.model_copy(update={"ready_attempt": attempt})


def _judge_stragglers(p: _Pass, spec: PretrainJobSpec, pods: list[ObservedPod]) -> None:
    """Score each node's own time a step (compute, data wait, host work) against its gang's;
    condition Straggler, an event when a node is flagged, and the per-node ratios for the
    metrics (see `stragglers`)."""
    rule = spec.fault_tolerance.stragglers
    own = {}  # seconds a step outside the waits on peers: compute, data wait, host work
    for pod in pods:
        beat = _beat_of(p, pod)
        if (pod.node and beat is not None and beat.phase in ("training", "checkpointing")
                and beat.compute_seconds):
            own[pod.node] = (beat.compute_seconds + (beat.data_wait_seconds or 0.0)
                             + (beat.host_seconds or 0.0))
    p.slowdowns = stragglers.slowdowns(own)
    before = _spells(p.state)
    flagged, over = stragglers.judge(p.slowdowns, before, p.now, rule.threshold,
                                     rule.window_seconds,
                                     stragglers.GRACE_PERIODS * p.settings.heartbeat_period_seconds)
    p.flagged = [slow.node for slow in flagged]
    if flagged:  # goodput's straggler cause once flagged (a noisy step is no straggler)
        step = p.lead.step_seconds if p.lead is not None else None
        p.straggler_share = stragglers.share_lost(own, p.slowdowns, rule.threshold, step)
    if over != before:
        p.state = p.state.model_copy(update={
            "slow_since": {node: format_time(s.since) for node, s in over.items()},
            "slow_under_since": {node: format_time(s.under) for node, s in over.items()
                                 if s.under is not None}})
    for spell in over.values():  # judged when its window ends, not a resync later
        left = rule.window_seconds - (p.now - spell.since).total_seconds()
        if left > 0 and spell.under is None:
            p.after(left)
    shown = next((c for c in p.status.conditions if c.type == "Straggler"), None)
    if flagged:
        slow = flagged[0]
        if shown is None or shown.status != "True" or f"node {slow.node} " not in shown.message:
            message = stragglers.describe(flagged, rule.threshold)
            p.condition("Straggler", True, Reason.STRAGGLER, message)
            p.event(Reason.STRAGGLER, message, warning=True)
            accounted = _accounted_at(p)  # and over its window, before this pass
            if accounted is not None and accounted > slow.since:
                p.straggler_window_seconds = p.straggler_share * (
                    accounted - slow.since).total_seconds()
        if rule.action == "Replace":
            _move_off_straggler(p, spec, slow, pods, rule.window_seconds)
    elif shown is not None and shown.status == "True" and own:
        p.condition("Straggler", False, Reason.NO_STRAGGLER,
                    f"every node is within {1 + rule.threshold:.2f}x of the others")


_NO_SPELLS: dict[str, Any] = {"slow_since": {}, "slow_under_since": {}}
"""A new gang's nodes start with no time over the straggler threshold."""


def _spells(state: OperatorState) -> dict[str, stragglers.Spell]:
    """The nodes' spells over the straggler threshold, as the state keeps them."""
    out = {}
    for node, at in state.slow_since.items():
        since = parse_time(at)
        if since is not None:
            out[node] = stragglers.Spell(since, parse_time(state.slow_under_since.get(node)))
    return out


def _move_off_straggler(p: _Pass, spec: PretrainJobSpec, slow: stragglers.Slow,
                        pods: list[ObservedPod], window: float) -> None:
    """stragglers.action Replace: with a ready spare, restart in place with the slow node's
    pod deleted (the spare takes its rank); with none, restart off the node (its pod recreated
    elsewhere) once the time it has cost exceeds what a restart costs this job
    (`stragglers.restart_pays`). Either way the node is avoided and no budget used. The move
    waits for a checkpoint completed after the flag (it loses no step), asked for as soon as
    the move is due (`CHECKPOINT_REQUEST`: the newest checkpoint's step + 1, the same value on
    every pass until one completes), not an interval later. Until the move is due, nothing
    (the condition says it is slow)."""
    if p.fault is not None:
        return
    victim = next((pod for pod in pods if pod.node == slow.node), None)
    if victim is None:
        return
    head = f"node {slow.node} took {slow.ratio:.2f}x the median of the other nodes' time a step"
    spare = next((pod for pod in p.observed.spare_pods() if _ready_spare(p, pod)), None)
    if spare is not None:
        how = f"its rank moves to spare {spare.name}"
    else:
        lost = p.straggler_share * (p.now - slow.since).total_seconds()
        cost = _restart_cost(p, spec)
        if not stragglers.restart_pays(lost, cost):
            p.after(p.settings.resync_seconds)  # a spare, or enough loss, is awaited
            return
        how = (f"it has cost {lost:.0f}s, more than a restart ({cost:.0f}s measured): "
               f"restarting off it (no ready spare)")
    checkpoint = p.status.latest_checkpoint
    saved = parse_time(checkpoint.time if checkpoint else None)
    if checkpoint is None or saved is None or saved < slow.since + timedelta(seconds=window):
        _ask_checkpoint(p, (checkpoint.step if checkpoint else 0) + 1)
        p.after(queueing.POLL_SECONDS)  # the checkpoint asked for is awaited
        return
    why = f"{head}: {how} at checkpoint step_{checkpoint.step}"
    p.leaving.add(victim.name)  # not kept in place: a spare or a new node takes its rank
    _on_fault(p, spec, Fault(Reason.STRAGGLER, why, victim.name, slow.node))


def _restart_cost(p: _Pass, spec: PretrainJobSpec) -> float:
    """What a restart costs this job, as measured so far: the mean of its attempts' starts
    (pending, startup, compilation and restore from storage or memory, from goodput). No
    backoff: a straggler is still training, so its attempt made progress."""
    b = p.old.goodput.badput_seconds
    return (b.pending + b.startup + b.compile + b.restore + b.memory_restore) / (
        p.status.restarts.total + 1)


def _beat_of(p: _Pass, pod: ObservedPod) -> Heartbeat | None:
    if pod.attempt is None or pod.rank is None:
        return None
    return _beat(p, labels.worker_lease_name(p.observed.job.name, pod.attempt, pod.rank))


def _beat(p: _Pass, lease_name: str) -> Heartbeat | None:
    lease = p.observed.leases.get(lease_name)
    beat = lease.heartbeat if lease is not None and lease.renew_time is not None else None
    if beat is not None and beat.attempt is not None and beat.attempt != p.status.attempt:
        return None
    return beat


# --- faults ----------------------------------------------------------------------------------


def _on_fault(p: _Pass, spec: PretrainJobSpec, fault: Fault) -> None:
    """Count the fault, then end the job or restart the gang."""
    p.fault = fault
    if fault.unreachable and fault.pod:
        present = {pod.name for pod in p.observed.pods}
        lost = [n for n in p.state.peer_lost if n in present and n != fault.pod] + [fault.pod]
        p.state = p.state.model_copy(update={"peer_lost": lost})
    streak = _count_fault(p, spec, fault)
    verdict = _verdict(spec, p.status, fault, streak)
    if verdict is not None:
        _fail(p, *verdict)
    else:
        _restart(p, spec, fault)


def _count_fault(p: _Pass, spec: PretrainJobSpec, fault: Fault) -> int:
    """Record the fault once per attempt (a replayed pass counts nothing again): the attempts
    in a row without a new checkpoint, the node to avoid, `lastFailure`. Returns the streak."""
    ft, s, attempt = spec.fault_tolerance, p.status, p.status.attempt
    # progress: a restore point (a durable checkpoint, or an in-memory snapshot every worker
    # holds) newer than the one the attempt started from
    latest = max(s.latest_checkpoint.step if s.latest_checkpoint else -1, p.snapshot_step)
    start = p.state.checkpoint_at_attempt_start
    resumed = p.lead.resumed_step if p.lead is not None else None  # the attempt's own Lease
    if resumed is not None:
        start = max(start if start is not None else -1, resumed)
    if p.state.faulted_attempt == attempt:  # replayed pass: this fault is already counted
        streak = p.state.no_progress_streak
    else:
        streak = (
            0 if latest > (start if start is not None else -1) else p.state.no_progress_streak + 1
        )
        if p.state.in_place_attempt == attempt:
            failed = p.state.ready_attempt != attempt
            p.state = p.state.model_copy(update={
                "in_place_failures": p.state.in_place_failures + 1 if failed else 0})
        else:
            p.state = p.state.model_copy(update={"in_place_failures": 0})
    if ft.avoid_failed_nodes and fault.node and fault.reason in labels.NODE_REASONS:
        until = p.now + timedelta(seconds=ft.avoid_failed_nodes_seconds)
        entry = AvoidedNode(node=fault.node, failed_at=format_micro_time(p.now),
                            until=format_time(until), reason=str(fault.reason))
        s.avoided_nodes = [e for e in s.avoided_nodes if e.node != fault.node] + [entry]
    p.state = p.state.model_copy(
        update={"faulted_attempt": attempt, "no_progress_streak": streak}
    )
    s.last_failure = Failure(
        reason=fault.reason,
        node=fault.node,
        pod=fault.pod,
        exit_code=fault.exit_code,
        message=fault.message,
        time=p.stamp,
    )
    return streak


def _counts(spec: PretrainJobSpec, fault: Fault) -> bool:
    """Whether the fault uses restart budget (infrastructure faults may not; moving off a
    straggler never does: nothing failed)."""
    if fault.reason == Reason.STRAGGLER:
        return False
    return not fault.infrastructure or spec.fault_tolerance.infra_faults_count


def _verdict(spec: PretrainJobSpec, status: PretrainJobStatus, fault: Fault, streak: int
             ) -> tuple[Reason, str] | None:
    """Why the job must end instead of restarting, or None."""
    ft = spec.fault_tolerance
    if fault.permanent:
        return fault.reason, f"{fault.message}: not retried (a restart cannot fix it)"
    if _counts(spec, fault) and status.restarts.counted + 1 > ft.max_restarts:
        return (Reason.BUDGET_EXHAUSTED,
                f"{fault.message}; restart budget of {ft.max_restarts} used up")
    if streak > ft.no_progress_restarts:
        return (Reason.NO_PROGRESS,
                f"{fault.message}; {streak} attempts in a row ended without "
                f"a new complete checkpoint (noProgressRestarts={ft.no_progress_restarts})")
    return None


def _restart(p: _Pass, spec: PretrainJobSpec, fault: Fault) -> None:
    """Count the restart and the work it loses, and start tearing the gang down."""
    s = p.status
    latest = s.latest_checkpoint.step if s.latest_checkpoint else -1
    s.restarts.total += 1
    s.restarts.counted += int(_counts(spec, fault))
    if spec.snapshot_interval:  # in place, most faults keep the pods' snapshots
        latest = max(latest, p.snapshot_step)
    lost = _lost_steps(p, latest)
    s.lost_steps += lost
    step_seconds = (p.lead.step_seconds or 0.0) if p.lead is not None else 0.0
    if spec.snapshot_interval:
        # the next attempt says where it resumed (`_correct_lost_steps`), and the lost work is
        # added then: status.goodput.lostWorkSeconds only grows, as the counter that follows it
        # must; an earlier restart's, never confirmed (its attempt did not report), as counted
        st = p.state
        if st.lost_attempt is not None:
            p.lost_work += st.lost_counted * st.lost_step_seconds
        p.state = p.state.model_copy(update={
            "lost_attempt": s.attempt + 1, "lost_basis": latest, "lost_counted": lost,
            "lost_step_seconds": step_seconds})
    else:
        p.lost_work += lost * step_seconds
    p.restarted = True
    moves = _domain_lost(p, spec)
    in_place = (builders.in_place(spec) and moves is None
                and p.state.in_place_failures < IN_PLACE_FAILURES_BEFORE_RECREATE)
    p.state = p.state.model_copy(update={"in_place_next": s.attempt + 1 if in_place else None,
                                         **_NO_SPELLS})
    if in_place:
        how = "restarting in place: the pods stay, their trainers restart"
    elif moves is not None:
        how = f"restarting the gang: {moves}"
    elif builders.in_place(spec):
        how = (f"restarting the gang: {p.state.in_place_failures} in-place attempts in a row "
               "failed before training")
    else:
        how = "restarting the gang"
    p.phase("Restarting", fault.reason, f"{fault.message}; {how} (restart {s.restarts.total})",
            warning=True)
    if _teardown(p, _gone(p, spec) if in_place else p.observed.pods) and in_place:
        # every pod stays (a trainer's fault): nothing to wait for, so the next attempt starts
        # in this pass unless a backoff is due. One status write then holds both the restart
        # and the attempt it starts, still ahead of that attempt's objects.
        _restarting(p, spec)
        return
    p.after(p.settings.fast_requeue_seconds)


def _gone(p: _Pass, spec: PretrainJobSpec) -> list[ObservedPod]:
    """The pods an in-place restart cannot keep: of another job's attempt than the status's,
    ended (the launcher exited), terminating, or on a node that is dead or unhealthy."""
    attempt = p.status.attempt
    return [pod for pod in p.observed.pods
            if (not _keepable(p, pod, attempt) or pod.name in p.leaving)
            and not _ready_spare(p, pod)]


def _only_dead_left(p: _Pass, gone: list[ObservedPod]) -> bool:
    """The pods a restart waits to see gone are all workers on dead nodes (their kubelets
    will never confirm; they are fenced: the next Role names none of their Leases)."""
    return not any(pod.spare or not _on_dead_node(p, pod) for pod in gone)


def _spares_cover(p: _Pass, spec: PretrainJobSpec, gone: list[ObservedPod]) -> bool:
    """The pods not gone yet are all on dead nodes (their kubelets cannot confirm; they are
    fenced: the next Role names none of their Leases) and ready spares can take every rank no
    kept pod holds (or, at a resize, none is left without one): the in-place restart need not
    wait for the force-delete."""
    if not _only_dead_left(p, gone):
        return False
    kept = [pod for pod in p.observed.pods if not pod.spare and _keepable(p, pod, p.status.attempt)]
    held = {pod.rank for pod in kept}
    # a shrink in place: the kept pods beyond the new size take the free ranks (`_compact`)
    over = sum(1 for pod in kept if pod.rank is not None and pod.rank >= spec.nodes)
    missing = max(0, sum(1 for r in range(spec.nodes) if r not in held) - over)
    ready = [pod for pod in p.observed.spare_pods() if _ready_spare(p, pod)]
    return len(ready) >= missing and (missing > 0 or _resizing(p.status))


def _on_unhealthy_node(p: _Pass, pod: ObservedPod) -> bool:
    node = p.observed.nodes.get(pod.node) if pod.node else None
    return node is not None and not node.healthy


def _on_dead_node(p: _Pass, pod: ObservedPod) -> bool:
    if pod.name in p.state.peer_lost:
        return True
    return pod.node is not None and node_dead(p.observed.nodes.get(pod.node), p.now, 0.0,
                                              p.observed.nodes_known)


def _ready_spare(p: _Pass, pod: ObservedPod) -> bool:
    """A spare that could take a rank now: running on a live, healthy node."""
    if not pod.spare or pod.terminating or pod.phase != "Running" or pod.node is None:
        return False
    node = p.observed.nodes.get(pod.node)
    return not node_dead(node, p.now, p.settings.node_not_ready_grace_seconds,
                         p.observed.nodes_known) and (node is None or node.healthy)


def _spare_placement(p: _Pass, spec: PretrainJobSpec) -> RankPlacement | None:
    """A spare stays in the gang's required topology domain (a promoted spare must be
    where its rank may be), on no node in particular."""
    topo = spec.scheduling.topology
    if topo is None or topo.required is None:
        return None
    domains = {node.labels.get(topo.required) for pod in p.observed.pods_of(p.status.attempt)
               if pod.node and (node := p.observed.nodes.get(pod.node)) is not None}
    if len(domains) != 1 or None in domains:
        return None
    return RankPlacement(required=(topo.required, str(domains.pop())))


def _ensure_spares(p: _Pass, spec: PretrainJobSpec) -> None:
    """Keep `spareNodes` spare pods: the broken ones deleted, the missing ones created (never
    on the job's avoided nodes); the count shown in status.spares."""
    wanted = spec.fault_tolerance.spare_nodes if builders.in_place(spec) else 0
    spares = [pod for pod in p.observed.spare_pods() if not pod.terminating]
    if not wanted and not spares:
        return
    broken = [pod for pod in spares if pod.finished or pod.phase in ("Failed", "Unknown")
              or _on_dead_node(p, pod) or _on_unhealthy_node(p, pod)]
    for pod in broken:
        p.actions.append(DeletePod(pod.name))
    healthy = [pod for pod in spares if pod not in broken]
    for pod in healthy[wanted:]:  # spareNodes lowered
        p.actions.append(DeletePod(pod.name))
    live = min(len(healthy), wanted)
    serial = p.state.spare_serial
    # a spare is requested only once the attempt trains (every rank placed and past its
    # start): a scheduler must never give a spare the node a rank waits for (Volcano orders one
    # PodGroup's pods by priority, then by creation time in seconds, then by UID: a spare
    # created in the ranks' second could go first and leave a rank Pending for good), and a
    # replacement spare's start (its image, its standby's imports) must not compete with the
    # restart it follows
    trains = _all_training(p, p.observed.pods_of(p.status.attempt))
    for _ in range(max(0, wanted - live) if trains else 0):
        p.actions.append(CreateObject(builders.build_spare_pod(
            p.observed.job, spec, serial, p.status.attempt, p.settings,
            _avoided_nodes(p, spec), _spare_placement(p, spec))))
        serial += 1
    if serial != p.state.spare_serial:
        p.state = p.state.model_copy(update={"spare_serial": serial})
    promoted = p.status.spares.promoted if p.status.spares else 0
    p.status.spares = Spares(wanted=wanted, promoted=promoted,
                             ready=sum(_ready_spare(p, pod) for pod in spares))


def _keepable(p: _Pass, pod: ObservedPod, attempt: int) -> bool:
    if pod.spare or pod.attempt is None or pod.attempt > attempt or pod.terminating:
        return False
    if pod.rank is None or pod.name in p.state.peer_lost:
        return False
    if pod.phase in ("Failed", "Succeeded", "Unknown"):
        return False
    if pod.node is not None:
        node = p.observed.nodes.get(pod.node)
        if node_dead(node, p.now, p.settings.node_not_ready_grace_seconds,
                     p.observed.nodes_known) or (node is not None and not node.healthy):
            return False
    return True


def _lost_steps(p: _Pass, checkpoint: int) -> int:
    steps = [b.step for pod in p.observed.pods_of(p.status.attempt) if (b := _beat_of(p, pod))]
    return accounting.lost_steps(steps, checkpoint)


# --- progress, uptime, writes ----------------------------------------------------------------


def _update_progress(p: _Pass, spec: PretrainJobSpec) -> None:
    names = [labels.worker_lease_name(p.observed.job.name, p.status.attempt, r)
             for r in range(spec.nodes)]
    beats = [_beat(p, n) for n in names]
    p.lead = beats[0] if beats else None
    lead = p.lead
    # only while the attempt's ledger is live: once its time is folded (the pass that ends
    # it), a later beat of a surviving worker must not move the next gang's recompute
    # boundary past what that ledger counted as productive. The step it resumed from is done
    # too (its state holds it): the steps it carried from an earlier attempt are counted now
    if lead is not None and p.old.phase in ACTIVE:
        done = max(lead.step if lead.phase not in STARTING_PHASES else 0,
                   lead.resumed_step or 0)
        if done > p.state.high_step:
            p.state = p.state.model_copy(update={"high_step": done})
    held = [b.snapshot_step for b in beats if b is not None and b.snapshot_step is not None]
    p.snapshot_step = min(held) if beats and len(held) == len(beats) else -1
    _correct_lost_steps(p, lead)
    progress = accounting.progress_of(beats, spec.total_steps, p.status.progress)
    if progress is not None:
        p.status.progress = progress
    newer = accounting.newer_checkpoint(beats, p.status.latest_checkpoint, p.stamp)
    if newer is not None:
        p.status.latest_checkpoint = newer


def _correct_lost_steps(p: _Pass, lead: Heartbeat | None) -> None:
    """Once the attempt a restart expected to resume from the snapshot every worker held says
    where it did resume (checkpoint.memoryInterval): a pod lost with its memory sent it back to
    an older snapshot or the durable checkpoint, and the steps between were lost too (a
    snapshot completed after the restart's last look: fewer were)."""
    st = p.state
    if (st.lost_attempt is None or lead is None or p.status.attempt != st.lost_attempt
            or lead.resumed_step is None):  # `lead`: the attempt's own Lease
        return
    more = max(max(st.lost_basis, 0) - max(lead.resumed_step, 0), -st.lost_counted)
    p.status.lost_steps = max(0, p.status.lost_steps + more)
    p.lost_work += (st.lost_counted + more) * st.lost_step_seconds  # more >= -lost_counted
    p.state = st.model_copy(update={"lost_attempt": None, "lost_basis": 0, "lost_counted": 0,
                                    "lost_step_seconds": 0.0})


def _account_uptime(p: _Pass) -> None:
    p.status.uptime = accounting.uptime_after(
        p.old.uptime, p.old.phase, _accounted_at(p), p.now)


def _accounted_at(p: _Pass) -> datetime | None:
    """Up to when the status's uptime and goodput run (earlier operators kept it in their
    state annotation)."""
    return parse_time(p.old.accounted_at or p.observed.state.accounted_at)


def _resizing(status: PretrainJobStatus) -> bool:
    """The restart under way is a planned resize (spec.elastic), not a fault's."""
    return any(c.type == "Restarting" and c.reason in (Reason.SHRUNK, Reason.GROWN)
               for c in status.conditions)


def _goodput_bucket(old: PretrainJobStatus) -> accounting.Bucket | None:
    """Where the time since the previous pass went, by the state that pass left."""
    if old.start_time is None:
        return None
    if old.phase in ACTIVE:
        return "attempt"
    if old.phase == "Restarting":
        if _resizing(old):
            return "resize"
        waiting = next((c for c in old.conditions if c.type == "Restarting"), None)
        return "backoff" if waiting is not None and waiting.reason == Reason.BACKOFF else (
            "teardown")
    return None


def _account_goodput(p: _Pass) -> None:
    end: accounting.EndCause | None = None
    if p.old.phase in ACTIVE and p.status.phase not in ACTIVE:
        end = "detection" if p.fault is not None else "other"
    saved = p.status.latest_checkpoint
    # the lead is of the attempt the pass began with: none for a gang created in this pass
    live = (p.status.phase in ACTIVE or end) and p.status.attempt == p.old.attempt
    p.status.goodput = accounting.goodput_after(
        p.old.goodput, _goodput_bucket(p.old), _accounted_at(p), p.now,
        p.status.attempt, p.lead if live else None, end,
        p.lost_work, parse_time(saved.time) if saved else None,
        p.settings.heartbeat_period_seconds * EXPIRY_PERIODS, p.straggler_share,
        p.straggler_window_seconds, _training_nodes(p.old))


def _training_nodes(old: PretrainJobStatus) -> tuple[int, int] | None:
    """(nodes trained on, spec.nodes) when the previous pass left the job Running."""
    if old.phase != "Running" or old.size is None:
        return None
    return old.size.nodes, old.size.desired


def _state_moved(p: _Pass) -> bool:
    """Whether the pass must write the state annotation. `high_step` alone does not count
    while the attempt runs: every pass takes it again from rank 0's heartbeat, which lives as
    long as the attempt, so it is written with the pass that ends the attempt (its phase or
    attempt moves) or with any other change of state. Otherwise rank 0's every step would
    cost one more write, and one more watch event to every client, per pass."""
    new, old = p.state, p.observed.state
    if new.model_copy(update={"high_step": old.high_step}) != old:
        return True
    return new.high_step != old.high_step and (
        p.status.phase != p.old.phase or p.status.attempt != p.old.attempt)


def _should_write(p: _Pass) -> bool:
    volatile = {"progress", "uptime", "goodput", "accounted_at", "observed_generation"}
    if p.force_write or _accounted_at(p) is None:
        return True
    if p.status.model_dump(exclude=volatile) != p.old.model_dump(exclude=volatile):
        return True
    if p.status.observed_generation != p.old.observed_generation:
        return True
    written = _accounted_at(p)  # every status write moves it, and only those do
    due = written is None or p.now - written >= timedelta(
        seconds=p.settings.status_interval_seconds
    )
    changed = (p.status.progress != p.old.progress or p.status.uptime != p.old.uptime
               or p.status.goodput != p.old.goodput)
    return due and changed
