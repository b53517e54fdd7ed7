"""Time from a fault to the next training step, per fault kind, on the local cluster.

For each fault (a worker SIGKILLed, a worker hung with SIGSTOP, a node taken down) a fresh tiny
2-node PretrainJob runs until it has a complete checkpoint; the fault is injected and the clock
runs until the new gang's rank 0 logs its first training step. The baseline, measured in the
same run, is a cold start: apply -> first training step of a fresh job. Recovery cannot beat
it (the new gang starts the same way, plus detection, teardown and checkpoint load),
so the ratio says what fault handling adds. Also shown: detection (fault -> the operator
records the failure) and the training steps lost.

Both restart strategies run side by side in the same run, each fault kind on a fresh job:
RecreateGang (every pod deleted, a new gang scheduled) and InPlace (the pods stay, their
launchers restart the trainers from warm standbys; only a lost node's pod is recreated). Under
InPlace the "kill" fault SIGKILLs the trainer process (the pod's launcher survives) and "hang"
SIGSTOPs the trainer only (a stuck collective: launcher and node fine); under RecreateGang they
hit the container's main process, as before. "InPlace+spare" adds `spareNodes: 1` (the rig's
third node): the lost node's rank moves to the warm spare.

    .venv/bin/python bench/bench_recovery.py        # needs root and the local cluster
    .venv/bin/python bench/bench_recovery.py --only kill:InPlace,hang:InPlace   # some cases
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

import report
from hlat_testbed import faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import (
    GROUP,
    PLURAL,
    REPO,
    VERSION,
    OperatorProcess,
    ensure_namespace,
    get_job,
    install_crd,
    make_sample_data,
)
from hlat_testbed.podfiles import PodNotFound

NS = "hlat-bench-recovery"
HANG_TIMEOUT = 8
STEADY_SECONDS = 10
"""The fault strikes this long after the first complete checkpoint: in steady training, as
most faults of a long run do (the launchers' next warm standbys start after the attempt's
first step and take a few seconds to import torch on this machine's 2 cores)."""


def spec(steps: int, strategy: str = "RecreateGang", **heartbeat: Any) -> dict[str, Any]:
    return {
        "image": "hlat-trainer:dev", "nodes": 2, "instanceType": "cpu", "processesPerNode": 1,
        "model": {"preset": "tiny", "hiddenSize": 64, "layers": 2, "intermediateSize": 128,
                  "maxSeqLen": 128},
        "precision": "fp32", "optimizer": {"lr": 3.0e-3, "minLr": 3.0e-4, "warmupSteps": 2},
        "data": {"path": "/fsx/data/sample", "tokenizer": "/fsx/data/sample/tokenizer.json",
                 "seqLen": 64},
        "train": {"globalBatch": 4, "microBatch": 2, "steps": steps},
        "checkpoint": {"dir": "/fsx/checkpoints", "interval": 4, "keep": 2, "async": False},
        "storage": {"claimName": "fsx", "mountPath": "/fsx"},
        "faultTolerance": {"maxRestarts": 3, "restartStrategy": strategy,
                           "backoff": {"initialSeconds": 1, "maxSeconds": 2},
                           "heartbeat": {"startupTimeoutSeconds": 120,
                                         "timeoutSeconds": "auto", **heartbeat}},
    }


RUN_ID = f"{int(time.time()) % 100000:05d}"
SERIAL = itertools.count()
"""And a serial: every round's jobs get new names (a name reused would find the last round's
pod log and read it as this round's)."""
"""In every job name: a pod of an earlier run with the same name left its log on the rig, and
would be read as this run's until the new pod started."""


class Run:
    def __init__(self, cluster: Cluster, name: str, body: dict[str, Any]) -> None:
        self.cluster, self.name = cluster, f"{name}-{RUN_ID}-{next(SERIAL)}"
        api = cluster.admin_api()
        self.custom, self.core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
            "metadata": {"name": self.name}, "spec": body})
        self.created = time.monotonic()

    def status(self) -> dict[str, Any]:
        return (get_job(self.custom, NS, self.name) or {}).get("status") or {}

    def first_step_at(self, attempt: int, timeout: float = 300, pod: str | None = None
                      ) -> float:
        """Wall time at which the attempt's rank 0 logged its first training step (`pod`: the
        pod an in-place restart kept, whose log holds every attempt since it was created)."""
        kept = pod is not None
        pod = pod or f"{self.name}-a{attempt}-0"
        marker = f"hlat-launch: attempt {attempt}: started"

        def stepped() -> bool:
            log = self._log(pod)
            if kept:  # an in-place launcher: only the lines after its start are this attempt's
                log = log[log.index(marker):] if marker in log else ""
            return any(line.startswith("{") for line in log.splitlines())

        return wait(stepped, timeout, f"a step of attempt {attempt} from {pod}")

    def _log(self, pod: str) -> str:
        try:
            return self.cluster.pod_log(NS, pod)
        except (OSError, ValueError, PodNotFound):  # not started yet
            return ""

    def delete(self) -> None:
        with contextlib.suppress(ApiException):
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, self.name)


def wait(probe: Callable[[], object], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return time.monotonic()
        time.sleep(0.1)
    raise TimeoutError(f"no {what} within {timeout}s")


MUTATING = ("POST", "PUT", "PATCH", "DELETE", "APPLY")
READS = ("GET", "LIST")


def api_requests(cluster: Cluster) -> dict[str, float]:
    """The API server's own count of requests it has answered, by verb (every client: the
    operator, the launchers and trainers, the kubelets, the scheduler, the controllers), from
    its /metrics (`apiserver_request_total`; a watch counts when it ends)."""
    api = cluster.admin_api()
    resp = api.call_api("GET", f"{api.configuration.host}/metrics", _request_timeout=(5, 30))
    resp.read()  # type: ignore[no-untyped-call]
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families((resp.data or b"").decode()):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name == "apiserver_request_total":
                verb = sample.labels.get("verb", "?")
                counts[verb] = counts.get(verb, 0.0) + sample.value
    return counts


def requests_between(before: dict[str, float], after: dict[str, float],
                     verbs: tuple[str, ...]) -> float:
    return sum(after.get(v, 0.0) - before.get(v, 0.0) for v in verbs)


def node_of(run: Run, pod: str) -> str:
    body: Any = run.core.read_namespaced_pod(pod, NS)
    return str(body.spec.node_name)


def measure(cluster: Cluster, kind: str, strategy: str) -> dict[str, Any]:
    # node-down: a hang timeout long enough that the node is found lost first (its kubelet
    # and its pods' heartbeats go silent together)
    extra = {"timeoutSeconds": HANG_TIMEOUT if kind == "hang" else 60}
    in_place = strategy.startswith("InPlace")
    spares = "+spare" in strategy
    body = spec(400, "InPlace" if in_place else strategy, **extra)
    if spares:
        body["faultTolerance"]["spareNodes"] = 1
    # snapshots every step in the +memory cases; off in the others (the durable path they
    # stand for: auto, the default where snapshots can serve, would take some)
    body["checkpoint"]["memoryInterval"] = 1 if "+memory" in strategy else "off"
    run = Run(cluster, f"rec-{kind}-{strategy.lower().replace('+', '-')}", body)
    node = ""
    try:
        wait(lambda: (run.status().get("latestCheckpoint") or {}).get("step"), 300,
             "a complete checkpoint")
        if spares:
            wait(lambda: (run.status().get("spares") or {}).get("ready"), 120, "a ready spare")
        steady = api_requests(cluster)
        time.sleep(STEADY_SECONDS)  # a fault in steady training, not in the first seconds
        victim = f"{run.name}-a0-1"
        before = api_requests(cluster)
        rate = requests_between(steady, before, MUTATING) / STEADY_SECONDS
        step_before = (run.status().get("progress") or {}).get("step", 0)
        node = node_of(run, victim)
        fault_at = time.monotonic()
        if kind == "kill":
            (faults.kill_trainer if in_place else faults.kill)(cluster.config, NS, victim)
        elif kind == "hang":
            (faults.hang_trainer if in_place else faults.hang)(cluster.config, NS, victim)
        else:
            faults.node_down(cluster.config, node)
        detected = wait(lambda: run.status().get("lastFailure"), 300, "the failure recorded")
        resumed = run.first_step_at(1, pod=f"{run.name}-a0-0" if in_place else None)
        after = api_requests(cluster)
        ckpt = (run.status().get("latestCheckpoint") or {}).get("step", 0)
        took = resumed - fault_at
        memory = "+memory" in strategy
        lost = lost_in_place(run) if in_place and (kind != "node-down" or memory) else max(
            step_before - ckpt, 0)
        # every client's requests from the fault to the next step (the steady training's
        # heartbeats, node Leases and status refreshes included: its write rate is shown)
        return {"detect": detected - fault_at, "recover": took, "lost": lost,
                "reason": run.status().get("lastFailure", {}).get("reason", "?"),
                "writes": requests_between(before, after, MUTATING),
                "reads": requests_between(before, after, READS), "steady": rate,
                "source": resumed_from(run) if in_place else "checkpoint"}
    finally:
        if kind == "node-down" and node:
            faults.node_up(cluster.config, node)
        run.delete()


def lost_in_place(run: Run) -> int:
    """Steps the fault cost, from the kept rank-0 pod's log: the last step attempt 0 logged
    less the step attempt 1 resumed from (a checkpoint or an in-memory snapshot)."""
    log = run._log(f"{run.name}-a0-0")
    cut = log.index("hlat-launch: attempt 1: started")
    before = [int(m) for m in re.findall(r'^\{"step": (\d+)', log[:cut], re.M)]
    resumed = re.search(r"resumed from (?:in-memory snapshot|checkpoint) step_(\d+)", log[cut:])
    if not before or resumed is None:
        return 0
    return max(0, max(before) - int(resumed.group(1)))


def resumed_from(run: Run) -> str:
    """What attempt 1 loaded, from the kept rank-0 pod's log: `memory` (an in-memory snapshot:
    no byte of the checkpoint volume read) or `checkpoint`."""
    log = run._log(f"{run.name}-a0-0")
    later = log[log.find("hlat-launch: attempt 1: started"):]
    return "memory" if "resumed from in-memory snapshot" in later else "checkpoint"


def cold_start(cluster: Cluster) -> float:
    run = Run(cluster, "rec-cold", spec(4))
    try:
        return run.first_step_at(0) - run.created
    finally:
        run.delete()


CASES = [(kind, strategy) for kind in ("kill", "hang", "node-down")
         for strategy in ("RecreateGang", "InPlace")] + [("node-down", "InPlace+spare"),
                                                         ("kill", "InPlace+memory"),
                                                         ("node-down", "InPlace+spare+memory")]


FAULTS = {
    ("kill", "RecreateGang"): "worker SIGKILLed",
    ("kill", "InPlace"): "trainer SIGKILLed",
    ("hang", "RecreateGang"): f"worker hung, timeout {HANG_TIMEOUT} s",
    ("hang", "InPlace"): f"trainer hung, timeout {HANG_TIMEOUT} s",
    ("node-down", "RecreateGang"): "node down",
    ("node-down", "InPlace"): "node down",
    ("node-down", "InPlace+spare"): "node down, a warm spare",
    ("kill", "InPlace+memory"): "trainer SIGKILLed, snapshots in memory every step",
    ("node-down", "InPlace+spare+memory"): "node down, a warm spare, snapshots and their "
                                           "copies in memory every step",
}
KILL_GOAL, HANG_GOAL, SPARE_GOAL, MEMORY_GOAL = 0.35, 0.35, 0.5, 0.15
PEER_GOAL_SECONDS, PEER_GOAL = 5.0, 0.25
"""Issue 34's for a lost node with a spare and snapshot copies: fault -> next step <= 5 s +
0.25x cold start."""
"""Issue 15's goals, in cold starts: SIGKILL (InPlace) -> next step; hang (InPlace) -> next
step beyond the hang timeout; a lost node with a spare -> next step beyond its detection."""


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One case over its rounds: median and fastest (the round with the shortest recovery)."""
    recover = [r["recover"] for r in results]
    fastest = min(results, key=lambda r: r["recover"])
    return {
        "n": len(results), "reason": "/".join(sorted({str(r["reason"]) for r in results})),
        "detect": statistics.median(r["detect"] for r in results),
        "recover": statistics.median(recover), "recover_min": fastest["recover"],
        "recover_max": max(recover),
        "beyond": statistics.median(r["recover"] - r["detect"] for r in results),
        "beyond_min": min(r["recover"] - r["detect"] for r in results),
        "lost": statistics.median(r["lost"] for r in results),
        "lost_max": max(r["lost"] for r in results),
        "writes": statistics.median(r["writes"] for r in results),
        "reads": statistics.median(r["reads"] for r in results),
        "steady": statistics.median(r.get("steady", math.nan) for r in results),
        "from_memory": sum(r.get("source") == "memory" for r in results),
    }


def section(baselines: list[float], rows: dict[tuple[str, str], list[dict[str, Any]]],
            when: str, command: str) -> report.Section:
    """The report's section from this run's cold starts and cases (pure: figures in, text
    out). `rows`: (fault, strategy) -> one {"detect": s, "recover": s, "lost": steps,
    "reason": str, "writes": n, "reads": n} per round. Ratios against the cold start: the
    median case over the median cold start, and the fastest over the fastest."""
    cold, cold_min = statistics.median(baselines), min(baselines)
    cases = {case: summary(results) for case, results in rows.items()}
    table = []
    for (kind, strategy), r in cases.items():
        table.append([
            FAULTS.get((kind, strategy), kind), strategy, r["reason"], f"{r['detect']:.1f} s",
            f"{r['recover']:.1f} / {r['recover_min']:.1f} / {r['recover_max']:.1f} s",
            f"{r['recover'] / cold:.2f} / {r['recover_min'] / cold_min:.2f}",
            f"{r['beyond'] / cold:.2f} / {r['beyond_min'] / cold_min:.2f}",
            f"{r['lost']:.0f}", f"{r['writes']:.0f} / {r['reads']:.0f}",
            f"{r['steady']:.1f}"])

    def goal(case: tuple[str, str], text: str, figures: Callable[[dict[str, Any]], dict[str,
             float]], holds: Callable[[float], bool], fmt: str) -> report.Goal:
        if case not in cases:
            return report.Goal(text, "not run: --only left this case out", False)
        return report.verdict(text, figures(cases[case]), holds, fmt)

    hang = {"median": HANG_TIMEOUT + HANG_GOAL * cold,
            "fastest": HANG_TIMEOUT + HANG_GOAL * cold_min}
    goals = [
        goal(("kill", "InPlace"), f"SIGKILL (InPlace): fault -> next step <= {KILL_GOAL}x cold "
             "start", lambda r: {"median": r["recover"] / cold,
                                 "fastest": r["recover_min"] / cold_min},
             lambda v: v <= KILL_GOAL, "{:.2f}x"),
        goal(("hang", "InPlace"), f"hang (InPlace): fault -> next step <= hang timeout + "
             f"{HANG_GOAL}x cold start ({HANG_TIMEOUT} + {HANG_GOAL} x cold start: "
             f"{hang['median']:.2f} s at the median, {hang['fastest']:.2f} s at the fastest; "
             "shown: the recovery less that limit)",
             lambda r: {"median": r["recover"] - hang["median"],
                        "fastest": r["recover_min"] - hang["fastest"]},
             lambda v: v <= 0, "{:+.2f} s"),
        goal(("kill", "InPlace+memory"), "SIGKILL with snapshots every step (issue 34): at most "
             "one step lost", lambda r: {"median": r["lost"], "most": r["lost_max"]},
             lambda v: v <= 1, "{:.0f} step(s)"),
        goal(("kill", "InPlace+memory"), "SIGKILL with snapshots every step (issue 34): fault -> "
             f"next step <= {MEMORY_GOAL}x cold start",
             lambda r: {"median": r["recover"] / cold, "fastest": r["recover_min"] / cold_min},
             lambda v: v <= MEMORY_GOAL, "{:.2f}x"),
        goal(("node-down", "InPlace+spare+memory"), "node lost with a spare and snapshot copies "
             "(issue 34): detected within 5 s", lambda r: {"median": r["detect"]},
             lambda v: v <= 5.0, "{:.1f} s"),
        goal(("node-down", "InPlace+spare+memory"), "node lost with a spare and snapshot copies "
             "(issue 34): resumed from memory, nothing read from the checkpoint volume, in "
             "every round", lambda r: {"rounds not from memory": r["n"] - r["from_memory"]},
             lambda v: v == 0, "{:.0f}"),
        goal(("node-down", "InPlace+spare+memory"), "node lost with a spare and snapshot copies "
             "(issue 34): at most one step lost",
             lambda r: {"median": r["lost"], "most": r["lost_max"]}, lambda v: v <= 1,
             "{:.0f} step(s)"),
        goal(("node-down", "InPlace+spare+memory"), "node lost with a spare and snapshot copies "
             f"(issue 34): fault -> next step <= {PEER_GOAL_SECONDS:.0f} s + {PEER_GOAL}x cold "
             "start (shown: the recovery less that limit)",
             lambda r: {"median": r["recover"] - PEER_GOAL_SECONDS - PEER_GOAL * cold,
                        "fastest": r["recover_min"] - PEER_GOAL_SECONDS - PEER_GOAL * cold_min},
             lambda v: v <= 0, "{:+.2f} s"),
        goal(("node-down", "InPlace+spare"), "node lost with a spare (InPlace+spare): fault -> "
             f"next step <= detection + {SPARE_GOAL}x cold start",
             lambda r: {"median": r["beyond"] / cold, "fastest": r["beyond_min"] / cold_min},
             lambda v: v <= SPARE_GOAL, "{:.2f}x"),
    ]
    rounds = max((r["n"] for r in cases.values()), default=0)
    body = f"""Run {when} on the local cluster (`hlat-cluster`, 3 nodes), the operator as a
subprocess with the rig's short intervals (resync 2 s; backoff 1 s, which a fault after
progress does not wait: each fault here follows a checkpoint). {rounds} round(s): each
round a cold start, then every case, the cases' order rotated from round to round. Each fault
hits a fresh tiny 2-node CPU job {STEADY_SECONDS} s after its first complete checkpoint
(steady training); "fault -> next step" runs until the attempt's rank 0 logs its first
training step. Baseline, in the same run: a cold start, apply -> first training step of a
fresh job: **{cold:.1f} s** median, {cold_min:.1f} s fastest, {max(baselines):.1f} s slowest
over {len(baselines)}. Ratios: the case's median over the median cold start / its fastest
round over the fastest cold start; a goal is met only when both hold. Under InPlace "kill"
SIGKILLs the trainer process (the launcher survives) and "hang" SIGSTOPs the trainer only (a
stuck collective); under RecreateGang they hit the container's main process. InPlace+spare:
`spareNodes: 1` on the rig's third node. InPlace+memory: `checkpoint.memoryInterval: 1` (each
rank's state in its pod's memory every step; durable checkpoints every 4 steps, as the
others); InPlace+spare+memory also keeps each node's copies in the other node's memory
(checkpoint.memoryReplicas 1, the default), from where the spare fetches the lost rank's. Steps lost under InPlace: the last step attempt 0's rank 0 logged less the step
attempt 1 resumed from (its log); otherwise the step the status showed at the fault less
the latest checkpoint. Node-down jobs use a 60 s hang timeout so the node
is found lost first. API requests: the API server's own count (`apiserver_request_total`,
every client: operator, launchers, trainers, kubelets, scheduler, controllers) from the fault
to the next step, per 2-node restart (median over the rounds), beside the write rate of the
same job's steady training in the {STEADY_SECONDS} s before the fault (heartbeats, node
Leases, status refreshes), which runs on during a recovery as long as the pods do.

{report.table(["fault", "strategy", "detected as", "detection (median)",
               "fault -> next step, median / fastest / slowest",
               "x cold start, median / fastest", "after detection, x cold start",
               "steps lost", "API requests, fault -> next step, writes / reads",
               "steady writes/s before the fault"], table)}

What an in-place restart does after detection: rendezvous (no backoff: the attempt made progress), the
engine, the checkpoint load and the first step, in a trainer a warm standby prepared ahead
(torch imported, DCP and the tokenizer loaded), with no pod created, scheduled or deleted.
Without a spare a lost node's new pod waits for the dead one to be force-deleted, whichever
the strategy."""
    return report.Section("recovery", "Time from a fault to the next training step, per fault "
                          "kind and restart strategy (local cluster)", command, body, goals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated FAULT:STRATEGY cases "
                        f"(default: all of {', '.join(':'.join(c) for c in CASES)})")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of (a cold start, every case), the cases rotated")
    a = parser.parse_args()
    only = [tuple(c.split(":", 1)) for c in a.only.split(",") if c]
    unknown = [":".join(c) for c in only if c not in CASES]
    if unknown:
        parser.error(f"--only: unknown case(s) {', '.join(unknown)}")
    when = report.now()
    cluster = Cluster()
    cluster.up(nodes=3, progress=lambda line: print(f"[cluster] {line}", flush=True))
    api = cluster.admin_api()
    install_crd(api)
    ensure_namespace(client.CoreV1Api(api), NS)
    work = REPO / "runs" / "bench-recovery"  # kept: the PV of the namespace points here
    make_sample_data(work / "fsx" / "data" / "sample")
    with contextlib.suppress(ApiException):
        cluster.create_shared_volume(NS, "fsx", work / "fsx")
    operator = OperatorProcess(cluster, work / "operator.log", [NS]).start()
    cases = list(only or CASES)
    baselines: list[float] = []
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {case: [] for case in cases}
    try:
        for i in range(a.rounds):
            baselines.append(cold_start(cluster))
            print(f"[round {i + 1}] cold start {baselines[-1]:.1f} s", flush=True)
            for case in cases[i % len(cases):] + cases[:i % len(cases)]:
                rows[case].append(measure(cluster, *case))
                r = rows[case][-1]
                print(f"[round {i + 1}] {case[0]} {case[1]}: {r['reason']} detected "
                      f"{r['detect']:.1f} s, next step {r['recover']:.1f} s, API requests "
                      f"{r['writes']:.0f} writes / {r['reads']:.0f} reads", flush=True)
    finally:
        operator.stop()
    cold = statistics.median(baselines)
    print(f"cold start (apply -> first step of a fresh 2-node job): {cold:.1f} s median, "
          f"{min(baselines):.1f} s fastest")
    print(f"{'fault':<11}{'strategy':<15}{'reason':<18}{'detect s':>9}{'to next step s':>16}"
          f"{'x cold start':>14}{'beyond detect, x cold':>23}{'steps lost':>12}"
          f"{'API w/r':>12}")
    for (kind, strategy), r in ((c, summary(v)) for c, v in rows.items()):
        print(f"{kind:<11}{strategy:<15}{r['reason']!s:<18}{r['detect']:>9.1f}"
              f"{r['recover']:>16.1f}{r['recover'] / cold:>14.2f}{r['beyond'] / cold:>23.2f}"
              f"{r['lost']:>12.0f}{r['writes']:>6.0f}/{r['reads']:<5.0f}")
    print(f"(medians over {a.rounds} round(s); hang timeout {HANG_TIMEOUT} s; operator resync "
          "2 s; backoff 1 s, none after progress)")
    sec = section(baselines, rows, when, report.command())
    for g in sec.goals:
        print(f"goal {g.line().replace('**', '')}")
    report.emit(sec)


if __name__ == "__main__":
    main()
