"""A fake cluster for the operator's unit tests: decide() in a loop on a fake clock.

`World` applies each Decision's actions the way the API server and the process kubelet would
(pods scheduled onto ready nodes that their affinity allows, deletions that take effect at
once unless the node is dead), so tests script what a user would see: a job created, a worker
killed, a node lost, the operator itself stopped mid-pass.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from hlat_api import labels
from hlat_api.heartbeat import Heartbeat
from hlat_api.status import PretrainJobStatus
from hlat_operator import evaluations
from hlat_operator.builders import AVOIDED_ANNOTATION, JobRef
from hlat_operator.config import OperatorSettings
from hlat_operator.evaluations import JobState, ObservedEvaluation
from hlat_operator.observe import (
    Observed,
    ObservedLease,
    ObservedNode,
    ObservedPod,
    OperatorState,
    format_time,
)
from hlat_operator.queueing import Queueing
from hlat_operator.reconcile import (
    CreateObject,
    Decision,
    DeleteJob,
    DeleteObject,
    DeletePod,
    EmitEvent,
    PatchLease,
    PatchPod,
    PatchState,
    PatchStatus,
    SetWorkloadActive,
    WriteWorkloadStatus,
    decide,
)

T0 = datetime(2025, 1, 1, tzinfo=UTC)
JOB = JobRef("tiny", "default", "uid-1")
SETTINGS = OperatorSettings(
    heartbeat_period_seconds=2.0,
    min_heartbeat_timeout_seconds=5.0,
    status_interval_seconds=10.0,
    force_delete_after_seconds=30.0,
)


def apply_merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = apply_merge_patch(out[key], value)
        else:
            out[key] = value
    return out


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def raw_spec(**overrides: Any) -> dict[str, Any]:
    """A tiny 2-node CPU job (like examples/pretrainjob-tiny.yaml); overrides by camelCase path."""
    spec: dict[str, Any] = {
        "image": "hlat-trainer:dev",
        "nodes": 2,
        "instanceType": "cpu",
        "processesPerNode": 1,
        "model": {"preset": "tiny"},
        "precision": "fp32",
        "optimizer": {"lr": 3e-3, "minLr": 3e-4, "warmupSteps": 10},
        "data": {"path": "/fsx/data", "tokenizer": "bytes", "seqLen": 128},
        "train": {"globalBatch": 8, "microBatch": 4, "steps": 120},
        "checkpoint": {"dir": "/fsx/checkpoints", "interval": 20},
        "storage": {"claimName": "hlat-shared", "mountPath": "/fsx"},
        "faultTolerance": {
            "restartStrategy": "RecreateGang",  # test_reconcile_inplace: InPlace, the default
            "maxRestarts": 5,
            "backoff": {"initialSeconds": 4, "maxSeconds": 30},
            "heartbeat": {"startupTimeoutSeconds": 60},
            "noProgressRestarts": 3,
        },
    }
    for path, value in overrides.items():
        node = spec
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return spec


class World:
    """One PretrainJob, its pods/leases, and nodes; `now` moves only when a test says so."""

    def __init__(
        self,
        spec: dict[str, Any] | None = None,
        nodes: tuple[str, ...] = ("node-a", "node-b", "node-c"),
        settings: OperatorSettings = SETTINGS,
    ) -> None:
        self.spec = spec if spec is not None else raw_spec()
        self.settings = settings
        self.now = T0
        self.status = PretrainJobStatus()
        self.state = OperatorState()
        self.pods: dict[str, ObservedPod] = {}
        self.avoid: dict[str, list[str]] = {}
        self.requires: dict[str, list[tuple[str, list[str]]]] = {}
        """Required node-label expressions (key In values) per pod."""
        self.prefers: dict[str, list[dict[str, Any]]] = {}
        """Preferred node-affinity terms per pod (kube-scheduler's NodeAffinity score)."""
        self.nodes = {n: ObservedNode(n) for n in nodes}
        self.leases: dict[str, ObservedLease] = {}
        self.lease_patches: list[PatchLease] = []
        """The operator's writes to worker Leases (checkpoint requests), in order."""
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[EmitEvent] = []
        self.deleted = False
        self.status_writes = 0
        self.seeing_since: datetime | None = None  # the operator got the API server back
        self.queueing: Queueing | None = None
        """The job's Kueue queue and Workload as the operator would read them."""
        self.workload_writes: list[WriteWorkloadStatus] = []
        self.workload_active: list[bool] = []
        """The spec.active values the operator set on the Workload, in order."""
        self.generation = 1
        """metadata.generation: 1 until the spec is edited."""
        self.eval_jobs: dict[int, ObservedEvaluation] = {}
        """Evaluation Jobs by checkpoint step, as evaluations.observe_jobs reads them."""
        self.refuse_jobs = False
        """The API server refuses evaluation Jobs (k8s.Kube tells it in an event instead)."""

    # --- the operator's side ------------------------------------------------------------------

    def observed(self) -> Observed:
        return Observed(
            job=JOB,
            pods=list(self.pods.values()),
            nodes=dict(self.nodes),
            leases=dict(self.leases),
            state=self.state,
            generation=self.generation,
            seeing_since=self.seeing_since,
            queueing=self.queueing,
            evaluations=dict(self.eval_jobs) if evaluations.watched(
                {"spec": self.spec, "status": self.status.model_dump(by_alias=True)}) else None,
        )

    def decide(self) -> Decision:
        return decide(self.spec, self.status, self.observed(), self.now, self.settings)

    def step(self, crash_after: int | None = None) -> Decision:
        """One operator pass; `crash_after=k` applies only its first k actions (a crash)."""
        d = self.decide()
        for action in d.actions[:crash_after]:
            self.apply(action)
        return d

    def apply(self, action: object) -> None:
        if isinstance(action, PatchStatus):  # a JSON merge patch, as the API server applies it
            stored = self.status.model_dump(mode="json", by_alias=True, exclude_none=True)
            self.status = PretrainJobStatus.model_validate(
                apply_merge_patch(stored, copy.deepcopy(action.status)))
            self.status_writes += 1
        elif isinstance(action, PatchState):
            self.state = OperatorState.model_validate_json(action.annotation)
        elif isinstance(action, EmitEvent):
            self.events.append(action)
        elif isinstance(action, CreateObject):
            self._create(action)
        elif isinstance(action, DeletePod):
            self._delete_pod(action)
        elif isinstance(action, PatchPod):
            pod = self.pods[action.name]
            moved = action.annotations.get(labels.ATTEMPT_STARTED)
            rank = action.labels.get(labels.NODE_RANK)
            self.pods[action.name] = replace(
                pod, attempt=int(action.labels.get(labels.ATTEMPT) or pod.attempt or 0),
                rank=int(rank) if rank is not None else pod.rank,
                spare=pod.spare and action.labels.get(labels.SPARE, "") is not None,
                started_at=self.now if moved else pod.started_at)
        elif isinstance(action, PatchLease):
            self.lease_patches.append(action)
        elif isinstance(action, DeleteObject) and action.kind != "Lease":
            self.objects.pop((action.kind, action.name), None)
        elif isinstance(action, DeleteObject):
            self.leases.pop(action.name, None)
        elif isinstance(action, DeleteJob):
            self.deleted = True
        elif isinstance(action, WriteWorkloadStatus):
            self.workload_writes.append(action)
        elif isinstance(action, SetWorkloadActive):
            self.workload_active.append(action.active)

    def _create(self, action: CreateObject) -> None:
        obj: dict[str, Any] = dict(action.obj)
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Pod":
            if name in self.pods:
                return
            lab = obj["metadata"]["labels"]
            terms = obj["spec"].get("affinity", {}).get("nodeAffinity", {})
            req = terms.get("requiredDuringSchedulingIgnoredDuringExecution", {})
            avoid = [
                v
                for t in req.get("nodeSelectorTerms", [])
                for e in t.get("matchFields", [])
                for v in e["values"]
            ]
            self.avoid[name] = avoid
            self.requires[name] = [(e["key"], e["values"])
                                   for t in req.get("nodeSelectorTerms", [])
                                   for e in t.get("matchExpressions", [])]
            self.prefers[name] = terms.get("preferredDuringSchedulingIgnoredDuringExecution", [])
            noted = obj["metadata"].get("annotations", {}).get(AVOIDED_ANNOTATION)
            self.pods[name] = ObservedPod(
                name, int(lab[labels.ATTEMPT]) if labels.ATTEMPT in lab else None,
                int(lab[labels.NODE_RANK]) if labels.NODE_RANK in lab else None,
                created_at=self.now,
                avoided=None if noted is None else tuple(n for n in noted.split(",") if n),
                spare=labels.SPARE in lab, hostname=obj["spec"].get("hostname"),
            )
        elif kind == "Job":
            step = int(obj["metadata"]["labels"][labels.STEP])
            if self.refuse_jobs:
                assert action.refused is not None  # the Kube tells it; the pass goes on
                self.events.append(EmitEvent("Warning", action.refused, f"create Job {name}"))
            elif step not in self.eval_jobs:
                self.eval_jobs[step] = ObservedEvaluation(step, name, "Active")
                self.objects[(kind, name)] = obj
        elif kind == "Lease":
            if name not in self.leases:
                self.leases[name] = ObservedLease(name)
            if action.replace or (kind, name) not in self.objects:
                self.objects[(kind, name)] = obj
        elif action.replace or (kind, name) not in self.objects:
            self.objects[(kind, name)] = obj

    def _delete_pod(self, action: DeletePod) -> None:
        pod = self.pods.get(action.name)
        if pod is None:
            return
        node = self.nodes.get(pod.node) if pod.node else None
        gone_at_once = action.grace_seconds == 0 or pod.node is None or pod.finished
        if gone_at_once or (node is not None and node.ready):
            del self.pods[action.name]  # a live kubelet confirms at once (SIGTERM -> exit)
        elif pod.deletion_timestamp is None:
            self.pods[action.name] = replace(pod, deletion_timestamp=self.now)

    # --- the cluster's side -------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def schedule(self) -> None:
        """Bind pending pods to distinct ready nodes their affinity allows, and start them; a
        pod that fits nowhere is marked Unschedulable, as kube-scheduler does."""
        used = {p.node for p in self.pods.values() if p.node and not p.finished}
        for name, pod in sorted(self.pods.items()):
            if pod.node is not None or pod.terminating:
                continue
            free = sorted((
                n
                for n, node in sorted(self.nodes.items())
                if node.ready and n not in used and n not in self.avoid.get(name, [])
                and all(node.labels.get(k) in v for k, v in self.requires.get(name, []))
            ), key=lambda n: -self._preference(name, n))
            if not free:
                if pod.unschedulable_since is None:
                    self.pods[name] = replace(
                        pod, unschedulable_since=self.now,
                        schedule_message=f"0/{len(self.nodes)} nodes are available")
                continue
            used.add(free[0])
            self.pods[name] = replace(pod, node=free[0], phase="Running", started_at=self.now,
                                      unschedulable_since=None, schedule_message="")

    def _preference(self, pod: str, node: str) -> int:
        """The sum of the weights of the pod's preferred terms the node matches."""
        labels_ = self.nodes[node].labels
        score = 0
        for term in self.prefers.get(pod, []):
            pref = term["preference"]
            fields = all(node in e["values"] for e in pref.get("matchFields", []))
            exprs = all(labels_.get(e["key"]) in e["values"]
                        for e in pref.get("matchExpressions", []))
            score += term["weight"] if fields and exprs else 0
        return score

    def live(self) -> list[ObservedPod]:
        return [p for p in self.pods.values() if not p.finished]

    def beat(self, step: int, phase: str = "training", **fields: Any) -> None:
        """Every running worker renews its Lease now."""
        for pod in self.pods.values():
            if pod.phase != "Running" or pod.terminating:
                continue
            hb = Heartbeat.model_validate(
                {
                    "phase": phase,
                    "step": step,
                    "tokens": step * 1024.0,
                    "attempt": pod.attempt,
                    "step_seconds": 0.5,
                    **fields,
                }
            )
            name = labels.worker_lease_name(JOB.name, pod.attempt or 0, pod.rank or 0)
            old = self.leases.get(name)
            if old is not None and old.heartbeat is not None:  # a merge patch: the launcher's
                hb = hb.model_copy(update={  # report (report_unreachable) stays beside it
                    k: getattr(old.heartbeat, k) for k in ("unreachable_ranks",
                                                           "unreachable_since")})
            self.leases[name] = ObservedLease(name, self.now, hb)

    def peers_unreachable(self, rank: int, ranks: list[int]) -> None:
        """The launcher of node rank `rank` reports the neighbours it cannot reach
        (agent.LeaseControl.report_unreachable: two annotations patched, the trainer's last
        beat and its renewTime kept)."""
        pod = self.pod_of(rank)
        name = labels.worker_lease_name(JOB.name, pod.attempt or 0, rank)
        old = self.leases.get(name)
        last = old.heartbeat if old is not None and old.heartbeat is not None else Heartbeat()
        hb = last.model_copy(update={"unreachable_ranks": ranks,
                                     "unreachable_since": self.now if ranks else None})
        self.leases[name] = ObservedLease(name, old.renew_time if old else None, hb)

    def trainer_exit(self, rank: int, exit_code: int = 137, reason: str | None = None) -> None:
        """An in-place launcher reports that the trainer of rank `rank` exited (the pod stays)."""
        pod = self.pod_of(rank)
        name = labels.worker_lease_name(JOB.name, pod.attempt or 0, rank)
        old = self.leases.get(name)
        # the launcher patches these three annotations (agent.LeaseControl.report_exit): the
        # trainer's last beat stays beside them
        last = old.heartbeat if old is not None and old.heartbeat is not None else Heartbeat()
        hb = last.model_copy(update={"attempt": pod.attempt, "exit_code": exit_code,
                                     "exit_reason": reason})
        self.leases[name] = ObservedLease(name, old.renew_time if old else None, hb)

    def pod_of(self, rank: int) -> ObservedPod:
        return next(
            p for p in self.pods.values() if p.rank == rank and p.attempt == self.status.attempt
        )

    def fail(self, rank: int, exit_code: int = 137, reason: str | None = None) -> None:
        pod = self.pod_of(rank)
        self.pods[pod.name] = replace(pod, phase="Failed", exit_code=exit_code, reason=reason,
                                      finished_at=self.now)

    def succeed_all(self) -> None:
        for name, pod in list(self.pods.items()):
            if pod.phase == "Running":
                self.pods[name] = replace(pod, phase="Succeeded", exit_code=0)

    def end_evaluation(self, step: int, state: JobState, message: str | None) -> None:
        """The Job controller marks the evaluation Job of `step` Complete or Failed."""
        self.eval_jobs[step] = replace(self.eval_jobs[step], state=state, message=message)

    def node_down(self, node: str) -> None:
        self.nodes[node] = replace(self.nodes[node], ready=False, not_ready_since=self.now)

    def node_up(self, node: str) -> None:
        self.nodes[node] = replace(self.nodes[node], ready=True, not_ready_since=None)

    def run(self, seconds: float, every: float = 1.0, step: int | None = None) -> None:
        """Let time pass with the operator acting every `every` s (workers beat if step given)."""
        t = 0.0
        while t < seconds:
            self.schedule()
            if step is not None:
                self.beat(step)
            self.step()
            self.advance(every)
            t += every

    def until(self, phase: str, limit: float = 300, step: int | None = None) -> float:
        """Advance until the status phase is `phase`; returns the seconds it took."""
        start = self.now
        while self.status.phase != phase:
            assert (self.now - start).total_seconds() < limit, f"stuck in {self.status.phase}"
            self.run(1.0, step=step)
        return (self.now - start).total_seconds()

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]


def stamp(seconds: float) -> str:
    return format_time(at(seconds))
