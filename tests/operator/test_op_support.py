"""Parsing raw Kubernetes payloads, operator settings from env, and the metrics a job feeds."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from opfakes import World, at, raw_spec

from hlat_api import labels
from hlat_api.heartbeat import Heartbeat
from hlat_operator.config import OperatorSettings, SettingsError
from hlat_operator.faults import node_dead
from hlat_operator.metrics import OperatorMetrics
from hlat_operator.observe import (
    OperatorState,
    lease_from_raw,
    node_from_raw,
    observe,
    pod_from_raw,
    status_from_raw,
)

KILLED_POD: dict[str, Any] = {
    "metadata": {
        "name": "tiny-a2-1",
        "creationTimestamp": "2025-01-01T00:00:00Z",
        "labels": {labels.ATTEMPT: "2", labels.NODE_RANK: "1", labels.JOB: "tiny"},
    },
    "spec": {"nodeName": "node-b"},
    "status": {
        "phase": "Failed",
        "startTime": "2025-01-01T00:00:05Z",
        "conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"},
        ],
        "containerStatuses": [
            {
                "name": "trainer",
                "state": {
                    "terminated": {
                        "exitCode": 137,
                        "reason": "Error",
                        "startedAt": "2025-01-01T00:00:10Z",
                        "finishedAt": "2025-01-01T00:00:42Z",
                    }
                },
            }
        ],
    },
}


def test_pod_from_raw() -> None:
    pod = pod_from_raw(KILLED_POD)
    assert (pod.name, pod.attempt, pod.rank, pod.phase) == ("tiny-a2-1", 2, 1, "Failed")
    assert pod.exit_code == 137 and pod.reason == "Error" and pod.node == "node-b"
    assert pod.disruption == "PreemptionByScheduler" and pod.started_at == at(10)
    assert pod.finished_at == at(42)
    assert not pod.ready and not pod.terminating and pod.finished


@pytest.mark.parametrize(("reason", "gates", "waiting", "words"), [
    ("Unschedulable", [], True, "0/3 nodes are available"),
    ("SchedulingGated", [{"name": "kueue.x-k8s.io/admission"}], True, "kueue.x-k8s.io/admission"),
    ("SomethingElse", [], False, ""),
])
def test_a_pod_waiting_for_a_node_says_since_when_and_why(
        reason: str, gates: list[dict[str, str]], waiting: bool, words: str) -> None:
    raw = {"metadata": {"name": "x", "annotations": {"hlat.dev/avoided-nodes": "node-a,node-b"}},
           "spec": {"schedulingGates": gates},
           "status": {"phase": "Pending", "conditions": [
               {"type": "PodScheduled", "status": "False", "reason": reason,
                "message": "0/3 nodes are available", "lastTransitionTime": "2025-01-01T00:00:05Z"}]}}
    pod = pod_from_raw(raw)
    assert pod.unschedulable_since == (at(5) if waiting else None)
    assert words in pod.schedule_message
    assert pod.avoided == ("node-a", "node-b")


def test_a_pod_without_status_is_pending() -> None:
    pod = pod_from_raw({"metadata": {"name": "x", "deletionTimestamp": "2025-01-01T00:01:00Z"}})
    assert pod.phase == "Pending" and pod.attempt is None and pod.deletion_timestamp == at(60)


@pytest.mark.parametrize(
    ("ready", "taints", "health", "dead", "healthy"),
    [
        ("True", [], None, False, True),
        ("False", [], None, True, True),
        ("Unknown", [], "Schedulable", True, True),
        (
            "Unknown",
            [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}],
            None,
            True,
            True,
        ),
        # recovered: Ready again while the controller has not lifted its taint yet
        (
            "True",
            [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}],
            None,
            False,
            True,
        ),
        ("True", [], "UnschedulablePendingReplacement", False, False),
    ],
)
def test_node_from_raw(
    ready: str, taints: list[Any], health: str | None, dead: bool, healthy: bool
) -> None:
    node = node_from_raw(
        {
            "metadata": {
                "name": "n",
                "labels": {labels.NODE_HEALTH_LABEL: health} if health else {},
            },
            "spec": {"taints": taints},
            "status": {
                "conditions": [
                    {"type": "Ready", "status": ready, "lastTransitionTime": "2025-01-01T00:00:00Z"}
                ]
            },
        }
    )
    assert node.unreachable is bool(taints)
    assert node_dead(node, at(3600), grace=40, known=True) is dead
    assert node.healthy is healthy


def test_lease_from_raw_decodes_the_heartbeat() -> None:
    beat = Heartbeat(phase="training", step=7, checkpoint_step=5, step_seconds=0.2)
    lease = lease_from_raw(
        {
            "metadata": {"name": "l", "annotations": beat.to_annotations()},
            "spec": {"renewTime": "2025-01-01T00:00:03.250000Z"},
        }
    )
    assert lease.heartbeat == beat and lease.renew_time is not None
    assert lease.renew_time.timestamp() == pytest.approx(at(3.25).timestamp())
    assert lease_from_raw({"metadata": {"name": "l"}, "spec": {}}).heartbeat is None


def test_observe_reads_state_annotation_and_tolerates_garbage() -> None:
    state = OperatorState(avoid_nodes=["n1"], no_progress_streak=2)
    body = {
        "metadata": {
            "name": "tiny",
            "namespace": "ns",
            "uid": "u",
            "generation": 3,
            "resourceVersion": "77",
            "annotations": {labels.STATE_ANNOTATION: state.to_annotation()},
        }
    }
    obs = observe(body, [KILLED_POD], None, [])
    assert obs.state == state and obs.job.name == "tiny" and obs.generation == 3
    assert obs.resource_version == "77" and not obs.nodes_known
    garbage = {"metadata": {"annotations": {labels.STATE_ANNOTATION: "{not json"}}}
    assert observe(garbage, [], [], []).state == OperatorState()
    assert status_from_raw({"phase": "Nonsense"}).phase == "Pending"
    assert status_from_raw({"phase": "Running", "attempt": 2}).attempt == 2


def test_settings_from_env() -> None:
    s = OperatorSettings.from_env(
        {
            "HLAT_OPERATOR_TRAINER_COMMAND": '["/opt/rig/hlat-launch", "--verbose"]',
            "HLAT_OPERATOR_MASTER_PORT": "29600",
            "HLAT_OPERATOR_DEFAULT_IMAGE": "",
            "HLAT_OPERATOR_HEARTBEAT_PERIOD_SECONDS": "2.5",
            "UNRELATED": "x",
        }
    )
    assert s.trainer_command == ["/opt/rig/hlat-launch", "--verbose"]
    assert s.master_port == 29600 and s.heartbeat_period_seconds == 2.5
    assert s.default_image is None and s.namespace is None
    assert OperatorSettings.from_env({"HLAT_OPERATOR_TRAINER_COMMAND": "a b"}).trainer_command == [
        "a",
        "b",
    ]
    assert OperatorSettings.from_env({}) == OperatorSettings()


@pytest.mark.parametrize(
    "env", [{"HLAT_OPERATOR_MASTER_PORT": "many"}, {"HLAT_OPERATOR_TRAINER_COMMAND": "[1, 2]"}]
)
def test_bad_settings_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match="HLAT_OPERATOR_"):
        OperatorSettings.from_env(env)


def test_every_setting_is_documented() -> None:
    for name, info in OperatorSettings.model_fields.items():
        assert info.description, name


def _sample(m: OperatorMetrics, name: str, **label_values: str) -> float | None:
    return m.registry.get_sample_value(name, label_values)


def test_metrics_follow_a_job_through_a_restart() -> None:
    m = OperatorMetrics()
    w = World(raw_spec())

    def tick() -> None:
        m.observe("default", "tiny", w.step())

    tick()
    # at zero from the first sight, so increase() counts the first restart and recovery
    for reason in ("Killed", "NodeLost", "HeartbeatTimeout"):
        assert _sample(m, "hlat_job_restarts_total", namespace="default", pretrainjob="tiny",
                       reason=reason) == 0
    assert _sample(m, "hlat_job_time_to_recover_seconds_count", namespace="default") == 0
    w.schedule()
    tick()
    w.beat(5)
    w.advance(4)
    tick()
    assert _sample(m, "hlat_jobs", phase="Running") == 1
    assert (
        _sample(m, "hlat_job_heartbeat_age_seconds", namespace="default", pretrainjob="tiny") == 4
    )
    w.fail(0)
    tick()
    assert (
        _sample(
            m, "hlat_job_restarts_total", namespace="default", pretrainjob="tiny", reason="Killed"
        )
        == 1
    )
    assert _sample(m, "hlat_jobs", phase="Restarting") == 1
    for _ in range(10):
        w.advance(1)
        w.schedule()
        w.beat(6)
        tick()
    assert _sample(m, "hlat_job_time_to_recover_seconds_count", namespace="default") == 1
    ratio = _sample(m, "hlat_job_uptime_ratio", namespace="default", pretrainjob="tiny")
    assert ratio is not None and 0 < ratio < 1
    m.forget("default", "tiny")
    assert _sample(m, "hlat_jobs", phase="Running") == 0
    assert _sample(m, "hlat_job_uptime_ratio", namespace="default", pretrainjob="tiny") is None


def test_the_operator_asks_the_api_server_for_worker_pods_only() -> None:
    """A server-side label selector on the pod watch: on a shared cluster the operator must
    not receive (and filter) every pod's events."""
    import kopf
    from kopf._cogs.structs.references import Resource

    from hlat_operator import handlers

    settings = kopf.OperatorSettings()
    handlers.configure_kopf(settings, OperatorSettings())
    pods = Resource("", "v1", "pods", kind="Pod", namespaced=True, preferred=True,
                    verbs=["list", "watch"])
    jobs = Resource("hlat.dev", "v1alpha1", "pretrainjobs", kind="PretrainJob",
                    namespaced=True, preferred=True, verbs=["list", "watch"])
    assert list(settings.watching.label_selectors.collect(pods)) == [
        "hlat.dev/job,app.kubernetes.io/component=worker"]
    assert not list(settings.watching.label_selectors.collect(jobs))
    # Kueue's Workloads: only the operator's own (labelled with their job), server-side
    workloads = Resource("kueue.x-k8s.io", "v1beta2", "workloads", kind="Workload",
                         namespaced=True, preferred=True, verbs=["list", "watch"])
    assert list(settings.watching.label_selectors.collect(workloads)) == ["hlat.dev/job"]
    # Leases: only those a launcher put a report on (an exit, unreachable peers), not every
    # heartbeat renewal of every worker
    leases = Resource("coordination.k8s.io", "v1", "leases", kind="Lease", namespaced=True,
                      preferred=True, verbs=["list", "watch"])
    assert list(settings.watching.label_selectors.collect(leases)) == [
        "hlat.dev/job,hlat.dev/reported"]
    # batch Jobs: only evaluation Jobs of some PretrainJob (spec.evaluation)
    batch = Resource("batch", "v1", "jobs", kind="Job", namespaced=True, preferred=True,
                     verbs=["list", "watch"])
    assert list(settings.watching.label_selectors.collect(batch)) == [
        "hlat.dev/job,app.kubernetes.io/component=evaluation"]


@pytest.mark.parametrize(("chunk", "pages"), [(200, ["200", "200"]), (0, [None])])
def test_the_initial_listing_is_paged(monkeypatch: pytest.MonkeyPatch, chunk: int,
                                      pages: list[str | None]) -> None:
    """kopf's own listing code, with our settings, against a server of 300 pods: pages of
    HLAT_OPERATOR_LIST_CHUNK objects (one response with all when it is 0): the memory of
    the operator's start no longer grows with the whole fleet's pods at once."""
    import asyncio
    import logging
    import urllib.parse

    import kopf
    from kopf._cogs.clients import api, fetching
    from kopf._cogs.structs.references import Resource

    from hlat_operator import handlers

    pods = [{"metadata": {"name": f"w-{i}"}} for i in range(300)]
    limits: list[str | None] = []

    async def get(url: str, **_: Any) -> dict[str, Any]:
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
        limits.append(query.get("limit"))
        start = int(query.get("continue", 0))
        end = start + int(query["limit"]) if "limit" in query else len(pods)
        more = str(end) if end < len(pods) else ""
        return {"kind": "PodList", "apiVersion": "v1", "items": pods[start:end],
                "metadata": {"resourceVersion": "7", "continue": more}}

    monkeypatch.setattr(api, "get", get)
    settings = kopf.OperatorSettings()
    handlers.configure_kopf(settings, OperatorSettings(list_chunk=chunk))
    resource = Resource("", "v1", "pods", kind="Pod", namespaced=True, preferred=True,
                        verbs=["list", "watch"])

    async def listed() -> list[int]:
        return [len(items) async for items, _ in fetching.fetch_objs(
            settings=settings, resource=resource, namespace=None,
            logger=logging.getLogger("test"))]

    sizes = asyncio.run(listed())
    assert sum(sizes) == 300 and limits == pages
    assert max(sizes) == (200 if chunk else 300)


def test_kopf_lets_go_of_an_objects_last_event_soon_after_it() -> None:
    """kopf's own per-object worker, with our settings: it holds the object's last event (the
    parsed body) until it has idled `event_idle_seconds`. At kopf's 5 s an operator starting on
    500 jobs held every job's and worker pod's body at once (its memory peak)."""
    import asyncio
    import contextlib
    import weakref

    import kopf
    from kopf._core.reactor import queueing

    from hlat_operator import handlers

    class Event(dict[str, Any]):  # a dict that a weak reference can follow
        pass

    settings = kopf.OperatorSettings()
    handlers.configure_kopf(settings, OperatorSettings(event_idle_seconds=0.2))
    handled: list[str] = []

    async def processor(*, raw_event: dict[str, Any], **_: Any) -> None:
        handled.append(raw_event["object"]["metadata"]["name"])

    async def run() -> tuple[bool, bool]:
        key = ("pods", "uid-1")
        streams = {key: queueing.Stream(backlog=asyncio.Queue(), pressure=asyncio.Event())}
        event = Event(type="ADDED", object={"metadata": {"name": "w-0", "uid": "uid-1"}})
        body = weakref.ref(event)
        await streams[key].backlog.put(event)
        del event
        task = asyncio.create_task(queueing.worker(
            signaller=asyncio.Condition(), settings=settings, processor=processor,
            streams=streams, key=key))  # type: ignore[arg-type]
        await asyncio.sleep(1.0)
        gone = task.done() and key not in streams
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return gone, body() is None

    worker_gone, body_freed = asyncio.run(run())
    assert handled == ["w-0"]
    assert worker_gone and body_freed


def test_progress_for_kubectl_step_of_total_loss_to_4_digits_and_eta() -> None:
    from hlat_operator.accounting import progress_of

    beats: list[Heartbeat | None] = [
        Heartbeat(phase="training", step=120, tokens=1e6, loss=2.3456789012, step_seconds=0.5),
        Heartbeat(phase="training", step=119, tokens=1e6, loss=2.5, step_seconds=0.6),
    ]
    p = progress_of(beats, total_steps=400)
    assert p is not None
    assert p.summary == "120/400 (30.0%)" and p.loss_text == "2.346" and p.loss == 2.3456789012
    assert p.eta_seconds == 140.0  # 280 steps left x rank 0's 0.5 s
    assert progress_of(beats) is not None and progress_of(beats).summary is None  # type: ignore[union-attr]
    assert progress_of([Heartbeat(phase="compiling")], 400) is None  # not resumed yet


def test_progress_shows_the_newest_validation_loss_any_worker_reported() -> None:
    """Every node's rank 0 evaluates (the loss is all-reduced): the newest evaluation is shown,
    whichever worker's beat carried it first; none before the first evaluation."""
    from hlat_operator.accounting import progress_of

    beats: list[Heartbeat | None] = [
        Heartbeat(phase="training", step=41, loss=2.5, validation_loss=2.71234, validation_step=20),
        Heartbeat(phase="training", step=41, loss=2.5, validation_loss=2.6, validation_step=40),
    ]
    p = progress_of(beats, total_steps=100)
    assert p is not None
    assert (p.validation_loss, p.validation_step, p.validation_loss_text) == (2.6, 40, "2.6")
    p = progress_of(beats[:1], total_steps=100)
    assert p is not None and p.validation_loss_text == "2.712"
    p = progress_of([Heartbeat(phase="training", step=3, loss=2.5)], total_steps=100)
    assert p is not None and p.validation_loss is None and p.validation_loss_text is None


def test_a_restarted_gang_keeps_showing_the_last_validation_loss_until_it_evaluates() -> None:
    """A gang resumed after the last evaluation (from the final checkpoint, say) reports no
    validation loss: the status keeps the one an earlier gang reported, not a blank."""
    from hlat_operator.accounting import progress_of

    earlier = progress_of([Heartbeat(phase="training", step=400, validation_loss=2.6,
                                     validation_step=400)], total_steps=400)
    resumed = [Heartbeat(phase="finished", step=400, loss=2.5)]
    p = progress_of(resumed, 400, earlier)
    assert p is not None
    assert (p.validation_loss, p.validation_step, p.validation_loss_text) == (2.6, 400, "2.6")
    p = progress_of([Heartbeat(phase="training", step=410, validation_loss=2.4,
                               validation_step=410)], 400, earlier)
    assert p is not None and (p.validation_loss, p.validation_step) == (2.4, 410)


def test_goodput_counters_follow_the_status_and_never_go_back() -> None:
    """Counters start at the status's figures when a job is first seen (an operator restarted
    mid-job does not replay its history as an increase from 0 in one scrape), advance by what
    the status gains, and hold when a figure moves back (the provisional part is not a cause)."""
    from hlat_api.status import Badput, Goodput

    m = OperatorMetrics()
    w = World(raw_spec())
    d = w.step()
    status = d.status.model_copy(update={"goodput": Goodput(
        ratio=0.5, wall_seconds=100, productive_seconds=50, lost_work_seconds=3,
        badput_seconds=Badput(compile=40, teardown=10, unreported=7))})
    m.observe("default", "tiny", replace(d, status=status))

    def badput(cause: str) -> float | None:
        return _sample(m, "hlat_job_badput_seconds_total", namespace="default",
                       pretrainjob="tiny", cause=cause)

    assert badput("compile") == 40 and badput("teardown") == 10 and badput("recompute") == 0
    assert badput("unreported") is None
    assert _sample(m, "hlat_job_productive_seconds_total", namespace="default",
                   pretrainjob="tiny") == 50
    assert _sample(m, "hlat_job_goodput_ratio", namespace="default", pretrainjob="tiny") == 0.5
    later = status.model_copy(update={"goodput": Goodput(
        ratio=0.4, wall_seconds=150, productive_seconds=60, lost_work_seconds=3,
        badput_seconds=Badput(compile=38, teardown=12, detection=40))})
    m.observe("default", "tiny", replace(d, status=later))
    assert badput("compile") == 40 and badput("teardown") == 12 and badput("detection") == 40
    assert _sample(m, "hlat_job_lost_work_seconds_total", namespace="default",
                   pretrainjob="tiny") == 3


def _evaluation_series(m: OperatorMetrics, job: str) -> dict[str, float]:
    """Every exported `hlat_job_evaluation*` sample of `job`, keyed `name{label=value,...}` by
    its labels other than namespace and pretrainjob (what a scrape would show)."""
    out = {}
    for metric in m.registry.collect():
        for s in metric.samples:
            if s.name.startswith("hlat_job_evaluation") and s.labels.get("pretrainjob") == job:
                rest = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                if k not in ("namespace", "pretrainjob"))
                out[f"{s.name}{{{rest}}}"] = s.value
    return out


def test_evaluation_metrics_are_the_latest_succeeded_results_and_go_with_the_job() -> None:
    """hlat_job_evaluation holds the results of the Succeeded entry of the highest step (not the
    list's last), with that checkpoint's step and tokens; a result name the newer evaluation
    lacks loses its series; the entries per phase are counted, 0s included, from the first
    entry; without a Succeeded entry those series go; forget drops every one of them and
    leaves another job's alone."""
    from hlat_api.status import Evaluation, EvaluationPhase

    m = OperatorMetrics()
    d = World(raw_spec()).step()

    def observe(job: str, *entries: Evaluation) -> dict[str, float]:
        m.observe("default", job, replace(d, status=d.status.model_copy(
            update={"evaluations": list(entries)})))
        return _evaluation_series(m, job)

    def ev(step: int, phase: EvaluationPhase, **results: float) -> Evaluation:
        return Evaluation(step=step, tokens=step * 1000.0, job=f"tiny-eval-{step}", phase=phase,
                          results=results, message="boom" if phase == "Failed" else None)

    assert observe("tiny") == {}  # no evaluations: no series, not even phase counts at 0
    first = ev(100, "Succeeded", eval_loss=2.5, eval_perplexity=12.2, hellaswag_acc=0.3)
    assert observe("tiny", first, ev(200, "Running")) == {
        "hlat_job_evaluation{metric=eval_loss}": 2.5,
        "hlat_job_evaluation{metric=eval_perplexity}": 12.2,
        "hlat_job_evaluation{metric=hellaswag_acc}": 0.3,
        "hlat_job_evaluation_step{}": 100, "hlat_job_evaluation_tokens{}": 100_000,
        "hlat_job_evaluations{phase=Running}": 1, "hlat_job_evaluations{phase=Succeeded}": 1,
        "hlat_job_evaluations{phase=Failed}": 0}
    second = ev(200, "Succeeded", eval_loss=2.3, eval_perplexity=10.0)
    # an older checkpoint's evaluation finishing later (listed last) is not the latest
    late = ev(150, "Succeeded", eval_loss=2.4, eval_perplexity=11.0, hellaswag_acc=0.35)
    now = observe("tiny", first, second, ev(300, "Failed"), late)
    assert now == {
        "hlat_job_evaluation{metric=eval_loss}": 2.3,
        "hlat_job_evaluation{metric=eval_perplexity}": 10.0,
        "hlat_job_evaluation_step{}": 200, "hlat_job_evaluation_tokens{}": 200_000,
        "hlat_job_evaluations{phase=Running}": 0, "hlat_job_evaluations{phase=Succeeded}": 3,
        "hlat_job_evaluations{phase=Failed}": 1}
    assert 'metric="hellaswag_acc"' not in m.render().decode()  # the stale series is gone
    observe("other", ev(100, "Succeeded", eval_loss=3.0))
    # the status keeps the newest entries only: none Succeeded left, so no results to show
    assert observe("tiny", ev(300, "Failed"), ev(400, "Running")) == {
        "hlat_job_evaluations{phase=Running}": 1, "hlat_job_evaluations{phase=Succeeded}": 0,
        "hlat_job_evaluations{phase=Failed}": 1}
    observe("tiny", second, ev(300, "Failed"))
    m.forget("default", "tiny")
    assert _evaluation_series(m, "tiny") == {}
    assert "pretrainjob=\"tiny\"" not in m.render().decode()
    assert _evaluation_series(m, "other")["hlat_job_evaluation{metric=eval_loss}"] == 3.0
    assert observe("tiny", ev(100, "Running")) == {  # seen again after forget: from scratch
        "hlat_job_evaluations{phase=Running}": 1, "hlat_job_evaluations{phase=Succeeded}": 0,
        "hlat_job_evaluations{phase=Failed}": 0}
