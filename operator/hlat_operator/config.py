"""Operator settings: what differs between EKS, the local rig and tests, read from HLAT_OPERATOR_*.

Everything a PretrainJob's author controls lives in its spec; these are the knobs of the
operator's deployment (the Helm chart sets them as env vars). Each field documents its unit,
default and why it exists. `OperatorSettings.from_env()` reads `HLAT_OPERATOR_<FIELD>` (upper
case); lists are JSON (`HLAT_OPERATOR_TRAINER_COMMAND='["/abs/hlat-launch"]'`) or a
space-separated string.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hlat_api.heartbeat import DEFAULT_PERIOD_SECONDS

ENV_PREFIX = "HLAT_OPERATOR_"


class SettingsError(ValueError):
    """A HLAT_OPERATOR_* variable that does not parse; names the variable."""


class OperatorSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    namespace: str | None = None
    """Watch only this namespace, or these (comma-separated, as the chart sets a list); None
    watches all (cluster-wide RBAC)."""
    trainer_command: list[str] = Field(default_factory=lambda: ["hlat-launch"])
    """Worker container command; `hlat-launch` turns the HLAT_* env into a torchrun line.
    The local rig sets an absolute path (its pods run on the host)."""
    eval_command: list[str] = Field(default_factory=lambda: ["hlat-eval"])
    """hlat-eval in the trainer image: an evaluation Job's sidecar that holds its checkpoint
    (`--hold`), and its evaluator when spec.evaluation.command starts with `hlat-eval`."""
    default_image: str | None = None
    """Trainer image for jobs whose spec.image is unset; None makes such jobs InvalidSpec."""
    image_pull_policy: str | None = None
    """imagePullPolicy of the worker container; None leaves the Kubernetes default."""
    master_port: int = 29500
    """Rendezvous port of node rank 0 (torchrun --master-port)."""
    trainer_metrics_port: int = 9400
    """Port of each worker's Prometheus endpoint (HLAT_METRICS_PORT); 0 disables it."""
    heartbeat_period_seconds: float = DEFAULT_PERIOD_SECONDS
    """How often workers renew their Lease (HLAT_HEARTBEAT_PERIOD_SECONDS). It is added to
    every heartbeat timeout, since a renewal may legitimately be up to one period late."""
    min_heartbeat_timeout_seconds: float = 20.0
    """Floor of the learned steady-state timeout: step times of milliseconds (tiny CPU runs)
    must not turn scheduler jitter into restarts."""
    status_interval_seconds: float = 10.0
    """Progress and uptime are written to status at most this often (transitions at once):
    status writes are watch events for every client of the API server."""
    watch_nodes: bool = True
    """Passes read the nodes from one watch of them (`nodewatch`) rather than listing every
    node per pass (false: the old way, kept for the side-by-side bench). A pass whose pods sit
    on a node the watch lacks or shows not Ready, or that runs while the watch is broken,
    still lists them afresh."""
    list_chunk: int = Field(200, ge=0)
    """Objects per page of the initial listing of jobs, worker pods and Leases (kopf's
    `watching.chunk_size`; 0: all in one response, kopf's default). At start-up and after a
    failover the operator lists every worker pod of every job; paged, neither it nor the API
    server builds one response of the whole fleet's pods (~3,000 at 500 jobs). At 500 jobs
    the operator's memory peak, 4 s into its start, was 212 MiB paged, 270 in one response
    (bench_operator_scale, with `event_idle_seconds` 0.5)."""
    event_idle_seconds: float = Field(0.5, gt=0)
    """How long kopf keeps an object's event worker after that object's last event (kopf's
    `queueing.idle_timeout`, 5 s by default). The worker holds the object's last event, the
    whole parsed body: after a start on 500 jobs, whose listing hands over every job and
    worker pod within seconds, kopf's 5 s kept all of them alive at once. The handler only
    wakes the job's loop, so a worker that exits sooner costs one task started again. At 500
    jobs: a peak of 212 MiB at 0.5 s, 306 MiB at 5 s, the same reaction times
    (bench_operator_scale)."""
    resync_seconds: float = 10.0
    """Requeue delay while a job is alive, so timeouts fire without a watch event."""
    fast_requeue_seconds: float = 1.0
    """Requeue delay while waiting for pods to go away (deletion is usually quick)."""
    exit_after_finish_seconds: float = 300.0
    """A worker that reported `finished` (its last checkpoint complete) and still runs after
    this long is hung in its exit: the gang is restarted, and the new one, resuming from the
    final checkpoint, has nothing left to do and exits."""
    force_delete_after_seconds: float = 60.0
    """A pod terminating this long on a NotReady or missing node is force-deleted: its kubelet
    will never confirm, and the next gang must not wait forever."""
    node_not_ready_grace_seconds: float = 0.0
    """A worker's node must be NotReady this long before it counts as lost (the node
    lifecycle controller already waits its own grace period before marking NotReady)."""
    api_return_grace_seconds: float = 40.0
    """After the operator gets the API server back, how long a NotReady or unreachable node is
    not yet lost: the node lifecycle controller marks every node whose kubelet could not
    renew during the outage, and the kubelets renew within their lease period (10 s on EKS;
    40 s is the node lease's duration). A worker's own fresh heartbeat clears it sooner."""
    eviction_checkpoint_seconds: float = 300.0
    """When a Ready gang is told to stop (Kueue evicts it; spec.suspend), the operator asks its
    workers for a checkpoint now (hlat_api.heartbeat.CHECKPOINT_REQUEST) and stops them once
    it is complete, or once this many seconds have passed without it (a trainer that does not
    answer): then they stop and resume from the latest checkpoint. 0: always stop at once. A
    preempting job waits for the quota until the stop."""
    termination_grace_seconds: int = 60
    """terminationGracePeriodSeconds of worker pods: time to finish an async checkpoint write."""
    scheduler_name: str | None = None
    """schedulerName of worker pods whose job sets none (spec.scheduling or the template), e.g.
    "volcano" for gang admission on every job; None: Kubernetes' default scheduler."""
    unschedulable_after_seconds: float = 120.0
    """A worker pod the scheduler reports Unschedulable for this long sets the job's
    `Schedulable` condition False (with the scheduler's message), an Event and a metric."""
    leader_election: bool = False
    """Run as one of several replicas: act only while holding the Lease below (the chart sets
    it with 2 replicas); a standby takes over within about leaseSeconds of the leader's loss."""
    leader_election_namespace: str = "hlat-system"
    """Namespace of the leader Lease (the chart: the operator's own namespace)."""
    leader_election_name: str = "hlat-operator"
    """Name of the leader Lease."""
    leader_lease_seconds: float = 15.0
    """A standby takes the Lease over once it has seen it unrenewed this long."""
    leader_renew_deadline_seconds: float = 10.0
    """A leader that could not renew for this long stops acting (exits) before anyone takes over."""
    leader_retry_seconds: float = 2.0
    """How often the leader renews and a standby looks."""
    shm_size_limit: str | None = None
    """sizeLimit of the /dev/shm memory volume (e.g. "64Gi"); None: no limit (node memory)."""
    log_format: str = "json"
    """HLAT_LOG_FORMAT for workers: json lines are what log collectors parse."""
    metrics_port: int = 8080
    """Port of the operator's own Prometheus endpoint."""
    liveness_port: int = 8081
    """Port of the operator's liveness endpoint (/healthz)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, info in cls.model_fields.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None:
                continue
            if raw == "" and info.default is None:
                values[name] = None
            elif name in ("trainer_command", "eval_command"):
                values[name] = _parse_list(ENV_PREFIX + name.upper(), raw)
            else:
                values[name] = raw
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            problems = "; ".join(
                f"{ENV_PREFIX}{str(e['loc'][0]).upper()}: {e['msg']}" for e in err.errors()
            )
            raise SettingsError(f"invalid operator settings: {problems}") from err


def _parse_list(var: str, raw: str) -> list[str]:
    if raw.lstrip().startswith("["):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as err:
            raise SettingsError(f"{var}: not a JSON list: {err}") from err
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SettingsError(f"{var}: expected a JSON list of strings")
        return value
    return raw.split()
