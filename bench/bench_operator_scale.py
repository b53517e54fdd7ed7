"""The operator at scale: hundreds of PretrainJobs on the real local API server.

`--jobs` PretrainJobs (500 by default) of 1 to 64 workers (half of them 1, a few 64; ~3,000
worker pods for 500) are created in `--namespaces` namespaces at `--rate` per second, on
simulated nodes (hlat_testbed.simnodes: Nodes registered through the real API server whose pods
the real scheduler binds and a simulator reports Running; no processes, no trainer heartbeats,
so the jobs' heartbeat timeouts are set beyond the run). The operator runs as in production:
its own process, the Helm chart's ServiceAccount, its default intervals (resync 10 s, status
every 10 s). Once every job's pods run, a fault stream fails one running worker pod every
`--fault-every` seconds (its container reported terminated with 137) for `--seconds`: a job
drawn at random, then one of its pods (a fault rate far above any real fleet's: a stress).

Reported, over that steady window:
- reaction: fault -> the job's status counts the restart (what a user watching the job sees),
  p50 / p99 / max, measured outside the operator through a watch of the jobs;
- the operator's own figures, from its /metrics: one pass's duration and the time from a watch
  event to the end of the pass it woke (p50 / p99 from the histograms), the passes' API
  requests per job per minute by verb, watch events per second; its RSS (peak and at the end);
- start-up: creation -> every pod of every job running.
Goal (issue 16): reaction p99 < 1 s and RSS <= 256 MiB at 500 jobs.

    .venv/bin/python bench/bench_operator_scale.py [--jobs 500]   # needs root: the local cluster
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import math
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

import report as report_md
from hlat_api import Heartbeat, labels
from hlat_operator.config import OperatorSettings
from hlat_testbed import simnodes
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import (
    GROUP,
    PLURAL,
    REPO,
    VERSION,
    OperatorProcess,
    ensure_namespace,
    install_crd,
)
from hlat_testbed.prometheus import free_port

SIZES = [1] * 10 + [2] * 4 + [4] * 3 + [8, 16, 64]
"""Workers per job, cycled: 5.9 on average."""
PODS_PER_NODE = 16
"""A trn1.32xlarge takes one worker pod; 16 here keeps the simulated nodes' own Lease renewals
(one per node every 10 s) from loading this 2-core machine: a real fleet of this size has 16x
the nodes, which matters to every request that lists them."""


def spec(nodes: int) -> dict[str, Any]:
    forever = 24 * 3600
    return {
        "image": "hlat-trainer:dev", "nodes": nodes, "instanceType": "cpu",
        "processesPerNode": 1, "model": {"preset": "tiny"}, "precision": "fp32",
        "optimizer": {"lr": 3.0e-3, "warmupSteps": 10},
        "data": {"path": "/fsx/data", "tokenizer": "/fsx/data/tokenizer.json", "seqLen": 128},
        "train": {"globalBatch": 4 * nodes, "microBatch": 4, "steps": 100000},
        "checkpoint": {"dir": "/fsx/checkpoints", "interval": 100},
        "faultTolerance": {"maxRestarts": 10000, "backoff": {"initialSeconds": 1,
                                                             "maxSeconds": 1},
                           "heartbeat": {"startupTimeoutSeconds": forever,
                                         "timeoutSeconds": forever}},
        "template": {"spec": {"nodeSelector": {simnodes.LABEL: "true"},
                              "tolerations": [simnodes.TOLERATION]}},
    }


class Jobs:
    """A watch of every PretrainJob: when each one's status first counted N restarts."""

    def __init__(self, custom: client.CustomObjectsApi) -> None:
        self.custom = custom
        self.restarts: dict[tuple[str, str], int] = {}
        self.phases: dict[tuple[str, str], str] = {}
        self.seen: dict[tuple[str, str, int], float] = {}
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                for event in watch.Watch().stream(self.custom.list_cluster_custom_object,
                                                  GROUP, VERSION, PLURAL, timeout_seconds=60):
                    obj = event["object"]
                    meta = obj.get("metadata") or {}
                    key = (meta.get("namespace", ""), meta.get("name", ""))
                    total = int(((obj.get("status") or {}).get("restarts") or {})
                                .get("total", 0))
                    now = time.time()
                    self.phases[key] = str((obj.get("status") or {}).get("phase"))
                    with self.cond:
                        if total > self.restarts.get(key, 0):
                            for n in range(self.restarts.get(key, 0) + 1, total + 1):
                                self.seen.setdefault((*key, n), now)
                            self.restarts[key] = total
                            self.cond.notify_all()
            except Exception as err:
                print(f"job watch: {err!r}", flush=True)
                time.sleep(1)

    def restart_seen(self, key: tuple[str, str], n: int, timeout: float) -> float | None:
        with self.cond:
            self.cond.wait_for(lambda: (*key, n) in self.seen, timeout)
            return self.seen.get((*key, n))


class Trainers:
    """What each running pod's trainer would say once: a heartbeat on its attempt's Lease,
    training (so the operator sees every attempt train, as it would; the heartbeat
    timeouts are beyond the run, so no further beats are needed). Kept pods of an in-place
    restart move to the new attempt by a label patch: they beat again for it."""

    def __init__(self, api: client.ApiClient) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.done: set[tuple[str, str, str]] = set()
        self.requests = 0

    def __call__(self, pod: Any) -> None:
        meta = pod.metadata
        attempt, rank = meta.labels.get(labels.ATTEMPT), meta.labels.get(labels.NODE_RANK)
        job = meta.labels.get(labels.JOB)
        if attempt is None or rank is None or job is None:
            return
        key = (meta.namespace, meta.name, attempt)
        if key in self.done:
            return
        self.done.add(key)
        now = datetime.datetime.now(datetime.UTC)
        # each attempt gets further than the last and checkpoints (the operator fails a job
        # whose restarts make no progress)
        step = 100 * (int(attempt) + 1)
        beat = Heartbeat(phase="training", step=step, checkpoint_step=step,
                         attempt=int(attempt), progress_time=now)
        self.requests += 1
        try:
            self.coordination.patch_namespaced_lease(
                labels.worker_lease_name(job, int(attempt), int(rank)), meta.namespace, {
                    "metadata": {"annotations": beat.to_annotations()},
                    "spec": {"holderIdentity": meta.name, "renewTime": now.isoformat(),
                             "leaseDurationSeconds": 3600}})
        except client.exceptions.ApiException as err:
            if err.status != 404:  # an attempt already over
                raise


def job_of(pod: tuple[str, str]) -> str:
    """`namespace/job` of a worker pod `<job>-a<attempt>-<rank>`."""
    return f"{pod[0]}/{pod[1].rsplit('-a', 1)[0]}"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def quantile_from_buckets(before: dict[Any, float], after: dict[Any, float], name: str,
                          q: float) -> float:
    """The q-quantile of histogram `name` over the window, interpolated within its bucket."""
    buckets = sorted(
        (float(dict(labels)["le"]), after[(n, labels)] - before.get((n, labels), 0.0))
        for (n, labels) in after if n == f"{name}_bucket")
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank, low, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return low
            return low + (bound - low) * (rank - below) / max(count - below, 1e-9)
        low, below = bound, count
    return low


def delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of a process in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


class RssTrace:
    """The operator's resident memory every `every` seconds from its start: when its peak
    came (start-up on jobs already there, or the fault window)."""

    def __init__(self, pid: int, every: float = 0.25) -> None:
        self.pid, self.every, self.began = pid, every, time.time()
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.samples.append((time.time() - self.began, rss_mib(self.pid)[0]))

    def stop(self) -> tuple[float, float]:
        """(seconds after the start, MiB) of the highest sample."""
        self._stop.set()
        self._thread.join()
        return max(self.samples, key=lambda s: s[1], default=(math.nan, math.nan))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


CONFIGS: dict[str, dict[str, str]] = {
    "every pass lists the nodes (watch off)": {"HLAT_OPERATOR_WATCH_NODES": "false"},
    "nodes watched (default)": {},
    "nodes watched, start-up listing in one piece": {"HLAT_OPERATOR_LIST_CHUNK": "0"},
    "nodes watched, kopf's 5 s worker idle": {"HLAT_OPERATOR_EVENT_IDLE_SECONDS": "5"},
}
"""Operators measured one after the other on the same jobs, by the environment each adds to
the defaults (`--also NAME:KEY=VALUE,...` adds more, to compare a setting side by side)."""


def image_allocator() -> dict[str, str]:
    """The operator image's allocator settings (Dockerfile.operator): jemalloc for every
    allocation, Python's small objects included. `make bench` installs libjemalloc2."""
    found = sorted(Path("/usr/lib").glob("*/libjemalloc.so.2")) + sorted(
        Path("/usr/lib").glob("libjemalloc.so.2"))
    if not found:
        raise SystemExit("bench_operator_scale: libjemalloc.so.2 not found; the operator image "
                         "preloads it (Dockerfile.operator): apt-get install libjemalloc2")
    return {"MALLOC_ARENA_MAX": "2", "LD_PRELOAD": str(found[0]), "PYTHONMALLOC": "malloc"}


def config(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:KEY=VALUE,KEY=VALUE` -> (NAME, {KEY: VALUE})."""
    name, _, pairs = text.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    if not name or not all(env):
        raise argparse.ArgumentTypeError(f"--also {text!r}: expected NAME:KEY=VALUE,...")
    return name, env


def window(a: argparse.Namespace, rng: random.Random, port: int, pid: int, nodes: Any,
           trainers: Trainers, jobs: Jobs) -> dict[str, Any]:
    """Faults for `a.seconds`; what the operator did meanwhile."""
    before, sim_before = scrape(port), nodes.requests + trainers.requests
    began = time.time()
    pending: list[tuple[tuple[str, str], int, float]] = []
    expected: dict[tuple[str, str], int] = {}
    for k in range(int(a.seconds / a.fault_every)):
        time.sleep(max(0.0, began + k * a.fault_every - time.time()))
        hit = nodes.fail(rng, group=job_of)
        if hit is None:
            continue
        ns, pod, when = hit
        key = (ns, job_of((ns, pod)).split("/")[1])
        expected[key] = max(expected.get(key, 0), jobs.restarts.get(key, 0)) + 1
        pending.append((key, expected[key], when))
    time.sleep(max(0.0, began + a.seconds - time.time()))
    seconds = time.time() - began
    after = scrape(port)
    sim = nodes.requests + trainers.requests - sim_before
    reactions, missed, settle = [], 0, time.time() + 30
    for key, n, when in pending:
        seen = jobs.restart_seen(key, n, max(0.0, settle - time.time()))
        if seen is None:
            missed += 1
        else:
            reactions.append(seen - when)
    current, peak = rss_mib(pid)
    return {"before": before, "after": after, "seconds": seconds, "faults": len(pending),
            "reactions": reactions, "missed": missed, "rss": current, "peak": peak,
            "sim": sim / seconds}


VERBS = ("GET", "PATCH", "POST", "DELETE", "PUT")
KINDS = ("PretrainJob", "Pod", "Lease")


def figures(r: dict[str, Any], jobs: int) -> dict[str, Any]:
    """One operator configuration's figures over its window."""
    before, after, minutes = r["before"], r["after"], r["seconds"] / 60
    reactions = r["reactions"]
    f: dict[str, Any] = {
        "faults": r["faults"], "seen": len(reactions), "missed": r["missed"],
        "reaction": (percentile(reactions, .5), percentile(reactions, .99),
                     max(reactions) if reactions else math.nan),
        "passes_per_job_minute":
            delta(before, after, "hlat_operator_pass_seconds_count") / jobs / minutes,
        "requests": {v: delta(before, after, "hlat_operator_api_requests_total", verb=v)
                     / jobs / minutes for v in VERBS},
        "events": {k: delta(before, after, "hlat_operator_watch_events_total", kind=k)
                   / r["seconds"] for k in KINDS},
        "waiting": after.get(("hlat_operator_passes_waiting", ()), math.nan),
        "rss": r["rss"], "peak": r["peak"], "sim": r["sim"],
        "peak_at": r.get("peak_at", math.nan), "window_at": r.get("window_at", math.nan),
    }
    for metric in ("pass", "reaction"):
        name = f"hlat_operator_{metric}_seconds"
        f[f"{metric}_hist"] = (quantile_from_buckets(before, after, name, .5),
                               quantile_from_buckets(before, after, name, .99),
                               delta(before, after, name + "_count"))
    return f


def report(name: str, f: dict[str, Any]) -> None:
    print(f"\n-- {name}")
    print(f"faults {f['faults']}, restarts seen {f['seen']}, missed {f['missed']}")
    p50, p99, top = f["reaction"]
    print(f"reaction (fault -> status counts the restart): p50 {p50:.3f} s  p99 {p99:.3f} s"
          f"  max {top:.3f} s")
    for metric in ("pass", "reaction"):
        q50, q99, count = f[f"{metric}_hist"]
        print(f"hlat_operator_{metric}_seconds: p50 {q50:.3f} s  p99 {q99:.3f} s  "
              f"(count {count:.0f})")
    print(f"passes per job per minute: {f['passes_per_job_minute']:.2f}")
    for verb, rate in f["requests"].items():
        print(f"API requests per job per minute, {verb}: {rate:.2f}")
    for kind, rate in f["events"].items():
        print(f"watch events per second, {kind}: {rate:.1f}")
    print(f"passes waiting for a worker thread at the end: {f['waiting']:.0f}")
    print(f"operator RSS: {f['rss']:.0f} MiB at the end, peak {f['peak']:.0f} MiB, reached "
          f"{f['peak_at']:.0f} s after its start (the window began at {f['window_at']:.0f} s)")
    print(f"(the simulated nodes and trainers made {f['sim']:.1f} requests/s of their own)")


DEFAULT = "nodes watched (default)"


def section(a: argparse.Namespace, argv: list[str], setup: dict[str, Any],
            results: dict[str, dict[str, Any]]) -> report_md.Section:
    """docs/benchmarks.md's section: one column per operator configuration."""
    names = list(results)

    def row(label: str, cell: Any) -> list[str]:
        return [label, *(cell(results[n]) for n in names)]

    def triple(t: tuple[float, ...]) -> str:
        return " / ".join(f"{v:.2f}" for v in t[:3])

    rows = [
        row("reaction, fault -> status counts the restart, p50 / p99 / max (s)",
            lambda f: triple(f["reaction"])),
        row("restarts seen within 30 s of the window's end",
            lambda f: f"{f['seen']} of {f['faults']}"),
        row("watch event -> end of the pass it woke (operator histogram), p50 / p99 (s)",
            lambda f: triple(f["reaction_hist"][:2])),
        row("one pass, including its wait for a worker thread, p50 / p99 (s)",
            lambda f: triple(f["pass_hist"][:2])),
        row("passes per job per minute", lambda f: f"{f['passes_per_job_minute']:.2f}"),
        row("API requests per job per minute (" + " / ".join(VERBS) + ")",
            lambda f: " / ".join(f"{v:.1f}" for v in f["requests"].values())),
        row("watch events per second (" + " / ".join(KINDS[:2]) + ")",
            lambda f: " / ".join(f"{f['events'][k]:.1f}" for k in KINDS[:2])),
        row("passes waiting for a worker thread at the end", lambda f: f"{f['waiting']:.0f}"),
        row("operator RSS at the end / peak (MiB)",
            lambda f: f"{f['rss']:.0f} / {f['peak']:.0f}"),
        row("RSS peak reached, s after the operator's start (the fault window began at)",
            lambda f: f"{f['peak_at']:.0f} ({f['window_at']:.0f})"),
    ]
    body = (
        f"{a.jobs} PretrainJobs of 1 to 64 workers ({setup['pods']:,} worker pods) in "
        f"{a.namespaces} namespaces, created at {a.rate:g}/s, on {setup['nodes']} simulated "
        f"nodes (`hlat_testbed.simnodes`: Nodes registered through the real API server, the "
        f"real scheduler binds the pods, a simulator reports them Running, renews the node "
        f"Leases and writes one training heartbeat per pod and attempt; no processes). The "
        f"operator runs as in production: its own process, the Helm chart's ServiceAccount, its "
        f"default intervals, its image's allocator (jemalloc preloaded, `PYTHONMALLOC=malloc`, "
        f"`MALLOC_ARENA_MAX=2`). The first operator starts before the jobs are created, the "
        f"others on the jobs already there, as after a failover: their start lists every job's "
        f"pods, by pages of 200 (`HLAT_OPERATOR_LIST_CHUNK`, the default), or in one response "
        f"(kopf's default), and kopf lets an object's event worker, which holds the object's "
        f"last event, idle 0.5 s (`HLAT_OPERATOR_EVENT_IDLE_SECONDS`, the default) or 5 s "
        f"(the last column: kopf's default). Then a fault every "
        f"{a.fault_every:g} s for {a.seconds:g} s (a job drawn at random, one of its pods "
        f"reported terminated with 137), once per operator configuration, one after the other "
        f"on the same jobs. Start-up: {a.jobs} jobs created in {setup['created']:.0f} s, every "
        f"pod Running {setup['running']:.0f} s after the first. The API server, etcd, the "
        f"scheduler, the controller manager, the simulator and the operator share the "
        f"machine.\n\n"
        + report_md.table(["", *names], rows)
        + f"\n\nJobs by phase at the end: {setup['phases']}."
    )
    goals = []
    if DEFAULT in results:
        f = results[DEFAULT]
        goals = [
            report_md.verdict(f"reaction p99 < 1 s at {a.jobs} jobs ({DEFAULT})",
                              {"s p99": f["reaction"][1]}, lambda v: v < 1.0),
            report_md.verdict(f"operator RSS <= 256 MiB at {a.jobs} jobs ({DEFAULT})",
                              {"MiB at the end": f["rss"], "MiB peak": f["peak"]},
                              lambda v: v <= 256, fmt="{:.0f}"),
        ]
    return report_md.Section(
        "operator_scale", f"The operator at {a.jobs} jobs (`bench/bench_operator_scale.py`)",
        " ".join([".venv/bin/python bench/bench_operator_scale.py", *argv]), body, goals)


def cleanup(core: client.CoreV1Api, namespaces: list[str], timeout: float = 300) -> None:
    """Delete the run's namespaces and wait until they are gone, so the next run's operator
    (which watches `scale-*`) is not loaded by this one's jobs. Worker pods are force-deleted:
    pods of simulated nodes left Terminating after the simulator stops stay for minutes."""
    for ns in namespaces:
        with contextlib.suppress(client.exceptions.ApiException):
            core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
            core.delete_namespace(ns)
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = [ns.metadata.name for ns in core.list_namespace().items
                if ns.metadata.name in namespaces]
        if not left:
            return
        time.sleep(2)
    print(f"namespaces still terminating after {timeout:.0f} s: {left}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=500)
    p.add_argument("--namespaces", type=int, default=10)
    p.add_argument("--rate", type=float, default=10.0, help="jobs created per second")
    p.add_argument("--seconds", type=float, default=120.0,
                   help="steady window with faults, per operator configuration")
    p.add_argument("--fault-every", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--also", type=config, action="append", default=[],
                   help="another operator configuration, NAME:KEY=VALUE,... (its environment)")
    a = p.parse_args()
    rng = random.Random(a.seed)
    sizes = [SIZES[i % len(SIZES)] for i in range(a.jobs)]
    pods = sum(sizes)
    cluster = Cluster()
    cluster.up(nodes=0, progress=lambda line: print(f"[cluster] {line}", flush=True))
    api = cluster.admin_api()
    install_crd(api)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    cleanup(core, [ns.metadata.name for ns in core.list_namespace().items  # a killed run's
                   if ns.metadata.name.startswith("scale-")])
    run = f"{int(time.time()) % 100000:05d}"
    namespaces = [f"scale-{run}-{i}" for i in range(a.namespaces)]
    for ns in namespaces:
        ensure_namespace(core, ns)
    trainers = Trainers(cluster.admin_api())
    nodes = simnodes.SimNodes(cluster.admin_api(), math.ceil(pods / PODS_PER_NODE * 1.1),
                              pods=PODS_PER_NODE, on_running=trainers).start()
    print(f"{a.jobs} jobs, {pods} worker pods, {len(nodes.names)} simulated nodes", flush=True)
    defaults = OperatorSettings()
    allocator = image_allocator()
    work = REPO / "runs" / "bench-operator-scale"
    jobs = Jobs(custom)
    results: dict[str, dict[str, Any]] = {}
    created = running = math.nan
    operator: OperatorProcess | None = None
    try:
        for i, (name, env) in enumerate([*CONFIGS.items(), *a.also]):
            port = free_port()
            operator = OperatorProcess(cluster, work / "operator.log", ["scale-*"], {
                "HLAT_OPERATOR_RESYNC_SECONDS": str(defaults.resync_seconds),
                "HLAT_OPERATOR_STATUS_INTERVAL_SECONDS": str(defaults.status_interval_seconds),
                "HLAT_OPERATOR_WATCH_NODES": "true",
                **allocator,  # as the operator image sets it
                **env,
            }, metrics_port=port).start()
            trace = RssTrace(operator.pid or 0)
            if i == 0:
                began = time.time()
                for j, size in enumerate(sizes):
                    custom.create_namespaced_custom_object(GROUP, VERSION, namespaces[
                        j % len(namespaces)], PLURAL, {
                        "apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
                        "metadata": {"name": f"job-{j:04d}"}, "spec": spec(size)})
                    time.sleep(max(0.0, began + (j + 1) / a.rate - time.time()))
                created = time.time() - began
                deadline = time.time() + 900
                while len(nodes.running) < pods and time.time() < deadline:
                    time.sleep(1)
                running = time.time() - began
                print(f"[{name}] created in {created:.0f} s; every pod running after "
                      f"{running:.0f} s ({len(nodes.running)}/{pods})", flush=True)
            time.sleep(20)  # the operator's first passes over every job settle
            window_at = time.time() - trace.began
            results[name] = window(a, rng, port, operator.pid or 0, nodes, trainers, jobs)
            results[name]["peak_at"], results[name]["window_at"] = trace.stop()[0], window_at
            print(f"[{name}] window done", flush=True)
            operator.stop()
            operator = None
    finally:
        jobs.stopping.set()
        if operator is not None:
            operator.stop()
        cleanup(core, namespaces)
        nodes.stop()
        nodes.remove()
    phases = dict(collections.Counter(jobs.phases.values()))
    print(f"\n== operator at scale: {a.jobs} jobs, {pods} worker pods, {len(nodes.names)} "
          f"simulated nodes; {a.seconds:.0f} s with a fault every {a.fault_every:g} s per "
          f"operator; jobs by phase at the end: {phases}")
    measured = {name: figures(r, a.jobs) for name, r in results.items()}
    for name, f in measured.items():
        report(name, f)
    report_md.emit(section(a, sys.argv[1:], {
        "pods": pods, "nodes": len(nodes.names), "created": created, "running": running,
        "phases": phases}, measured))


if __name__ == "__main__":
    main()
