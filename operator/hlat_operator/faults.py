"""Fault detection: is the current gang broken, and why? Pure functions of what was observed.

A gang is only as alive as its least alive member, so any one of these ends the attempt:
- a worker pod Failed: the exit code says whether a restart can help. `ExitCode.CONFIG_ERROR`
  is the trainer saying "bad spec, data or checkpoint": permanent. Signals (128+n: SIGKILL
  137, SIGTERM 143, OOMKilled), infrastructure reasons (Evicted, preemption, node shutdown)
  and any other code are retryable, within budget (unlike Kubeflow's 1-127-is-permanent rule:
  an NCCL/EFA timeout exits 1 and is exactly what a restart fixes);
- a worker pod deleted, or terminating without the operator asking;
- the node of a worker unreachable from its neighbours' launchers (`unreachable_fault`:
  seconds after the loss, before its Node turns NotReady), NotReady/unreachable (after a
  grace), gone, or unhealthy by its own
  health reporters (`nodehealth`: AcceleratedHardwareReady=False, NeuronHealth=True, HyperPod's
  health label), or a worker exiting with `ExitCode.NODE_FAULT` (its Neuron device or driver):
  infrastructure faults, no budget;
- a hang: no progress for longer than the timeout of the worker's phase. Progress is the
  heartbeat's `progress_time` (the training loop reported), so a worker whose process is
  frozen or dead (no renewals either) and one stuck in a collective or the device runtime
  (still renewing) are both caught. Before the first beat (and while the trainer reports
  starting/compiling) the startup timeout applies: compiling a graph for Trainium can take most
  of an hour. Once training, the steady timeout: explicit, or learned as observed step time x
  safetyFactor (never below a floor), plus one heartbeat period since renewals may be a period
  apart. While a worker reports `checkpointing`, the longer of the steady timeout and its
  longest save so far x safetyFactor (+ a period); before its first save, the startup timeout.
Silence the operator could not have heard is not held against anyone: after it gets the API
server back from an outage (`Observed.seeing_since`), heartbeat timeouts run from that moment,
and a node NotReady or unreachable is not lost for `api_return_grace_seconds`.
The blamed pod is the one that failed first; among hangs, one whose Lease expired (it stopped
renewing; the others are usually waiting for it in a collective), then the one without progress
the longest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime

from hlat_api import labels
from hlat_api.env import ExitCode
from hlat_api.heartbeat import (
    EXPIRY_PERIODS,
    PEER_LOST_SECONDS,
    PEER_PROBE_SECONDS,
    STARTING_PHASES,
)
from hlat_api.labels import Reason
from hlat_api.spec import PretrainJobSpec
from hlat_operator.config import OperatorSettings
from hlat_operator.nodehealth import NodeProblem, exit_problem
from hlat_operator.observe import Observed, ObservedLease, ObservedNode, ObservedPod

_EVICTED_REASONS = {"Evicted", "EvictionByEvictionAPI", "TerminationByKubelet"}
_PREEMPTED_REASONS = {"Preempting", "PreemptionByScheduler", "PreemptionByKubeScheduler"}
_NODE_REASONS = {
    "NodeLost",
    "NodeShutdown",
    "Shutdown",
    "Terminated",
    "DeletionByPodGC",
    "DeletionByTaintManager",
    "UnexpectedAdmissionError",
}


@dataclass(frozen=True)
class Fault:
    reason: Reason
    message: str
    pod: str | None = None
    node: str | None = None
    exit_code: int | None = None
    problem: NodeProblem | None = None
    """For a node fault: the condition (or label, or exit) that implicated the node, named in
    the message (status, event) and the metric."""
    unreachable: bool = False
    """A node lost by its peers' word (`unreachable_fault`): its Node may still look Ready,
    but its pod is treated as on a dead node (not kept, force-deleted, a spare takes it)."""

    @property
    def permanent(self) -> bool:
        return self.reason == Reason.CONFIG_ERROR

    @property
    def infrastructure(self) -> bool:
        return self.reason in labels.INFRA_REASONS


def _infra_reason(reason: str | None) -> Reason | None:
    if reason in _EVICTED_REASONS:
        return Reason.EVICTED
    if reason in _PREEMPTED_REASONS:
        return Reason.PREEMPTED
    if reason in _NODE_REASONS:
        return Reason.NODE_LOST
    return None


def classify_failed(pod: ObservedPod) -> Fault:
    """Why a Failed worker pod failed."""
    where = f"pod {pod.name} on node {pod.node or '?'}"
    code = pod.exit_code
    infra = _infra_reason(pod.reason) or _infra_reason(pod.disruption)
    blamed = exit_problem(code)
    if code == ExitCode.CONFIG_ERROR:
        reason, what = Reason.CONFIG_ERROR, "exited with the trainer's config-error code 2"
    elif blamed is not None:  # its Neuron device or driver: move off the node, no budget
        detail = f": {pod.message.strip()[-300:]}" if pod.message.strip() else ""
        return Fault(Reason.NODE_UNHEALTHY,
                     f"{where} exited with the node-fault code {code} (its node's Neuron device "
                     f"or driver){detail}", pod.name, pod.node, code, blamed)
    elif infra is not None:
        reason, what = infra, f"was stopped by the cluster ({pod.reason or pod.disruption})"
    elif pod.reason == "OOMKilled":
        reason, what = Reason.OOM_KILLED, "ran out of memory (OOMKilled)"
    elif code is not None and code > 128:
        reason, what = Reason.KILLED, f"was killed by signal {code - 128} (exit code {code})"
    else:
        reason, what = Reason.POD_FAILED, f"failed with exit code {code}"
    detail = f": {pod.message.strip()[-300:]}" if pod.message.strip() else ""
    return Fault(reason, f"{where} {what}{detail}", pod.name, pod.node, code)


def _first_to_fail(failed: list[ObservedPod]) -> list[Fault]:
    """The failures of one gang, the root cause first: the container that ended first (a rank
    killed takes its peers down a moment later, each with a bare exit code from a broken
    collective); within the same second (finishedAt has whole seconds), a signal, OOM or
    cluster stop before a bare exit code, then by rank."""
    never = datetime.max.replace(tzinfo=UTC)

    def order(pair: tuple[ObservedPod, Fault]) -> tuple[datetime, bool, int]:
        pod, fault = pair
        return (pod.finished_at or never, fault.reason == Reason.POD_FAILED,
                pod.rank if pod.rank is not None else len(failed))

    return [f for _, f in sorted(((p, classify_failed(p)) for p in failed), key=order)]


def trainer_exited(pod: ObservedPod, observed: Observed) -> ObservedPod | None:
    """A pod kept for in-place restarts whose launcher reported its trainer's exit (on the
    Lease of the pod's attempt), as the failed container it stands for: judged as one (the
    report carries no exit time: among several, a signal or OOM is blamed before a bare code)."""
    lease = observed.lease_of(pod)
    beat = lease.heartbeat if lease is not None else None
    if beat is None or beat.exit_code is None or beat.exit_code == 0 or pod.terminating:
        return None
    if beat.attempt is not None and beat.attempt != pod.attempt:
        return None
    reason = beat.exit_reason if beat.exit_reason == "OOMKilled" else None  # the one it gives
    return replace(pod, phase="Failed", exit_code=beat.exit_code, reason=reason,
                   message="the trainer exited; the pod stays")


def _terminating(pod: ObservedPod) -> Fault:
    reason = _infra_reason(pod.disruption) or Reason.POD_DELETED
    cause = f" ({pod.disruption})" if pod.disruption else ""
    return Fault(reason, f"pod {pod.name} was deleted{cause}", pod.name, pod.node)


def node_dead(node: ObservedNode | None, now: datetime, grace: float, known: bool) -> bool:
    if node is None:
        return known
    if node.ready:
        # a kubelet that reports Ready outweighs an unreachable taint the node lifecycle
        # controller has not lifted yet (it does so a monitor period after recovery)
        return False
    if node.unreachable:
        return True
    since = node.not_ready_since
    return since is None or (now - since).total_seconds() >= grace


def _back_from_outage(observed: Observed, now: datetime, window: float) -> bool:
    """The operator got the API server back less than `window` seconds ago."""
    back = observed.seeing_since
    return back is not None and (now - back).total_seconds() < window


def _node_fault(pod: ObservedPod, observed: Observed, now: datetime,
                settings: OperatorSettings) -> Fault | None:
    if pod.node is None:
        return None
    node = observed.nodes.get(pod.node)
    # right after an outage of the API server every node looks NotReady (no kubelet could
    # renew): not lost until its kubelet has had the time to (a deleted Node is lost at once)
    excused = node is not None and _back_from_outage(observed, now,
                                                     settings.api_return_grace_seconds)
    if not excused and node_dead(node, now, settings.node_not_ready_grace_seconds,
                                 observed.nodes_known):
        state = "is gone" if node is None else "is NotReady"
        return Fault(
            Reason.NODE_LOST, f"node {pod.node} of pod {pod.name} {state}", pod.name, pod.node
        )
    problem = node.problem if node is not None else None
    if problem is not None:
        what = problem.describe()
        return Fault(Reason.NODE_UNHEALTHY, f"node {pod.node} of pod {pod.name} reports {what}",
                     pod.name, pod.node, problem=problem)
    return None


def steady_timeout(
    spec: PretrainJobSpec, step_seconds: float | None, settings: OperatorSettings
) -> float | None:
    """Seconds a training worker may go without renewing; None: not learned yet."""
    hb = spec.fault_tolerance.heartbeat
    if hb.timeout_seconds != "auto":
        return float(hb.timeout_seconds)
    if step_seconds is None:
        return None
    learned = max(settings.min_heartbeat_timeout_seconds, hb.safety_factor * step_seconds)
    return learned + settings.heartbeat_period_seconds


@dataclass(frozen=True)
class Staleness:
    since: datetime
    """The last sign of progress: the loop's last report, or the container start before the
    first beat."""
    timeout: float
    reason: Reason
    renewed: datetime | None = None
    """The last renewal (the process was alive then); None before the first beat."""
    finished: bool = False
    """The worker reported `finished`: it no longer renews, it should exit."""


def staleness(
    spec: PretrainJobSpec,
    pod: ObservedPod,
    lease: ObservedLease | None,
    settings: OperatorSettings,
    gang_started: datetime | None = None,
) -> Staleness | None:
    """Which timeout applies to a running worker now, from when; None: nothing to check.
    Before the first beat the clock starts when the whole gang runs (`gang_started`): no
    worker can get past rendezvous before its last peer starts."""
    hb = spec.fault_tolerance.heartbeat
    startup = hb.startup_timeout_seconds
    beat = lease.heartbeat if lease is not None and lease.renew_time is not None else None
    if beat is not None and beat.attempt is not None and beat.attempt != pod.attempt:
        beat = None  # a leftover of another attempt: not this worker's sign of life
    if beat is None or lease is None or lease.renew_time is None:
        since = max(filter(None, (pod.started_at or pod.created_at, gang_started)), default=None)
        return Staleness(since, startup, Reason.STARTUP_TIMEOUT) if since else None
    renewed = lease.renew_time
    progressed = min(beat.progress_time, renewed) if beat.progress_time else renewed
    if beat.phase == "finished":  # it stops renewing; it must exit soon
        return Staleness(progressed, settings.exit_after_finish_seconds,
                         Reason.HEARTBEAT_TIMEOUT, renewed, finished=True)
    if beat.phase in STARTING_PHASES:
        return Staleness(progressed, startup, Reason.STARTUP_TIMEOUT, renewed)
    steady = steady_timeout(spec, beat.step_seconds, settings)
    timeout = startup if steady is None else steady
    if beat.phase == "checkpointing":
        if beat.checkpoint_seconds is None:
            timeout = startup
        else:
            saving = hb.safety_factor * beat.checkpoint_seconds + settings.heartbeat_period_seconds
            timeout = min(startup, max(timeout, saving))
    return Staleness(progressed, timeout, Reason.HEARTBEAT_TIMEOUT, renewed)


def _seen_from(stale: Staleness, back: datetime) -> Staleness:
    """`stale` with its clocks started no earlier than `back`."""
    renewed = None if stale.renewed is None else max(stale.renewed, back)
    return replace(stale, since=max(stale.since, back), renewed=renewed)


def _judged(spec: PretrainJobSpec, pods: list[ObservedPod], observed: Observed,
            settings: OperatorSettings) -> list[tuple[ObservedPod, Staleness]]:
    """The running workers whose heartbeats are judged, each with the timeout that applies."""
    out = []
    gang_started = max((p.started_at for p in pods if p.started_at), default=None)
    for pod in pods:
        if pod.phase != "Running" or pod.terminating:
            continue
        stale = staleness(spec, pod, observed.lease_of(pod), settings, gang_started)
        if stale is None:
            continue
        if observed.seeing_since is not None:  # nothing could renew while it was away
            stale = _seen_from(stale, observed.seeing_since)
        out.append((pod, stale))
    return out


def seconds_to_next_timeout(spec: PretrainJobSpec, attempt: int, observed: Observed,
                            now: datetime, settings: OperatorSettings) -> float | None:
    """Seconds until the first worker of `attempt` passes its timeout if nothing renews
    meanwhile (0: already past); None: no worker is judged. A pass due then finds a hang when
    its timeout runs out, not up to a resync period later."""
    left = [stale.timeout - (now - stale.since).total_seconds()
            for _, stale in _judged(spec, observed.pods_of(attempt), observed, settings)]
    return max(0.0, min(left)) if left else None


def _heartbeat_fault(
    spec: PretrainJobSpec,
    pods: list[ObservedPod],
    observed: Observed,
    now: datetime,
    settings: OperatorSettings,
) -> Fault | None:
    """A hang once any worker is past its timeout. Blamed: a worker whose Lease expired (frozen
    or gone; its peers are usually waiting for it in a collective, still renewing), the
    longest silent; otherwise the one longest past its timeout."""
    expiry = EXPIRY_PERIODS * settings.heartbeat_period_seconds
    hung: list[tuple[float, ObservedPod, Staleness]] = []
    silent: list[tuple[float, ObservedPod, Staleness]] = []
    for pod, stale in _judged(spec, pods, observed, settings):
        over = (now - stale.since).total_seconds() - stale.timeout
        if over > 0:
            hung.append((over, pod, stale))
        quiet = (now - stale.renewed).total_seconds() if stale.renewed is not None else 0.0
        if quiet > expiry and not stale.finished:  # a finished worker stops renewing by design
            silent.append((quiet, pod, stale))
    if not hung:
        return None
    _, pod, stale = max(silent or hung, key=lambda entry: entry[0])
    # the timeout that ran out: the blamed worker's own, or, when it has been silent for less
    # than its phase allows (frozen before it ever reported training, say), the first peer's
    ran_out = stale if any(p is pod for _, p, _ in hung) else max(hung, key=lambda e: e[0])[2]
    age = (now - stale.since).total_seconds()
    if stale.finished:
        what = f"finished but still running {age:.0f}s later"
    elif stale.renewed is None:
        what = f"no first heartbeat for {age:.0f}s"
    elif silent:
        what = f"no heartbeat for {(now - stale.renewed).total_seconds():.0f}s"
    else:
        what = f"alive but no progress for {age:.0f}s"
    return Fault(
        ran_out.reason,
        f"pod {pod.name} on node {pod.node or '?'}: {what} (timeout {ran_out.timeout:.0f}s)",
        pod.name,
        pod.node,
    )


def detect_fault(
    spec: PretrainJobSpec,
    attempt: int,
    phase: str,
    observed: Observed,
    now: datetime,
    settings: OperatorSettings,
) -> Fault | None:
    """The fault that ends `attempt`, or None while its gang is healthy (or still starting)."""
    pods = observed.pods_of(attempt)
    failed = [p for p in pods if p.phase == "Failed"]
    if failed:
        faults = _first_to_fail(failed)
        return next((f for f in faults if f.permanent), faults[0])
    exited = [e for p in pods if (e := trainer_exited(p, observed)) is not None]
    if exited:
        faults = _first_to_fail(exited)
        return next((f for f in faults if f.permanent), faults[0])
    for pod in pods:
        if pod.terminating and not pod.finished:
            return _terminating(pod)
    if phase == "Running":
        present = {p.rank for p in pods}
        for rank in range(spec.nodes):
            if rank not in present:
                name = labels.worker_pod_name(observed.job.name, attempt, rank)
                return Fault(Reason.POD_DELETED, f"pod of node rank {rank} ({name}) "
                             "disappeared", name)
    for pod in pods:
        if not pod.finished:
            fault = _node_fault(pod, observed, now, settings)
            if fault is not None:
                return fault
    if phase != "Running":
        return None  # heartbeats are judged once the whole gang runs
    return (unreachable_fault(pods, observed, now, settings)
            or _heartbeat_fault(spec, pods, observed, now, settings))


PEER_SETTLE_SECONDS = 4 * PEER_PROBE_SECONDS
"""After an outage of the API server (or the operator's start), the launchers' rounds that
clear reports the outage held back."""


def unreachable_fault(pods: list[ObservedPod], observed: Observed, now: datetime,
                      settings: OperatorSettings) -> Fault | None:
    """A node its neighbours' launchers cannot reach (`Heartbeat.unreachable_ranks`, written
    by `hlat_trainer.peers`: reached in this attempt, then not for PEER_LOST_SECONDS) and that
    does not report them back: lost, seconds before its Node turns NotReady. Peers that report
    each other cannot reach one another but both still reach the API server: a network
    problem between them, left to the heartbeat timeout. Not judged in the first
    `PEER_SETTLE_SECONDS` after the operator got the API server back: a neighbour that came back
    during an outage is still reported until its launcher's next round clears it."""
    if _back_from_outage(observed, now, PEER_SETTLE_SECONDS):
        return None
    said: dict[int, set[int]] = {}
    for pod in pods:
        lease = observed.lease_of(pod)
        beat = lease.heartbeat if lease is not None else None
        if pod.rank is not None and not pod.finished and beat is not None:
            said[pod.rank] = set(beat.unreachable_ranks or ())
    for pod in sorted(pods, key=lambda p: p.rank if p.rank is not None else -1):
        if pod.rank is None or pod.finished:
            continue
        reporters = sorted(r for r, lost in said.items() if pod.rank in lost and r != pod.rank)
        if not reporters or said.get(pod.rank, set()) & set(reporters):
            continue
        who = ", ".join(str(r) for r in reporters)
        return Fault(Reason.NODE_LOST,
                     f"node {pod.node or '?'} of pod {pod.name} is unreachable from its peers "
                     f"(the launchers of node rank {who}, for {PEER_LOST_SECONDS:.0f}s or more)",
                     pod.name, pod.node, unreachable=True)
    return None


def heartbeat_ages(observed: Observed, attempt: int, now: datetime) -> dict[str, float]:
    """Seconds since each worker of `attempt` last renewed its Lease (for the metric)."""
    out: dict[str, float] = {}
    for pod in observed.pods_of(attempt):
        lease = observed.lease_of(pod)
        if lease is not None and lease.renew_time is not None:
            out[pod.name] = max(0.0, (now - lease.renew_time).total_seconds())
    return out
