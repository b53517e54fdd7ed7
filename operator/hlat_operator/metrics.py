"""The operator's Prometheus metrics, on its own registry.

Per job: goodput ratio with productive and badput seconds by cause (counters that follow
`status.goodput`: they start where the status stands when a job is first seen, so an operator
restart does not replay a job's history as an increase), uptime ratio (the paper's Table 1
measure, as a lasting signal rather than events), restarts by reason, node faults by node and
condition, time to recover, lost steps, heartbeat age, training step, the latest succeeded
evaluation's results with its checkpoint's step and tokens, evaluations by phase; and the number
of jobs per phase. Fed from each Decision (`observe`), so the numbers are exactly what the
status says. Labels are `namespace` and `pretrainjob` (not `job`, which Prometheus reserves
for the scrape target; the chart's ServiceMonitor sets honorLabels so `namespace` survives).
The trainer's own metrics (`hlat_train_*`: loss, tokens/s, MFU) come from the worker pods.
"""

from __future__ import annotations

import contextlib
import time
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from hlat_api.labels import INFRA_REASONS, Reason
from hlat_api.status import Badput, Evaluation, EvaluationPhase, Goodput, Phase
from hlat_operator.reconcile import Decision

PHASES: tuple[Phase, ...] = ("Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
EVALUATION_PHASES: tuple[EvaluationPhase, ...] = ("Running", "Succeeded", "Failed")
JOB_LABELS = ("namespace", "pretrainjob")
RECOVERY_BUCKETS = (5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
RESTART_REASONS = tuple(sorted(
    {Reason.POD_FAILED, Reason.KILLED, Reason.OOM_KILLED, Reason.STARTUP_TIMEOUT,
     Reason.HEARTBEAT_TIMEOUT, *INFRA_REASONS}))
"""The faults that restart a gang (a config error fails the job instead)."""
_CAUSE_FIELDS = {info.alias or name: name for name, info in Badput.model_fields.items()
                 if name != "unreported"}
"""`cause` label value -> Badput attribute. The label values are the status's own camelCase
keys (`dataWait`, as `status.goodput.badputSeconds` and docs/operator.md write them), so a
query written from either finds the series."""
BADPUT_CAUSES = tuple(_CAUSE_FIELDS)
"""Final causes only: `unreported` time moves to one of them later (a counter cannot go back)."""


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.uptime_ratio = Gauge(
            "hlat_job_uptime_ratio",
            "Running seconds over running + down seconds since the job first ran.",
            JOB_LABELS,
            registry=r,
        )
        self.running_seconds = Gauge(
            "hlat_job_running_seconds",
            "Seconds the job's gang has been running.",
            JOB_LABELS,
            registry=r,
        )
        self.down_seconds = Gauge(
            "hlat_job_down_seconds",
            "Seconds down (pending or restarting) since it first ran.",
            JOB_LABELS,
            registry=r,
        )
        self.restarts = Counter(
            "hlat_job_restarts",
            "Gang restarts, by the fault that caused them.",
            (*JOB_LABELS, "reason"),
            registry=r,
        )
        self.node_faults = Counter(
            "hlat_job_node_faults",
            "Gang restarts a node's health caused (no restart budget; the node is avoided), by "
            "node and by the condition that implicated it (AcceleratedHardwareReady, "
            "NeuronHealth, HyperPod's health label, NodeFaultExit) and its reason.",
            (*JOB_LABELS, "node", "condition", "condition_reason"),
            registry=r,
        )
        self._node_fault_series: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
        self.time_to_recover = Histogram(
            "hlat_job_time_to_recover_seconds",
            "From fault detection to every worker of the new gang training again.",
            ("namespace",),
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        self.lost_steps = Gauge(
            "hlat_job_lost_steps", "Steps recomputed after restarts.", JOB_LABELS, registry=r
        )
        self.heartbeat_age = Gauge(
            "hlat_job_heartbeat_age_seconds",
            "Seconds since the stalest worker of the current gang renewed its Lease.",
            JOB_LABELS,
            registry=r,
        )
        self.unschedulable = Gauge(
            "hlat_job_unschedulable_seconds",
            "How long the longest-waiting worker pod of the current gang has been unschedulable "
            "(0 once every pod is placed).",
            JOB_LABELS,
            registry=r,
        )
        self.queued = Gauge(
            "hlat_job_queued_seconds",
            "How long the job has waited for Kueue to admit its Workload (again after an "
            "eviction); 0 while admitted or when it is in no queue.",
            JOB_LABELS,
            registry=r,
        )
        self.spares_ready = Gauge(
            "hlat_job_spare_pods_ready",
            "Spare pods running with warm standby trainers (faultTolerance.spareNodes; 0 when "
            "the job asks for none).",
            JOB_LABELS,
            registry=r,
        )
        self.nodes = Gauge(
            "hlat_job_nodes",
            "Nodes the job's current attempt trains on (below hlat_job_nodes_desired while an "
            "elastic job, spec.elastic, is short of nodes).",
            JOB_LABELS,
            registry=r,
        )
        self.nodes_desired = Gauge(
            "hlat_job_nodes_desired", "spec.nodes: the size the job trains at when it can.",
            JOB_LABELS, registry=r)
        self.capacity_ratio = Gauge(
            "hlat_job_capacity_ratio",
            "Node-seconds trained over node-seconds asked for (spec.nodes), while Running.",
            JOB_LABELS, registry=r)
        self.worker_heartbeat_age = Gauge(
            "hlat_job_worker_heartbeat_age_seconds",
            "Seconds since each worker of the current gang renewed its Lease.",
            (*JOB_LABELS, "pod"),
            registry=r,
        )
        self.node_slowdown = Gauge(
            "hlat_node_step_slowdown_ratio",
            "Each node's own time per step (compute, data wait, host work) over the median "
            "of the other nodes' of its gang "
            "(1: as fast; above 1 + faultTolerance.stragglers.threshold for its window: a "
            "straggler). Eager CPU, XLA and CUDA workers.",
            (*JOB_LABELS, "node"),
            registry=r,
        )
        self.node_straggler = Gauge(
            "hlat_node_straggler",
            "1 for each node the operator flags a straggler by the job's own rule (over 1 + "
            "faultTolerance.stragglers.threshold for its window: the node the Straggler "
            "condition names); no series for the others.",
            (*JOB_LABELS, "node"),
            registry=r,
        )
        self.checkpoint_age = Gauge(
            "hlat_job_checkpoint_age_seconds",
            "Seconds since the latest complete checkpoint was first seen (the work a fault "
            "would now cost).",
            JOB_LABELS,
            registry=r,
        )
        self.goodput_ratio = Gauge(
            "hlat_job_goodput_ratio",
            "Productive training seconds over wall seconds since the job's first gang "
            "(suspended time excluded).",
            JOB_LABELS,
            registry=r,
        )
        self.productive = Counter(
            "hlat_job_productive_seconds",
            "Seconds of steps no earlier attempt had finished (less data wait and compile).",
            JOB_LABELS,
            registry=r,
        )
        self.badput = Counter(
            "hlat_job_badput_seconds",
            "Wall seconds that did not train, by cause.",
            (*JOB_LABELS, "cause"),
            registry=r,
        )
        self.lost_work = Counter(
            "hlat_job_lost_work_seconds",
            "Training seconds thrown away by restarts (lost steps x step time).",
            JOB_LABELS,
            registry=r,
        )
        self._goodput: dict[tuple[str, str], dict[str, float]] = {}
        self._pods: dict[tuple[str, str], set[str]] = {}
        self._nodes: dict[tuple[str, str], set[str]] = {}  # per job: nodes with a slowdown
        self._flagged: dict[tuple[str, str], set[str]] = {}  # per job: nodes flagged slow
        self.step = Gauge("hlat_job_step", "Latest training step reported.", JOB_LABELS, registry=r)
        self.attempt = Gauge("hlat_job_attempt", "Current restart attempt.", JOB_LABELS, registry=r)
        self.jobs = Gauge("hlat_jobs", "PretrainJobs by phase.", ("phase",), registry=r)
        self.phase = Gauge(
            "hlat_job_phase",
            "1 for the job's current phase, 0 for the others (alerts key on it).",
            (*JOB_LABELS, "phase"),
            registry=r,
        )
        self._phases: dict[tuple[str, str], Phase] = {}
        self.evaluation = Gauge(
            "hlat_job_evaluation",
            "The latest succeeded evaluation's results (status.evaluations: the Succeeded entry "
            "of the highest checkpoint step), one series per number its evaluator reported, "
            "named by `metric` (eval_loss, hellaswag_acc, ...); a name that evaluation did not "
            "report has no series.",
            (*JOB_LABELS, "metric"),
            registry=r,
        )
        self._results: dict[tuple[str, str], set[str]] = {}  # per job: metric names exported
        self.evaluation_step = Gauge(
            "hlat_job_evaluation_step",
            "The checkpoint step hlat_job_evaluation's results were measured at.",
            JOB_LABELS,
            registry=r,
        )
        self.evaluation_tokens = Gauge(
            "hlat_job_evaluation_tokens",
            "Tokens trained by the checkpoint hlat_job_evaluation's results were measured at "
            "(the x axis to plot them against).",
            JOB_LABELS,
            registry=r,
        )
        self.evaluations = Gauge(
            "hlat_job_evaluations",
            "Evaluation jobs on the job's checkpoints (spec.evaluation) by phase: Running, "
            "Succeeded, Failed, among the newest spec.evaluation.keep that status.evaluations "
            "lists (all three from the job's first evaluation on).",
            (*JOB_LABELS, "phase"),
            registry=r,
        )
        for phase in PHASES:
            self.jobs.labels(phase).set(0)
        # the operator itself: what a pass costs, how soon it follows what woke it, its load
        # on the API server (bench/bench_operator_scale.py reads these)
        self.pass_seconds = Histogram(
            "hlat_operator_pass_seconds", "Duration of one reconcile pass of one job "
            "(read the job, its pods, Leases and nodes; decide; write), including its wait "
            "for a free worker thread (hlat_operator_passes_waiting).",
            buckets=PASS_BUCKETS, registry=r)
        self.reaction_seconds = Histogram(
            "hlat_operator_reaction_seconds", "From a watch event about a job (the job, one of "
            "its pods, a trainer's exit) to the end of the pass it woke.",
            buckets=PASS_BUCKETS, registry=r)
        self.api_requests = Counter(
            "hlat_operator_api_requests", "Requests of the reconcile passes to the API server "
            "(kopf's watches not included).", ("verb",), registry=r)
        self.watch_events = Counter(
            "hlat_operator_watch_events", "Watch events received, by kind of object.",
            ("kind",), registry=r)
        self.passes_waiting = Gauge(
            "hlat_operator_passes_waiting", "Passes due and waiting for a worker thread: above "
            "zero for long, the operator is saturated (passes a watch event woke go first).",
            registry=r)

    def observe(self, namespace: str, job: str, decision: Decision) -> None:
        """Record one pass's outcome for one job."""
        s = decision.status
        labels = (namespace, job)
        if labels not in self._phases:
            self._start_at_zero(namespace, job)
        self._follow_goodput(labels, s.goodput)
        if s.uptime.ratio is not None:
            self.uptime_ratio.labels(*labels).set(s.uptime.ratio)
        self.running_seconds.labels(*labels).set(s.uptime.running_seconds)
        self.down_seconds.labels(*labels).set(s.uptime.down_seconds)
        self.lost_steps.labels(*labels).set(s.lost_steps)
        self.step.labels(*labels).set(s.progress.step)
        self.attempt.labels(*labels).set(s.attempt)
        self.unschedulable.labels(*labels).set(decision.unschedulable_seconds)
        self.queued.labels(*labels).set(decision.queued_seconds)
        self.spares_ready.labels(*labels).set(s.spares.ready if s.spares else 0)
        if s.size is not None:
            self.nodes.labels(*labels).set(s.size.nodes)
            self.nodes_desired.labels(*labels).set(s.size.desired)
        if decision.restarted and decision.fault is not None:
            self.restarts.labels(*labels, str(decision.fault.reason)).inc()
            problem = decision.fault.problem
            if problem is not None:
                series = (decision.fault.node or "", problem.condition, problem.reason)
                self.node_faults.labels(*labels, *series).inc()
                self._node_fault_series.setdefault(labels, set()).add(series)
        if decision.recovered_seconds is not None:
            self.time_to_recover.labels(namespace).observe(decision.recovered_seconds)
        if decision.heartbeat_ages:
            self.heartbeat_age.labels(*labels).set(max(decision.heartbeat_ages.values()))
        self._worker_ages(labels, decision.heartbeat_ages)
        self._slowdowns(labels, decision.slowdowns, decision.stragglers)
        self._evaluations(labels, s.evaluations)
        saved = s.latest_checkpoint.time if s.latest_checkpoint else None
        if saved:
            at = datetime.fromisoformat(saved.replace("Z", "+00:00")).timestamp()
            self.checkpoint_age.labels(*labels).set(max(0.0, time.time() - at))
        for phase in PHASES:
            self.phase.labels(*labels, phase).set(1 if phase == s.phase else 0)
        self._phases[labels] = s.phase
        self._count_phases()

    def _follow_goodput(self, labels: tuple[str, str], g: Goodput) -> None:
        """Counters advance by what the status gained since the last pass (never back)."""
        if g.ratio is not None:
            self.goodput_ratio.labels(*labels).set(g.ratio)
        if g.capacity is not None:
            self.capacity_ratio.labels(*labels).set(g.capacity)
        now = {f"badput:{c}": getattr(g.badput_seconds, _CAUSE_FIELDS[c]) for c in BADPUT_CAUSES}
        now["productive"], now["lost_work"] = g.productive_seconds, g.lost_work_seconds
        last = self._goodput.get(labels, {})
        for key, value in now.items():
            gain = value - last.get(key, 0.0)
            if gain <= 0:
                now[key] = last.get(key, 0.0)
                continue
            if key.startswith("badput:"):
                self.badput.labels(*labels, key.split(":", 1)[1]).inc(gain)
            elif key == "productive":
                self.productive.labels(*labels).inc(gain)
            else:
                self.lost_work.labels(*labels).inc(gain)
        self._goodput[labels] = now

    @staticmethod
    def _per_member(gauge: Gauge, seen: dict[tuple[str, str], set[str]],
                    labels: tuple[str, str], values: dict[str, float]) -> None:
        """One series per member (a worker pod, a node) of the job's current gang, or per
        result name of its latest evaluation; those of members no longer in it go."""
        for member in seen.get(labels, set()) - set(values):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels, member)
        for member, value in values.items():
            gauge.labels(*labels, member).set(value)
        seen[labels] = set(values)

    def _worker_ages(self, labels: tuple[str, str], ages: dict[str, float]) -> None:
        self._per_member(self.worker_heartbeat_age, self._pods, labels, ages)

    def _slowdowns(self, labels: tuple[str, str], ratios: dict[str, float],
                   flagged: list[str]) -> None:
        self._per_member(self.node_slowdown, self._nodes, labels, ratios)
        self._per_member(self.node_straggler, self._flagged, labels, dict.fromkeys(flagged, 1.0))

    def _evaluations(self, labels: tuple[str, str], entries: list[Evaluation]) -> None:
        """The newest Succeeded entry by step (the later one in the list on a tie): its results,
        one series per name (a name it lacks loses its series), step and tokens; and the
        entries per phase. Without such an entry, those series go: they say what the status
        says."""
        latest: Evaluation | None = None
        for entry in entries:
            if entry.phase == "Succeeded" and (latest is None or entry.step >= latest.step):
                latest = entry
        self._per_member(self.evaluation, self._results, labels,
                         latest.results if latest else {})
        for gauge, value in ((self.evaluation_step, latest.step if latest else None),
                             (self.evaluation_tokens, latest.tokens if latest else None)):
            if value is None:
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)
            else:
                gauge.labels(*labels).set(value)
        for phase in EVALUATION_PHASES:
            if entries:
                self.evaluations.labels(*labels, phase).set(
                    sum(1 for e in entries if e.phase == phase))
            else:
                with contextlib.suppress(KeyError):
                    self.evaluations.remove(*labels, phase)

    def _start_at_zero(self, namespace: str, job: str) -> None:
        """Counter and histogram series exist at 0 from the first time a job is seen, so
        `increase()` and `rate()` count its first restart (a series born at 1 counts nothing)."""
        for reason in RESTART_REASONS:
            self.restarts.labels(namespace, job, str(reason))
        self.time_to_recover.labels(namespace)
        for cause in BADPUT_CAUSES:
            self.badput.labels(namespace, job, cause)
        self.productive.labels(namespace, job)
        self.lost_work.labels(namespace, job)

    def forget(self, namespace: str, job: str) -> None:
        """The job was deleted: drop its series."""
        labels = (namespace, job)
        for gauge in (
            self.uptime_ratio,
            self.running_seconds,
            self.down_seconds,
            self.lost_steps,
            self.heartbeat_age,
            self.step,
            self.attempt,
            self.unschedulable,
            self.queued,
            self.spares_ready,
            self.nodes,
            self.nodes_desired,
            self.capacity_ratio,
            self.checkpoint_age,
            self.goodput_ratio,
            self.productive,
            self.lost_work,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        self._worker_ages(labels, {})
        self._slowdowns(labels, {}, [])
        self._evaluations(labels, [])
        self._results.pop(labels, None)
        for reason in RESTART_REASONS:
            with contextlib.suppress(KeyError):
                self.restarts.remove(*labels, str(reason))
        for cause in BADPUT_CAUSES:
            with contextlib.suppress(KeyError):
                self.badput.remove(*labels, cause)
        for series in self._node_fault_series.pop(labels, set()):
            with contextlib.suppress(KeyError):
                self.node_faults.remove(*labels, *series)
        self._goodput.pop(labels, None)
        for phase in PHASES:
            with contextlib.suppress(KeyError):
                self.phase.remove(*labels, phase)
        self._phases.pop(labels, None)
        self._count_phases()

    def _count_phases(self) -> None:
        for phase in PHASES:
            self.jobs.labels(phase).set(sum(1 for p in self._phases.values() if p == phase))

    def count_requests(self, api: Any) -> Any:
        """`api` (a kubernetes ApiClient) with every request counted by HTTP verb; returns it."""
        rest: Any = api.rest_client
        send = rest.request

        def request(method: str, *args: Any, **kwargs: Any) -> Any:
            self.api_requests.labels(method).inc()
            return send(method, *args, **kwargs)

        rest.request = request
        return api

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
