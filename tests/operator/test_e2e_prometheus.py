"""A real Prometheus scrapes the operator and the trainer pods of a job with a fault, selected
and labelled as the chart's ServiceMonitor and PodMonitor say; then every query of every
dashboard panel is evaluated over the job's time range through Prometheus' HTTP API and must
return data (the Neuron panels excepted: they need Trainium nodes running neuron-monitor, and
are checked against its published metric names in test_op_chart.py)."""

from __future__ import annotations

import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from e2e_env import Env
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from hlat_api import labels
from hlat_api.heartbeat import Heartbeat
from hlat_operator import dashboards
from hlat_testbed import chart, faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import OperatorProcess
from hlat_testbed.prometheus import (
    Prometheus,
    chart_monitors,
    expose_host_port,
    free_port,
    instantiate,
    scrape_configs,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
STEPS = 400

def test_every_dashboard_panel_has_data_from_a_real_prometheus(
        cluster: Cluster, crd: None, namespace: str, sample_data: Path, tmp_path: Path,
        helm: Path) -> None:
    fsx = tmp_path / "fsx"
    shutil.copytree(sample_data, fsx / "data" / "sample")
    cluster.create_shared_volume(namespace, "fsx", fsx)
    port = free_port()
    operator = OperatorProcess(cluster, tmp_path / "operator.log", [namespace],
                               {"HLAT_OPERATOR_TRAINER_METRICS_PORT": "9400"},
                               metrics_port=port).start()
    api = cluster.admin_api()
    expose_host_port(api, chart.NAMESPACE, f"{chart.RELEASE}-metrics", cluster.config.host_ip,
                     port)
    prom = Prometheus(cluster, tmp_path / "prometheus").start(
        scrape_configs(chart_monitors(), cluster.kubeconfig))
    try:
        job = Env(cluster, namespace, fsx, {"op": operator})
        # a fixed heartbeat timeout: the gang is frozen below for as long as Prometheus takes
        spec = tiny_spec(steps=STEPS, heartbeat={"startupTimeoutSeconds": 120,
                                                 "timeoutSeconds": 600})
        spec["checkpoint"]["interval"] = 10
        # the sample's held-out set (hlat-data sample --docs N): the loss panel's second query
        spec["eval"] = {"path": "/fsx/data/sample/held-out", "interval": 5, "batches": 2}
        # evaluation Jobs (hlat-eval) on two checkpoints: the evaluation panels' series
        spec["evaluation"] = {"every": 20, "retries": 0}
        job.create(spec)
        start = time.time()
        job.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                 and (s.get("latestCheckpoint") or {}).get("step", 0) >= 10, 180)
        # the per-node ratios exist while a gang trains, from each node's heartbeat with its
        # compute time. A tiny gang trains faster than Prometheus scrapes (CI's did 120 steps
        # in 3 s and finished unscraped), so the gang is frozen (its beats stay) once both
        # nodes' Leases carry a training beat with its compute time (a freeze before one
        # renewed after its first report kept it `starting`: CI, 2026-11-27), until both
        # ratios are scraped; then it loses a worker mid-run: the next gang resumes from a
        # checkpoint below STEPS and trains, evaluating, to the end
        _wait_computing_beats(job, 2)
        for rank in (0, 1):
            faults.hang(cluster.config, namespace, f"tiny-a0-{rank}")
        frozen = job.status()
        assert frozen.get("phase") == "Running", frozen
        (slowdown,) = [instantiate(expr, namespace, job.name, 0) for _, panel, expr in
                       dashboards.queries() if panel.title == "Node slowdown (stragglers)"]
        job.wait("both nodes' slowdown ratios scraped", lambda _: len(
            prom.query_range(slowdown, start, time.time())) == 2, 60)
        for rank in (0, 1):
            faults.resume(cluster.config, namespace, f"tiny-a0-{rank}")
        faults.kill(cluster.config, namespace, "tiny-a0-1")
        done = job.wait_trained()
        assert done["restarts"]["total"] == 1
        progress = done["progress"]
        assert progress["validationStep"] == STEPS and progress["validationLoss"] > 0, progress
        assert progress["validationLossText"] == f"{progress['validationLoss']:.4g}"
        job.wait("the evaluations settled", lambda s: len(s.get("evaluations") or []) == 2
                 and all(e["phase"] == "Succeeded" for e in s["evaluations"]), 300)
        _the_operator_reports_its_own_load(port)
        time.sleep(3)  # a few more scrapes
        end = time.time()
        targets = prom.targets()
        jobs = {t["labels"].get("job", "") for t in targets if t["health"] == "up"} | {
            t["scrapePool"] for t in targets}
        assert any(j.startswith("serviceMonitor/") for j in jobs), targets
        assert any(j.startswith("podMonitor/") for j in jobs), targets
        counts: dict[str, int] = {}
        for uid, panel, expr in dashboards.queries():
            if panel.hardware:
                continue
            query = instantiate(expr, namespace, job.name, end - start)
            series = [s for s in prom.query_range(query, start, end)
                      if any(v != "NaN" for _, v in s["values"])]
            counts[f"{uid} / {panel.title}: {expr}"] = len(series)
        print("series per panel query:")
        for what, n in counts.items():
            print(f"  {n:3d}  {what}")
        empty = [what for what, n in counts.items() if n == 0]
        assert not empty, f"panels without data: {empty}"
        job.delete()
    finally:
        prom.stop()
        operator.stop()


def _wait_computing_beats(job: Env, nodes: int, timeout: float = 120) -> None:
    """Until every node rank's Lease (attempt 0) carries a training beat with its compute time,
    read every 50 ms: what the operator's per-node ratios are made of."""
    leases = client.CoordinationV1Api(job.cluster.admin_api())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beats: list[Heartbeat | None] = []
        for rank in range(nodes):
            try:
                lease = leases.read_namespaced_lease(
                    labels.worker_lease_name(job.name, 0, rank), job.ns)
            except ApiException:  # not created yet
                beats.append(None)
                continue
            meta = lease.metadata
            beats.append(Heartbeat.from_annotations(meta.annotations if meta else None))
        if all(b is not None and b.phase == "training" and b.compute_seconds for b in beats):
            return
        time.sleep(0.05)
    raise AssertionError(f"not every node reported its compute time within {timeout:.0f}s")


def _the_operator_reports_its_own_load(port: int) -> None:
    """What bench_operator_scale reads: passes and their latency after watch events, the
    requests the passes made, the watch events that arrived."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    passes = value("hlat_operator_pass_seconds_count")
    assert passes >= 3 and value("hlat_operator_reaction_seconds_count") >= 1, text
    assert 0 < value("hlat_operator_pass_seconds_sum") / passes < 10
    assert value("hlat_operator_api_requests_total", verb="GET") >= 3 * passes  # job, pods, ...
    assert value("hlat_operator_api_requests_total", verb="POST") >= 2  # pods of two attempts
    assert value("hlat_operator_watch_events_total", kind="Pod") >= 4
    assert value("hlat_operator_watch_events_total", kind="PretrainJob") >= 1
    assert ("hlat_operator_passes_waiting", ()) in samples, text  # one job: none wait
