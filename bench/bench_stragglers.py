"""Straggler detection on the local cluster: precision and recall over a sweep of slowdowns.

One 2-node PretrainJob (a worker per rig node, a model computing for about 0.1 s a step) trains
with the operator's straggler detection (`faultTolerance.stragglers`, threshold 0.2, the window
below). Each trial slows one node's trainer on purpose (`faults.Slowdown`: paused for a fraction
of every 20 ms, so its compute takes 1 + s times as long) for the window plus a margin, then lets it run freely until the
condition clears; every node in turn, for every slowdown s of the sweep (seeded order), with a
healthy trial (no slowdown) in each round. What the operator flagged is read from the job's
`Straggler` condition, polled every 0.5 s.

- A trial's flags: the nodes the condition named while the trial ran.
- Precision: flags naming a node slowed by at least the threshold (s >= 0.2) / all flags (a
  healthy trial's flag, one naming a healthy node, or one naming a node slowed by less than the
  threshold is a false positive); recall: trials over the threshold (s > 0.2) in which the
  slowed node was flagged / all of them (at s = 0.2 itself a flag is right, its absence too).

A healthy run (`--healthy-seconds`, before the trials) checks the other side at length: a gang
with no slowdown over a soak's length, every flag in it false.

    .venv/bin/python bench/bench_stragglers.py [--window 20] [--rounds 1] [--healthy-seconds 0]
        [--trials-out FILE]   # needs root; FILE: every trial, one JSON object a line
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

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

NS = "hlat-bench-stragglers"
THRESHOLD = 0.2
SLOWDOWNS = (0.1, 0.2, 0.3, 0.5)
"""s: the slowed node's compute takes 1 + s times as long (a duty cycle pausing it s / (1 + s)
of the time)."""
MARGIN_S = 15.0
"""How long past the window a slowdown lasts: what detection may take beyond it (the trainer's
20-step median moving, a heartbeat period, an operator pass)."""


SETTLE_S = 10.0
"""After a trial's slowdown, the window plus this: time for the workers' 20-step medians to
forget it (about 6 s of steps) before the next trial begins."""


def spec(window: float) -> dict[str, Any]:
    return {
        "image": "hlat-trainer:dev", "nodes": 2, "instanceType": "cpu", "processesPerNode": 1,
        # big enough that a step computes for about 0.1 s, several pause cycles (the tiny
        # model's few ms would miss most of them); one thread per rank (the cpu type's rule)
        "model": {"preset": "tiny", "hiddenSize": 256, "layers": 4, "heads": 4, "kvHeads": 2,
                  "intermediateSize": 512, "maxSeqLen": 128},
        "precision": "fp32", "optimizer": {"lr": 3.0e-3, "minLr": 3.0e-4, "warmupSteps": 2},
        "data": {"path": "/fsx/data/sample", "tokenizer": "/fsx/data/sample/tokenizer.json",
                 "seqLen": 64},
        "train": {"globalBatch": 8, "microBatch": 4, "steps": 1_000_000},
        "checkpoint": {"dir": "/fsx/checkpoints", "interval": 200, "keep": 2, "async": False},
        "storage": {"claimName": "fsx", "mountPath": "/fsx"},
        "faultTolerance": {"restartStrategy": "InPlace", "maxRestarts": 0,
                           "stragglers": {"threshold": THRESHOLD, "windowSeconds": window}},
    }


def replace_spec(window: float) -> dict[str, Any]:
    """The same job with a warm spare and action Replace, checkpointing every 25 steps."""
    body = spec(window)
    body["faultTolerance"].update({"spareNodes": 1, "stragglers": {
        "action": "Replace", "threshold": THRESHOLD, "windowSeconds": window}})
    body["checkpoint"]["interval"] = 25
    return body


class Job:
    def __init__(self, cluster: Cluster, window: float, body: dict[str, Any] | None = None
                 ) -> None:
        self.cluster = cluster
        self.name = f"stragglers-{int(time.time() * 10) % 1000000:06d}"
        api = cluster.admin_api()
        self.custom, self.core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
            "metadata": {"name": self.name}, "spec": body or spec(window)})

    def status(self) -> dict[str, Any]:
        return (get_job(self.custom, NS, self.name) or {}).get("status") or {}

    def flagged(self) -> str | None:
        """The node the Straggler condition names now (None: not True)."""
        cond = next((c for c in self.status().get("conditions") or []
                     if c.get("type") == "Straggler"), {})
        if cond.get("status") != "True":
            return None
        return str(cond["message"]).split()[1]

    def wait_training(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status()
            if s.get("phase") == "Failed":
                raise RuntimeError(f"the job failed: {s.get('conditions')}")
            if any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in s.get("conditions") or []):
                return
            time.sleep(1)
        raise TimeoutError("the job never trained")

    def node_of(self, rank: int) -> tuple[str, str]:
        pods = self.core.list_namespaced_pod(NS, label_selector=f"hlat.dev/job={self.name}")
        pod = next(p for p in pods.items if p.metadata.labels.get("hlat.dev/node-rank")
                   == str(rank) and not p.metadata.labels.get("hlat.dev/spare"))
        return pod.metadata.name, pod.spec.node_name

    def peers(self, pod: str) -> list[str]:
        """The gang's other running worker pods (kept off the slowed one's CPU)."""
        pods = self.core.list_namespaced_pod(NS, label_selector=f"hlat.dev/job={self.name}")
        return [p.metadata.name for p in pods.items if p.metadata.name != pod
                and not p.metadata.labels.get("hlat.dev/spare") and p.status.phase == "Running"]

    def delete(self) -> None:
        with contextlib.suppress(ApiException):
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, self.name)


def trial(job: Job, slowed: tuple[str, str] | None, s: float, window: float,
          length_s: float | None = None) -> dict[str, Any]:
    """Slow `slowed` (pod, node) by s for the window plus the margin, or for `length_s` (None:
    a healthy trial of that length); then wait until the condition clears. Returns the flags
    seen and when."""
    length = window + MARGIN_S if length_s is None else length_s
    flags: dict[str, float] = {}  # node -> seconds into the trial it was first named
    began = time.monotonic()

    def watch(until: float) -> None:
        while time.monotonic() < until:
            node = job.flagged()
            if node is not None:
                flags.setdefault(node, time.monotonic() - began)
            time.sleep(0.5)

    if slowed is None:
        watch(began + length)
    else:
        pause = s / (1 + s)
        with faults.Slowdown(job.cluster.config, NS, slowed[0], fraction=pause,
                             apart=job.peers(slowed[0])):
            watch(began + length)
    # a flag raised after the slowdown ended still belongs to this trial (a node over the
    # threshold near its end flagged once its window is up): watched for a window more
    watch(time.monotonic() + window + SETTLE_S)
    clear_by = time.monotonic() + 60
    while job.flagged() is not None and time.monotonic() < clear_by:
        time.sleep(0.5)
    return {"node": slowed[1] if slowed else None, "s": s, "flags": flags,
            "seconds": round(time.monotonic() - began, 1)}


REPLACE_PAUSE = 0.3
"""The Replace rounds' slowdown: paused 30% of the time (compute about 1.43x)."""


def _logged_step_seconds(job: Job, pod: str, after_step: int) -> list[float]:
    """The step times rank 0's pod logged for steps after `after_step`, in log order."""
    out = []
    for line in job.cluster.pod_log(NS, pod).splitlines():
        if line.startswith("{") and '"stepSeconds"' in line:
            entry = json.loads(line)
            if entry["step"] > after_step:
                out.append(float(entry["stepSeconds"]))
    return out


def median_step_seconds(job: Job, steps: int = 30, timeout: float = 120) -> float:
    """The median time of the job's next `steps` steps (rank 0's log)."""
    pod, start = f"{job.name}-a0-0", int((job.status().get("progress") or {}).get("step", 0))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = _logged_step_seconds(job, pod, start)
        if len(seen) >= steps:
            return statistics.median(seen[:steps])
        time.sleep(1)
    raise TimeoutError(f"{steps} steps not logged in {timeout:.0f}s")


def wait_for(job: Job, what: str, pred: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = job.status()
        if pred(status):
            return status
        time.sleep(1)
    raise TimeoutError(f"{what}: not in {timeout:.0f}s")


def _settled(job: Job, attempt: int) -> None:
    """The gang of `attempt` training beside a ready spare, every warm standby idle: how the
    step time is measured on both sides of the move."""
    wait_for(job, f"attempt {attempt} trains beside a ready spare", lambda s: s.get(
        "attempt", 0) == attempt and (s.get("spares") or {}).get("ready") == 1 and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in s.get("conditions") or []), 240)
    faults.wait_standbys_idle()


def replace_round(cluster: Cluster, window: float) -> dict[str, Any]:
    """A fresh job with a warm spare and action Replace: the median step time healthy, then
    rank 1's node slowed until its rank moved to the spare, then the median again."""
    job = Job(cluster, window, replace_spec(window))
    try:
        _settled(job, 0)
        healthy = median_step_seconds(job)
        pod, node = job.node_of(1)
        began = time.monotonic()
        with faults.Slowdown(job.cluster.config, NS, pod, fraction=REPLACE_PAUSE,
                             apart=job.peers(pod)):
            slowed = median_step_seconds(job, 20)
            moved = wait_for(job, "the move", lambda s: s.get("attempt", 0) >= 1, window + 120)
        latency = time.monotonic() - began
        failure = moved.get("lastFailure") or {}
        _settled(job, 1)
        after = median_step_seconds(job)
        return {"healthy": healthy, "slowed": slowed, "after": after, "latency": latency,
                "right": failure.get("reason") == "Straggler" and failure.get("node") == node}
    finally:
        job.delete()


def score(trials: list[dict[str, Any]]) -> dict[str, float]:
    flags = [(t, node) for t in trials for node in t["flags"]]
    correct = [1 for t, node in flags if node == t["node"] and t["s"] >= THRESHOLD]
    due = [t for t in trials if t["node"] is not None and t["s"] > THRESHOLD]
    found = [t for t in due if t["node"] in t["flags"]]
    return {"precision": len(correct) / len(flags) if flags else float("nan"),
            "recall": len(found) / len(due) if due else float("nan"),
            "flags": float(len(flags)), "false": float(len(flags) - len(correct))}


def section(trials: list[dict[str, Any]], window: float, command: str,
            moves: list[dict[str, Any]], long_runs: list[dict[str, Any]] | None = None
            ) -> report.Section:
    long_runs = long_runs or []
    rows = []
    for s in (0.0, *SLOWDOWNS):
        mine = [t for t in trials if t["s"] == s]
        hit = [t for t in mine if t["node"] is not None and t["node"] in t["flags"]]
        wrong = sum(1 for t in mine for n in t["flags"] if n != t["node"])
        latency = [t["flags"][t["node"]] for t in hit]
        rows.append([f"{s:.0%}" if s else "none (healthy)", len(mine),
                     f"{len(hit)}/{len(mine)}" if s else "-", wrong,
                     f"{statistics.median(latency):.0f}" if latency else "-"])
    sc = score(trials + long_runs)
    body = (f"One 2-node job (a worker per rig node, about 0.1 s of compute a step), "
            f"threshold {THRESHOLD:.0%}, window {window:.0f} s; each trial slows one node's "
            "trainer (a SIGSTOP/SIGCONT duty cycle of 20 ms, nominally making its compute take "
            f"1 + s times as long) for the window + {MARGIN_S:.0f} s, flags watched for a "
            f"window + {SETTLE_S:.0f} s more, "
            "every node in turn, plus a healthy trial per round; flags read from the job's "
            "`Straggler` condition.\n\n"
            + report.table(["slowdown s", "trials", "slowed node flagged", "other nodes flagged",
                            "median s to the flag"], rows)
            + f"\n\nPrecision {sc['precision']:.1%} ({sc['flags']:.0f} flags, {sc['false']:.0f} "
            f"false), recall {sc['recall']:.1%} over the trials with s > {THRESHOLD:.0%}. A "
            "slowdown at the threshold itself (20%) may or may not be flagged (either is right); "
            "under it (10%) a flag counts as false.")
    goals = [report.verdict("detection precision >= 99% at >= 20% slowdown",
                            {"precision": sc["precision"] * 100}, lambda v: v >= 99, "{:.1f}%")]
    if long_runs:
        rows = [[f"{t['node']} slowed by {t['s']:.0%}" if t["node"] else "none (healthy)",
                 f"{t['seconds']:.0f}", f"{2 * t['seconds'] / window:.0f}",
                 ", ".join(f"{n} at {v:.0f} s" for n, v in t["flags"].items()) or "0"]
                for t in long_runs]
        body += ("\n\nLong runs before the trials, on the same gang, where every flag is false "
                 "(counted in the precision above): healthy for a soak's length, then each node "
                 "slowed under the threshold in turn. A node-window is one node watched for "
                 "one straggler window (the chances to flag it wrongly):\n\n"
                 + report.table(["slowdown", "seconds", "node-windows", "flags"], rows))
        healthy = [t for t in long_runs if t["node"] is None]
        if healthy:
            goals.append(report.verdict(
                "no flag over a healthy run of a soak's length",
                {"flags": float(sum(len(t["flags"]) for t in healthy))}, lambda v: v == 0,
                "{:.0f}"))
    if moves:
        rows = [[i + 1, f"{m['healthy']:.3f}", f"{m['slowed']:.3f}", f"{m['after']:.3f}",
                 f"{m['after'] / m['healthy']:.2f}x", f"{m['latency']:.0f}",
                 "yes" if m["right"] else "**no**"] for i, m in enumerate(moves)]
        ratio = statistics.median(m["after"] / m["healthy"] for m in moves)
        body += (f"\n\nReplace: a fresh 2-node job with a warm spare per round; rank 1's node "
                 f"paused {REPLACE_PAUSE:.0%} of the time until its rank moved to the spare. "
                 "Median step time (rank 0's log) of 30 steps before, 20 during, 30 after, "
                 "each measured with the gang training beside a ready spare and every warm "
                 "standby idle:\n\n"
                 + report.table(["round", "healthy s", "slowed s", "after the move s",
                                 "after / healthy", "s to the move", "right node"], rows)
                 + f"\n\nMedian after / healthy {ratio:.2f}x over {len(moves)} rounds. On "
                 "this VM the same job's step time differs by up to a quarter between "
                 "processes and over minutes (one process alone: 0.078-0.107 s for the same "
                 "steps), so each round's ratio carries that noise.")
        goals.append(report.verdict(
            "step time after moving off a 30% straggler within 5% of the healthy baseline "
            "(median over rounds)", {"after / healthy": ratio}, lambda v: v <= 1.05,
            "{:.2f}x"))
    return report.Section("stragglers", "Straggler detection: precision and recall over "
                          "injected slowdowns (local cluster)", command, body, goals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=20.0,
                        help="stragglers.windowSeconds of the job (default 20)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--replace-rounds", type=int, default=3,
                        help="rounds of the Replace measurement (0: none)")
    parser.add_argument("--healthy-seconds", type=float, default=0.0,
                        help="a healthy run of this length before the trials (0: none)")
    parser.add_argument("--subthreshold-seconds", type=float, default=0.0,
                        help="then each node slowed by the sweep's smallest slowdown, under the "
                        "threshold, for this long (0: none)")
    parser.add_argument("--trials-out", type=Path, default=None,
                        help="append every trial here, one JSON object a line")
    a = parser.parse_args()
    cluster = Cluster()
    cluster.up(nodes=2, progress=lambda line: print(f"[cluster] {line}", flush=True))
    api = cluster.admin_api()
    install_crd(api)
    ensure_namespace(client.CoreV1Api(api), NS)
    work = REPO / "runs" / "bench-stragglers"
    make_sample_data(work / "fsx" / "data" / "sample")
    with contextlib.suppress(ApiException):
        cluster.create_shared_volume(NS, "fsx", work / "fsx")
    operator = OperatorProcess(cluster, work / "operator.log", [NS]).start()
    job = Job(cluster, a.window)
    trials: list[dict[str, Any]] = []
    long_runs: list[dict[str, Any]] = []
    stamp = report.now()

    def record(t: dict[str, Any], phase: str) -> None:
        if a.trials_out:
            with a.trials_out.open("a") as f:
                f.write(json.dumps({"run": stamp, "phase": phase, "window": a.window, **t}) + "\n")
    rng = random.Random(a.seed)
    try:
        job.wait_training()
        pods = [job.node_of(rank) for rank in range(2)]
        if a.healthy_seconds:
            long_runs.append(trial(job, None, 0.0, a.window, a.healthy_seconds))
        for pod in pods if a.subthreshold_seconds else []:
            long_runs.append(trial(job, pod, SLOWDOWNS[0], a.window, a.subthreshold_seconds))
        for t in long_runs:
            record(t, "long run")
            print(f"[long run] {t['node'] or '-'} slowed by {t['s']:.0%} for {t['seconds']:.0f}s: "
                  f"flags {t['flags']}", flush=True)
        for r in range(a.rounds):
            plan: list[tuple[tuple[str, str] | None, float]] = [(None, 0.0)] + [
                (p, s) for s in SLOWDOWNS for p in pods]
            rng.shuffle(plan)
            for slowed, s in plan:
                trials.append(trial(job, slowed, s, a.window))
                t = trials[-1]
                record(t, f"round {r + 1}")
                print(f"[round {r + 1}] slowed {t['node'] or '-'} by {s:.0%}: flags "
                      f"{ {n: round(v) for n, v in t['flags'].items()} }", flush=True)
        job.delete()
        moves = []
        for r in range(a.replace_rounds):
            moves.append(replace_round(cluster, a.window))
            m = moves[-1]
            print(f"[replace {r + 1}] healthy {m['healthy']:.3f}s, slowed {m['slowed']:.3f}s, "
                  f"after the move {m['after']:.3f}s (right node: {m['right']})", flush=True)
    finally:
        job.delete()
        operator.stop()
    sec = section(trials, a.window, report.command(), moves, long_runs)
    print(sec.body)
    for g in sec.goals:
        print(f"goal {g.line().replace('**', '')}")
    report.emit(sec)


if __name__ == "__main__":
    main()
