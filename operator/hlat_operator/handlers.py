"""Thin kopf handlers: keep one reconcile loop per PretrainJob running and wake it on events.

A pass is `observe -> decide -> k8s.execute -> metrics` (`reconcile_once`). Each job has one
asyncio task (`_job_loop`) that runs a pass, then sleeps until the Decision's requeue time or
until a watch event about the job (the job itself, or one of its worker pods) wakes it. Passes
of one job never overlap; the blocking Kubernetes client runs in a worker thread, admitted by
`passgate` (jobs a watch event woke before jobs whose timer came round).

Why `kopf.on.event` and own tasks rather than kopf's create/update handlers, timers or daemons:
those persist handler progress on the object (annotations that bump its resourceVersion and
race the status writes) and add a finalizer (a job could not be deleted while the operator is
down). The event handlers here keep nothing on the object; every pass reads the job afresh,
so an operator started at any moment (kopf lists every existing job at start) carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client
from kubernetes import config as kube_config

from hlat_api.apitimeouts import bound_requests
from hlat_api.labels import COMPONENT, EVALUATION, JOB, REPORTED, WORKER, Reason
from hlat_api.manifest import API_GROUP, API_VERSION
from hlat_api.status import PretrainJobStatus
from hlat_operator import evaluations, heap, late_apis, observe, queueing
from hlat_operator.builders import JobRef
from hlat_operator.config import OperatorSettings
from hlat_operator.k8s import PLURAL, Conflict, K8sError, Kube, Rejected
from hlat_operator.metrics import OperatorMetrics
from hlat_operator.passgate import PassGate
from hlat_operator.reconcile import Decision, EmitEvent, PatchState, PatchStatus, decide, reject

log = logging.getLogger("hlat_operator")

POD_SELECTOR = f"{JOB},{COMPONENT}={WORKER}"
"""The pods the operator watches: workers of some PretrainJob."""
EVALUATION_SELECTOR = f"{JOB},{COMPONENT}={EVALUATION}"
"""The batch Jobs the operator watches: evaluation Jobs of some PretrainJob."""

MAX_IDLE_SECONDS = 30.0
"""Longest sleep between passes of a job even when the Decision asks for none."""
ERROR_RETRY_SECONDS = 2.0
"""First retry after a failed pass; doubles per failure in a row (429, 5xx, timeouts)."""
MAX_ERROR_RETRY_SECONDS = 60.0


class JobGone(Exception):
    """The PretrainJob no longer exists: its loop ends."""


@dataclass
class Runtime:
    settings: OperatorSettings
    kube: Kube
    metrics: OperatorMetrics
    tasks: dict[tuple[str, str], asyncio.Task[None]] = field(default_factory=dict)
    wakes: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    woken_at: dict[tuple[str, str], float] = field(default_factory=dict)
    """When a watch event first woke a job's loop since its last pass began (monotonic)."""
    quiet: dict[tuple[str, str], int] = field(default_factory=dict)
    """Jobs whose last pass only refreshed their status (no phase change, nothing done to pods
    or Leases), with the generation it saw: that write's own watch event needs no pass."""
    passing: set[tuple[str, str]] = field(default_factory=set)
    """Jobs whose pass is running: a modification of the job seen meanwhile (most likely the
    pass's own write) is held in `deferred` until the pass says whether it was quiet."""
    deferred: dict[tuple[str, str], set[Any]] = field(default_factory=dict)
    """The generations of the job modifications held back during a pass."""
    gate: PassGate = field(default_factory=PassGate)
    """Admits passes to the worker threads, jobs a watch event woke first."""
    api_lost: bool = False
    """A pass could not reach the API server (connection refused or dropped, timeout, 5xx)."""
    api_back_at: datetime | None = None
    """Since when the operator sees: its start, or a pass reaching the API server again after
    it was lost (Observed.seeing_since)."""
    following: list[asyncio.Task[None]] = field(default_factory=list)
    """late_apis: the watches kopf misses after the start (APIs served later: Kueue's
    Workloads; namespaces created in a gap of its namespace watch)."""


_runtime: Runtime | None = None
_settings: OperatorSettings | None = None
_metrics_port: int | None = None
_insights: Any = None
_namespaces: list[str] = []

FOLLOWED = ((API_GROUP, PLURAL), (queueing.GROUP, "workloads"))
"""The custom resources the handlers watch, which may be installed after the operator."""


def configure(settings: OperatorSettings, metrics_port: int | None = None,
              insights: Any = None, namespaces: list[str] | None = None) -> None:
    """Called by the CLI before kopf starts: the settings, the metrics port (0: none), the
    kopf Insights it passes to kopf.run (late_apis reads which resources and namespaces kopf
    watches) and the namespaces it watches (globs allowed; none: the whole cluster)."""
    global _settings, _metrics_port, _insights, _namespaces
    _settings, _metrics_port, _insights = settings, metrics_port, insights
    _namespaces = list(namespaces or [])


def runtime() -> Runtime:
    if _runtime is None:
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return _runtime


def api_client() -> client.ApiClient:
    """In a pod, its ServiceAccount; elsewhere $KUBECONFIG."""
    try:
        kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kube_config.ConfigException:
        kube_config.load_kube_config()  # type: ignore[no-untyped-call]
    return bound_requests(client.ApiClient())


# --- one pass ------------------------------------------------------------------------------


def _component(pod: Mapping[str, Any]) -> str | None:
    component: str | None = ((pod.get("metadata") or {}).get("labels") or {}).get(
        COMPONENT)
    return component


def _observe(rt: Runtime, namespace: str, name: str) -> tuple[Any, observe.Observed]:
    body = rt.kube.get_job(namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        raise JobGone(f"{namespace}/{name}")
    watched = evaluations.watched(body)
    listed = rt.kube.job_pods(namespace, name, evaluations=watched)
    pods = [p for p in listed if _component(p) == WORKER]
    leases = rt.kube.job_leases(namespace, name)
    nodes = rt.kube.nodes(wanted={str((p.get("spec") or {}).get("nodeName"))
                                  for p in pods if (p.get("spec") or {}).get("nodeName")})
    if rt.api_lost:
        rt.api_lost, rt.api_back_at = False, datetime.now(UTC)
        log.warning("the API server answers again: heartbeats and node readiness are judged "
                    "from now on, not from before it was lost")
    observed = observe.observe(body, pods, nodes, leases)
    queued = rt.kube.queueing(observed.job, (body.get("metadata") or {}).get("labels") or {})
    evaluated = None
    if watched:
        evaluated = evaluations.observe_jobs(
            rt.kube.evaluation_jobs(namespace, name),
            [p for p in listed if _component(p) == EVALUATION])
    return body, replace(observed, seeing_since=rt.api_back_at, queueing=queued,
                         evaluations=evaluated)


def reconcile_once(rt: Runtime, namespace: str, name: str) -> float | None:
    """observe -> decide -> execute -> metrics for one job; returns the requeue delay."""
    rt.quiet.pop((namespace, name), None)
    body, observed = _observe(rt, namespace, name)
    status = observe.status_from_raw(body.get("status"))
    now = datetime.now(UTC)
    decision = decide(body.get("spec") or {}, status, observed, now, rt.settings)
    job: JobRef = observed.job
    try:
        rt.kube.execute(job, decision, read=body)
    except Conflict as err:
        log.info("%s/%s: stale view, deciding again (%s)", namespace, name, err)
        return rt.settings.fast_requeue_seconds
    except Rejected as err:
        log.warning("%s/%s: %s; the job fails", namespace, name, err)
        body, observed = _observe(rt, namespace, name)  # the pass may have written status
        status = observe.status_from_raw(body.get("status"))
        decision = reject(status, observed, datetime.now(UTC), rt.settings, str(err))
        rt.kube.execute(job, decision)
    rt.metrics.observe(namespace, name, decision)
    if quiet(decision, status) and observed.generation is not None:
        rt.quiet[(namespace, name)] = observed.generation
    if decision.status.phase != status.phase:
        failure = decision.status.last_failure
        why = (f": {failure.reason}: {failure.message}"
               if failure is not None and decision.status.phase in ("Restarting", "Failed")
               else "")
        log.info(
            "%s/%s: %s -> %s (attempt %d, restarts %d)%s",
            namespace,
            name,
            status.phase or "-",
            decision.status.phase,
            decision.status.attempt,
            decision.status.restarts.total,
            why,
        )
    return decision.requeue_after


async def _job_loop(rt: Runtime, namespace: str, name: str) -> None:
    key = (namespace, name)
    wake = rt.wakes.setdefault(key, asyncio.Event())
    errors = 0
    try:
        while True:
            began = time.monotonic()
            async with rt.gate.slot(key, woken=key in rt.woken_at):
                wake.clear()  # what happened while waiting for a slot, this pass reads
                woken = rt.woken_at.pop(key, None)
                rt.passing.add(key)
                try:
                    requeue = await asyncio.to_thread(reconcile_once, rt, namespace, name)
                    errors = 0
                    done = time.monotonic()
                    rt.metrics.pass_seconds.observe(done - began)
                    if woken is not None:
                        rt.metrics.reaction_seconds.observe(done - woken)
                except JobGone:
                    log.info("%s/%s: gone; its loop ends", namespace, name)
                    rt.metrics.forget(namespace, name)
                    return
                except K8sError as err:
                    if err.status is None or err.status >= 500:
                        rt.api_lost = True
                    errors += 1
                    requeue = error_backoff(errors)
                    log.warning("%s/%s: %s; retrying in %gs", namespace, name, err, requeue)
                    if errors == 1 or errors % 10 == 0:  # said once, then now and again
                        await asyncio.to_thread(
                            rt.kube.emit_event,
                            JobRef(name, namespace, _uid(rt, namespace, name)),
                            "Warning", Reason.API_ERROR,
                            f"{err}; retrying with backoff (failure {errors} in a row)")
                except Exception:  # a bug must not kill the loop of this job for good
                    log.exception("%s/%s: pass failed; retrying", namespace, name)
                    errors += 1
                    requeue = error_backoff(errors)
                finally:
                    _settle_deferred(rt, key)
            delay = MAX_IDLE_SECONDS if requeue is None else min(requeue, MAX_IDLE_SECONDS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=max(0.05, delay))
    finally:
        rt.tasks.pop(key, None)
        rt.wakes.pop(key, None)
        rt.woken_at.pop(key, None)
        rt.quiet.pop(key, None)
        rt.passing.discard(key)
        rt.deferred.pop(key, None)


def _settle_deferred(rt: Runtime, key: tuple[str, str]) -> None:
    """After a pass: the job modifications seen during it wake the loop again, unless the pass
    was quiet and they were all at the generation it saw (its own writes' echoes)."""
    rt.passing.discard(key)
    held = rt.deferred.pop(key, None)
    if held and held != {rt.quiet.get(key)} and key in rt.wakes:
        rt.woken_at.setdefault(key, time.monotonic())
        rt.wakes[key].set()


def quiet(decision: Decision, before: PretrainJobStatus) -> bool:
    """Whether a pass only refreshed the job's status (progress, uptime, goodput): the phase
    stays and its actions are writes to the job and Events. The watch event of that write
    tells the job's loop nothing it does not know; waking for it doubled the passes at 500
    jobs. Any other pass keeps the wake, as does every change a user makes (`on_job`)."""
    return decision.status.phase == before.phase and all(
        isinstance(a, (PatchState, PatchStatus, EmitEvent)) for a in decision.actions)


def error_backoff(failures: int) -> float:
    """Seconds before the next pass after `failures` failed passes in a row."""
    return float(min(MAX_ERROR_RETRY_SECONDS, ERROR_RETRY_SECONDS * 2 ** (failures - 1)))


def _uid(rt: Runtime, namespace: str, name: str) -> str:
    """The job's uid for an Event about it ("" when even that read fails)."""
    try:
        body = rt.kube.get_job(namespace, name)
    except K8sError:
        return ""
    return str(((body or {}).get("metadata") or {}).get("uid", ""))


def _poke(namespace: str, name: str, start: bool = False) -> None:
    rt = runtime()
    key = (namespace, name)
    if key in rt.tasks or start:
        rt.woken_at.setdefault(key, time.monotonic())
    if key in rt.tasks:
        rt.wakes[key].set()
        rt.gate.promote(key)
    elif start:
        rt.wakes[key] = asyncio.Event()
        rt.tasks[key] = asyncio.get_running_loop().create_task(
            _job_loop(rt, namespace, name), name=f"pretrainjob {namespace}/{name}"
        )


# --- kopf handlers -------------------------------------------------------------------------


def configure_kopf(settings: kopf.OperatorSettings, ours: OperatorSettings) -> None:
    settings.posting.enabled = False  # our Events are the transitions, written by k8s.py
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    settings.watching.connect_timeout = 10
    settings.watching.chunk_size = ours.list_chunk or None  # the initial listings, paged
    settings.queueing.idle_timeout = ours.event_idle_seconds
    # server-side: the API server sends only our workers' events (kopf's `labels=` on the
    # handler alone filters client-side, after every pod of the cluster crossed the wire)
    settings.watching.label_selectors["v1", "pods"] = POD_SELECTOR
    settings.watching.label_selectors["coordination.k8s.io", "v1", "leases"] = (
        f"{JOB},{REPORTED}")
    settings.watching.label_selectors[queueing.GROUP, queueing.VERSION, "workloads"] = JOB
    settings.watching.label_selectors["batch", "v1", "jobs"] = EVALUATION_SELECTOR


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _runtime
    ours = _settings or OperatorSettings.from_env()
    configure_kopf(settings, ours)
    # it cannot have heard what went silent before it started (a leader that lost its Lease in
    # an outage of the API server and was restarted, a standby taking over): from now on
    metrics = OperatorMetrics()
    kube = Kube(metrics.count_requests(api_client()))
    if ours.watch_nodes:
        kube.start_node_watch()
    rt = Runtime(ours, kube, metrics, api_back_at=datetime.now(UTC))
    metrics.passes_waiting.set_function(lambda: rt.gate.queued)
    heap.start()
    port = ours.metrics_port if _metrics_port is None else _metrics_port
    if port:
        rt.metrics.serve(port)
        log.info("metrics on :%d/metrics", port)
    if _insights is not None:
        rt.following.append(asyncio.create_task(late_apis.follow(
            _insights, settings, kopf.get_default_registry(), FOLLOWED)))
        if _namespaces:
            rt.following.append(asyncio.create_task(late_apis.follow_namespaces(
                _insights, settings, _namespaces)))
    _runtime = rt
    log.info("hlat-operator started; trainer command %s", " ".join(ours.trainer_command))


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if _runtime is None:
        return
    if _runtime.kube.node_watch is not None:
        _runtime.kube.node_watch.stop()
    tasks = list(_runtime.tasks.values()) + _runtime.following
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@kopf.on.probe(id="jobs")
def probe_jobs(**_: Any) -> int:
    """Liveness: the number of jobs with a running reconcile loop."""
    return len(runtime().tasks)


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def on_job(event: kopf.RawEvent, name: str | None, namespace: str | None, **_: Any) -> None:
    rt = runtime()
    rt.metrics.watch_events.labels("PretrainJob").inc()
    if not name or not namespace:
        return
    if own_refresh(rt, namespace, name, event):
        return
    _poke(namespace, name, start=event.get("type") != "DELETED")


def own_refresh(rt: Runtime, namespace: str, name: str, event: Mapping[str, Any]) -> bool:
    """Whether a job event needs no pass now: a modification (not a deletion, not a new job) of
    a job whose loop runs, while a pass runs (held until it ends: `_settle_deferred`), or at the
    generation its last, quiet, pass saw: the echo of the operator's own status write, or at
    most a change outside the spec that the next resync reads (the operator alone writes the
    status and its state annotation). A spec edit bumps the generation and always wakes."""
    key = (namespace, name)
    meta = (event.get("object") or {}).get("metadata") or {}
    if (event.get("type") != "MODIFIED" or key not in rt.tasks
            or meta.get("deletionTimestamp")):
        return False
    if key in rt.passing:
        rt.deferred.setdefault(key, set()).add(meta.get("generation"))
        return True
    return meta.get("generation") == rt.quiet.get(key)


@kopf.on.event("coordination.k8s.io", "v1", "leases",
               labels={JOB: kopf.PRESENT, REPORTED: kopf.PRESENT})
async def on_launcher_report(labels: kopf.Labels, namespace: str | None, **_: Any) -> None:
    """A launcher reported its trainer's exit (in-place restarts keep the pod, so no pod
    event says so), or neighbours it cannot reach (a node lost, seconds before its Node says
    so): decide now, not at the next resync."""
    runtime().metrics.watch_events.labels("Lease").inc()
    job = labels.get(JOB)
    if job and namespace:
        _poke(namespace, job)


@kopf.on.event(queueing.GROUP, queueing.VERSION, "workloads", labels={JOB: kopf.PRESENT})
async def on_workload(labels: kopf.Labels, namespace: str | None, **_: Any) -> None:
    """Kueue wrote a job's Workload (admitted, evicted, requeued): decide now. Without Kueue
    installed kopf logs once that it cannot serve this resource (`Unresolved resources`), and
    starts the watch if Kueue's CRDs appear later."""
    runtime().metrics.watch_events.labels("Workload").inc()
    job = labels.get(JOB)
    if job and namespace:
        _poke(namespace, job)


@kopf.on.event("batch", "v1", "jobs", labels={JOB: kopf.PRESENT})
async def on_evaluation_job(labels: kopf.Labels, namespace: str | None, **_: Any) -> None:
    """An evaluation Job changed (its pod started, the Job controller marked it Complete or
    Failed): report it now, not at the next resync (a finished PretrainJob has no other
    event to wake it)."""
    runtime().metrics.watch_events.labels("Job").inc()
    job = labels.get(JOB)
    if job and namespace:
        _poke(namespace, job)


@kopf.on.event("", "v1", "pods", labels={JOB: kopf.PRESENT})
async def on_pod(labels: kopf.Labels, namespace: str | None, **_: Any) -> None:
    runtime().metrics.watch_events.labels("Pod").inc()
    job = labels.get(JOB)
    if job and namespace:
        _poke(namespace, job)
