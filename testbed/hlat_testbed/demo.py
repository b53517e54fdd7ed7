"""The one-command demo: `python -m hlat_testbed.demo` (README's `make demo`).

On the local cluster (built or reused, 3 nodes), it installs the CRD, creates the namespace
and a ReadWriteMany PVC `fsx` backed by a host directory (`runs/demo/fsx`), writes the sample
dataset and tokenizer into it (`hlat-data sample`), installs the Helm chart's RBAC with
`helm upgrade --install` (hlat_testbed.chart), starts the operator as a subprocess (with a token
of the chart's ServiceAccount; `HLAT_OPERATOR_TRAINER_COMMAND` = this venv's
`hlat-launch`), applies `examples/pretrainjob-tiny.yaml` (2 CPU nodes), prints progress from the
job's status, SIGKILLs one worker once a checkpoint exists, shows the restart and the resumed
step in the new worker's log, waits for Succeeded, draws the dashboards' panels from a real
Prometheus that scraped the run (as the chart's ServiceMonitor/PodMonitor select) to PNG files,
prints `kubectl get pj` and where the logs and pictures are, and stops the operator. The cluster stays up unless `--down` is given.

Exit status 0 when the job Succeeded after recovering from the fault, 1 otherwise.
`OperatorProcess` is shared with the operator's end-to-end tests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed import build, chart, faults, prometheus
from hlat_testbed.cluster import Cluster, kubectl_binary

GROUP, VERSION, PLURAL = "hlat.dev", "v1alpha1", "pretrainjobs"
REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "pretrainjob.yaml"
EXAMPLE = REPO / "examples" / "pretrainjob-tiny.yaml"
CLAIM = "fsx"

RIG_OPERATOR_ENV = {
    # short intervals for a local run (defaults suit EKS); see hlat_operator/config.py
    "HLAT_OPERATOR_RESYNC_SECONDS": "2",
    "HLAT_OPERATOR_STATUS_INTERVAL_SECONDS": "2",
    "HLAT_OPERATOR_HEARTBEAT_PERIOD_SECONDS": "2",
    "HLAT_OPERATOR_TERMINATION_GRACE_SECONDS": "5",
    "HLAT_OPERATOR_FORCE_DELETE_AFTER_SECONDS": "10",
    "HLAT_OPERATOR_TRAINER_METRICS_PORT": "0",
}


def venv_bin(name: str) -> Path:
    """A console script of the interpreter running this (works from any checkout)."""
    return Path(sys.executable).parent / name


class OperatorProcess:
    """`python -m hlat_operator.cli` as a subprocess, with the credentials of the Helm chart's
    ServiceAccount (hlat_testbed.chart), unless a kubeconfig is given."""

    def __init__(self, cluster: Cluster, log_path: Path, namespaces: list[str],
                 extra_env: dict[str, str] | None = None,
                 kubeconfig: Path | None = None, metrics_port: int = 0) -> None:
        self.cluster, self.log_path, self.namespaces = cluster, log_path, namespaces
        self.extra_env = extra_env or {}
        self.kubeconfig = kubeconfig
        self.metrics_port = metrics_port
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> OperatorProcess:
        if self.kubeconfig is None:
            self.kubeconfig = chart.operator_kubeconfig(self.cluster)
        env = {**os.environ, **RIG_OPERATOR_ENV, **self.extra_env,
               "KUBECONFIG": str(self.kubeconfig),
               "HLAT_OPERATOR_TRAINER_COMMAND": str(venv_bin("hlat-launch")),
               "HLAT_OPERATOR_EVAL_COMMAND": str(venv_bin("hlat-eval")),
               "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "hlat_operator.cli", "--liveness", "none",
                "--metrics-port", str(self.metrics_port)]
        for ns in self.namespaces:
            argv += ["--namespace", ns]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed operator pod."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM (kopf stops gracefully), then SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None


def install_crd(api: client.ApiClient, path: Path = CRD, timeout: float = 30) -> None:
    """Create or replace the CRD and wait until it is Established."""
    ext = client.ApiextensionsV1Api(api)
    body: Any = yaml.safe_load(path.read_text())
    name = body["metadata"]["name"]
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as err:
        if err.status != 409:
            raise
        current: Any = ext.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        ext.replace_custom_resource_definition(name, body)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        crd: Any = ext.read_custom_resource_definition(name)
        if any(c.type == "Established" and c.status == "True"
               for c in crd.status.conditions or []):
            return
        time.sleep(0.3)
    raise TimeoutError(f"CRD {name} not Established after {timeout}s")


def install_component_crds(api: client.ApiClient, component: build.Component) -> None:
    """Build `component` (once, cached) and install the CRDs it ships in its cache's files."""
    build.build_component(component)
    for name in component.files:
        install_crd(api, build.component_file(component, name))


def ensure_namespace(core: client.CoreV1Api, name: str) -> None:
    try:
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace",  # type: ignore[arg-type]
                               "metadata": {"name": name}})
    except ApiException as err:
        if err.status != 409:
            raise
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if core.list_namespaced_service_account(
                name, field_selector="metadata.name=default").items:
            return
        time.sleep(0.3)


def ensure_volume(cluster: Cluster, namespace: str, host_dir: Path) -> None:
    try:
        cluster.create_shared_volume(namespace, CLAIM, host_dir)
    except ApiException as err:
        if err.status != 409:
            raise
        cluster.wait_claim_bound(namespace, CLAIM)


SAMPLE_DOCS = 1500
"""The demo's sample: 1,500 documents train, 150 others are held out (`spec.eval`)."""
EVALUATION = {
    "eval": {"path": "/fsx/data/sample/held-out", "interval": 10, "batches": 4},
    "evaluation": {"every": 3, "retries": 1, "deadlineSeconds": 600},
}
"""What the demo adds to the example: the held-out loss in the loop every 10 steps, and an
evaluation Job (hlat-eval) on every third durable checkpoint and the last."""


def make_sample_data(out: Path) -> None:
    if all((out / f).exists() for f in ("tokenizer.json", "train.arrow",
                                        "held-out/held_out.arrow")):
        return
    subprocess.run([str(venv_bin("hlat-data")), "sample", "--out", str(out), "--docs",
                    str(SAMPLE_DOCS)], check=True)


def load_job(path: Path = EXAMPLE) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load(path.read_text())
    return job


def get_job(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        job: dict[str, Any] = custom.get_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, namespace, PLURAL, name)
        return job
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def delete_job_and_wait(custom: client.CustomObjectsApi, core: client.CoreV1Api,
                        namespace: str, name: str, timeout: float = 60) -> None:
    with contextlib.suppress(ApiException):
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                               propagation_policy="Foreground")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = core.list_namespaced_pod(namespace, label_selector=f"hlat.dev/job={name}").items
        if get_job(custom, namespace, name) is None and not pods:
            return
        time.sleep(0.5)


def status_line(job: dict[str, Any]) -> str:
    s = job.get("status") or {}
    prog, up, rs = s.get("progress") or {}, s.get("uptime") or {}, s.get("restarts") or {}
    loss = prog.get("loss")
    ckpt = (s.get("latestCheckpoint") or {}).get("step")
    ratio, good = up.get("ratio"), (s.get("goodput") or {}).get("ratio")
    return (f"phase={s.get('phase', '-'):<10} attempt={s.get('attempt', 0)} "
            f"step={prog.get('step', 0):<4} loss={loss if loss is None else f'{loss:.3f}'} "
            + (f"val={prog['validationLoss']:.3f} " if prog.get("validationLoss") else "")
            + f"checkpoint={ckpt} restarts={rs.get('total', 0)} "
            f"uptime={up.get('runningSeconds', 0):.0f}s/{up.get('downSeconds', 0):.0f}s down"
            + (f" ratio={ratio:.3f}" if ratio is not None else "")
            + (f" goodput={good:.3f}" if good is not None else ""))


GOODPUT_ROWS = (
    ("productive", "training steps no earlier attempt had done"),
    ("pending", "pods created -> trainer launched (scheduling, container start)"),
    ("startup", "launcher -> model built (imports, rendezvous)"),
    ("compile", "graph compilation"),
    ("restore", "loading the durable checkpoint resumed from"),
    ("memoryRestore", "loading the in-memory snapshot resumed from"),
    ("recompute", "steps trained again after the fault"),
    ("checkpoint", "durable saves blocking the loop"),
    ("snapshot", "in-memory snapshots blocking the loop"),
    ("dataWait", "waiting for the data loader"),
    ("evaluation", "held-out validation loss"),
    ("finalCheckpoint", "waiting for the last asynchronous write"),
    ("detection", "last report before the fault -> operator acting"),
    ("teardown", "deleting the failed gang"),
    ("backoff", "restart backoff"),
    ("other", "workers exiting -> operator seeing it, and the rest"),
    ("unreported", "not reported by the workers yet"),
)


def goodput_table(status: dict[str, Any]) -> str:
    """`status.goodput` as a small table: seconds and share of wall time per cause, next to
    uptime (the paper's measure), so the two can be told apart."""
    g, up = status.get("goodput") or {}, status.get("uptime") or {}
    wall = g.get("wallSeconds") or 0.0
    badput = g.get("badputSeconds") or {}
    lines = [f"goodput {g.get('ratio') or 0:.1%} of {wall:.1f}s wall time "
             f"(uptime, the paper's measure: {up.get('ratio') or 0:.1%}); "
             f"lost work {g.get('lostWorkSeconds', 0):.1f}s, {status.get('lostSteps', 0)} steps"]
    for key, what in GOODPUT_ROWS:
        seconds = g.get("productiveSeconds", 0.0) if key == "productive" else badput.get(key, 0)
        if seconds or key == "productive":
            share = seconds / wall if wall else 0.0
            lines.append(f"  {key:<16}{seconds:8.1f}s {share:7.1%}  {what}")
    return "\n".join(lines)


def resumed_step(log: str) -> int | None:
    """The step a resumed trainer starts at, from its log line."""
    m = re.search(r"resumed from checkpoint step_(\d+): next step is (\d+)", log)
    return int(m.group(2)) if m else None


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(f"[demo {time.monotonic() - t0:6.1f}s] {line}", flush=True)

    cluster = Cluster()
    cluster.up(nodes=3, progress=say)
    api = cluster.admin_api()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    install_crd(api)
    say(f"CRD installed from {CRD.relative_to(REPO)}")
    ns, workdir = args.namespace, Path(args.workdir).resolve()
    fsx = workdir / "fsx"
    ensure_namespace(core, ns)
    job = load_job()
    job["spec"].update(EVALUATION)
    name = job["metadata"]["name"]
    if get_job(custom, ns, name) is not None:
        say(f"deleting the previous {name} in {ns}")
        delete_job_and_wait(custom, core, ns, name)
    shutil.rmtree(fsx / "checkpoints", ignore_errors=True)  # a fresh run, not a resumed one
    ensure_volume(cluster, ns, fsx)
    say(f"PVC {ns}/{CLAIM} -> {fsx}; writing the sample dataset")
    make_sample_data(fsx / "data" / "sample")
    op_log = workdir / "operator.log"
    op_log.unlink(missing_ok=True)
    metrics_port = prometheus.free_port()
    operator = OperatorProcess(cluster, op_log, [ns], {"HLAT_OPERATOR_TRAINER_METRICS_PORT":
                                                       str(TRAINER_METRICS_PORT)},
                               metrics_port=metrics_port).start()
    say(f"chart installed (helm release {chart.RELEASE} in {chart.NAMESPACE}, its RBAC); "
        f"operator started as its ServiceAccount (pid {operator.pid}), log {op_log}")
    prom = start_prometheus(cluster, workdir, metrics_port)
    say(f"Prometheus {prom.url} scrapes the operator and the workers as the chart's "
        "ServiceMonitor/PodMonitor say")
    ok = False
    pictures: dict[Path, dict[str, int]] = {}
    started = time.time()
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job)
        say(f"applied {EXAMPLE.relative_to(REPO)}: {name} ({job['spec']['nodes']} nodes), "
            "with a held-out validation loss every 10 steps and evaluation Jobs on its "
            "checkpoints")
        ok = watch(cluster, custom, ns, name, say, args.timeout, operator)
        ok = watch_evaluations(custom, ns, name, say, 300) and ok
        time.sleep(3)  # the last scrapes
        pictures = draw_dashboards(prom, ns, name, started, workdir / "dashboards")
    finally:
        operator.stop()
        prom.stop()
        say("operator and Prometheus stopped")
    kubectl = [str(kubectl_binary()), f"--kubeconfig={cluster.kubeconfig}"]
    print(subprocess.run([*kubectl, "get", "pj", "-n", ns], capture_output=True,
                         text=True).stdout, flush=True)
    final = get_job(custom, ns, name) or {}
    print(goodput_table(final.get("status") or {}) + "\n", flush=True)
    print("dashboards (from the real Prometheus data):\n" + "".join(
        f"  {path}  ({sum(1 for n in counts.values() if n)}/{len(counts)} panels with data)\n"
        for path, counts in pictures.items()), flush=True)
    print(f"logs:\n  operator:     {op_log}\n"
          f"  worker pods:  {cluster.config.pods_dir}/{ns}_{name}-a*/trainer.log "
          f"(or: hlat-cluster logs POD -n {ns})\n"
          f"  checkpoints:  {fsx / 'checkpoints'}\n"
          f"  cluster:      {cluster.config.logs_dir}\n"
          f"  events:       hlat-cluster kubectl get events -n {ns}", flush=True)
    if args.down:
        cluster.down(progress=say)
    else:
        say(f"cluster left up (hlat-cluster down stops it); KUBECONFIG={cluster.kubeconfig}")
    say(f"done in {time.monotonic() - t0:.0f}s: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


TRAINER_METRICS_PORT = 9400


def start_prometheus(cluster: Cluster, workdir: Path, operator_port: int) -> prometheus.Prometheus:
    """A real Prometheus scraping per the chart's monitors; the operator (a host process here)
    gets an EndpointSlice behind the chart's metrics Service."""
    prometheus.expose_host_port(cluster.admin_api(), chart.NAMESPACE,
                                f"{chart.RELEASE}-metrics", cluster.config.host_ip,
                                operator_port)
    shutil.rmtree(workdir / "prometheus", ignore_errors=True)
    configs = prometheus.scrape_configs(prometheus.chart_monitors(), cluster.kubeconfig)
    return prometheus.Prometheus(cluster, workdir / "prometheus").start(configs)


def draw_dashboards(prom: prometheus.Prometheus, ns: str, name: str, started: float,
                    out: Path) -> dict[Path, dict[str, int]]:
    from hlat_testbed import pictures  # matplotlib: only when drawing

    return pictures.draw(prom, ns, name, started, time.time(), out)


def rank_zero_pod(cluster: Cluster, ns: str, name: str, attempt: int) -> str:
    """Node rank 0's pod in `attempt` (kept by an in-place restart, it keeps its first name)."""
    pods = client.CoreV1Api(cluster.admin_api()).list_namespaced_pod(
        ns, label_selector=f"hlat.dev/job={name},hlat.dev/attempt={attempt},"
                           "hlat.dev/node-rank=0").items
    return str(pods[0].metadata.name) if pods else f"{name}-a{attempt}-0"


def watch_evaluations(custom: client.CustomObjectsApi, ns: str, name: str, say: Any,
                      timeout: float) -> bool:
    """Until every evaluation Job of the job has settled (the last checkpoint's runs after the
    training ends); says each one's result. False when one failed or `timeout` passed."""
    deadline = time.monotonic() + timeout
    entries: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        entries = ((get_job(custom, ns, name) or {}).get("status") or {}).get(
            "evaluations") or []
        if entries and all(e.get("phase") != "Running" for e in entries):
            break
        time.sleep(1)
    else:
        say(f"evaluations not settled after {timeout:.0f}s: {entries}")
        return False
    for e in entries:
        found = e.get("results") or {}
        what = (f"validation loss {found['validationLoss']:.4f}" if "validationLoss" in found
                else e.get("message") or found)
        say(f"evaluation Job {e.get('job')}: checkpoint step {e.get('step')} "
            f"({e.get('tokens', 0):.0f} tokens): {e.get('phase')}, {what}")
    return all(e.get("phase") == "Succeeded" for e in entries)


def watch(cluster: Cluster, custom: client.CustomObjectsApi, ns: str, name: str,
          say: Any, timeout: float, operator: OperatorProcess) -> bool:
    killed: str | None = None
    last = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = get_job(custom, ns, name) or {}
        s = job.get("status") or {}
        line = status_line(job)
        key = re.sub(r" uptime=.*", "", line)  # a line when phase, step or counts change
        if key != last:
            say(line)
            last = key
        phase = s.get("phase")
        if phase in ("Succeeded", "Failed"):
            break
        if not operator.alive():
            say("the operator exited; see its log")
            return False
        if killed is None and phase == "Running" and s.get("latestCheckpoint"):
            killed = f"{name}-a{s.get('attempt', 0)}-1"
            in_place = ((job.get("spec") or {}).get("faultTolerance") or {}).get(
                "restartStrategy", "InPlace") == "InPlace"
            with contextlib.suppress(Exception):
                # in place the pod outlives its trainer: the trainer process is what crashes
                (faults.kill_trainer if in_place else faults.kill)(cluster.config, ns, killed)
                say(f"FAULT: SIGKILL to the trainer of pod {killed} (node rank 1)")
        time.sleep(1)
    else:
        say(f"timed out after {timeout:.0f}s")
        return False
    s = (get_job(custom, ns, name) or {}).get("status") or {}
    failure = s.get("lastFailure") or {}
    if failure:
        say(f"last failure: {failure.get('reason')} on {failure.get('pod')} "
            f"(exit {failure.get('exitCode')})")
    if s.get("attempt", 0) > 0:
        pod = rank_zero_pod(cluster, ns, name, s["attempt"])
        with contextlib.suppress(Exception):
            log = cluster.pod_log(ns, pod)
            marker = f"hlat-launch: attempt {s['attempt']}: started"  # a pod kept in place
            step = resumed_step(log[log.index(marker):] if marker in log else log)
            say(f"attempt {s['attempt']} resumed from the checkpoint of step "
                f"{None if step is None else step - 1}: its first step was {step} "
                f"(log of {pod})")
    return s.get("phase") == "Succeeded" and killed is not None and s.get("attempt", 0) > 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hlat_testbed.demo",
                                description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="hlat-demo")
    p.add_argument("--workdir", default=str(REPO / "runs" / "demo"),
                   help="host directory for the PVC and the operator log (default runs/demo)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the job")
    p.add_argument("--down", action="store_true", help="tear the cluster down at the end")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
