"""The process kubelet runs pods faithfully: status, exit codes, env, volumes, deletion, faults."""

from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kubernetes import client

from hlat_testbed import cgroups, faults
from hlat_testbed.cluster import Cluster
from hlat_testbed.procs import is_alive
from hlat_testbed.testing import (
    python_pod,
    read_pod,
    terminated,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
    wait_pod_running,
)

pytestmark = pytest.mark.cluster

TERMINAL = {"Succeeded", "Failed"}


def test_pod_runs_to_completion_with_its_exit_code(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, python_pod("ok", "print('hello from a pod')"))  # type: ignore[arg-type]
    core.create_namespaced_pod(namespace, python_pod("bad", "import sys; sys.exit(3)"))  # type: ignore[arg-type]
    ok = wait_pod_phase(core, namespace, "ok", TERMINAL)
    bad = wait_pod_phase(core, namespace, "bad", TERMINAL)
    assert ok.status.phase == "Succeeded"
    assert (terminated(ok).exit_code, terminated(ok).reason) == (0, "Completed")
    assert bad.status.phase == "Failed"
    assert (terminated(bad).exit_code, terminated(bad).reason) == (3, "Error")
    assert "hello from a pod" in cluster.pod_log(namespace, "ok")


def test_running_pod_has_an_ip_on_the_pod_network_and_is_ready(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, python_pod("sleeper", "import time; time.sleep(600)"))  # type: ignore[arg-type]
    pod = wait_pod_running(core, namespace, "sleeper")
    assert ipaddress.ip_address(pod.status.pod_ip) in cluster.config.network
    assert pod.status.container_statuses[0].state.running is not None
    assert pod.status.host_ip == cluster.config.host_ip


def test_sigkilled_pod_shows_failed_137(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, python_pod("victim", "import time; time.sleep(600)"))  # type: ignore[arg-type]
    wait_pod_running(core, namespace, "victim")
    faults.kill(cluster.config, namespace, "victim", signal.SIGKILL)
    pod = wait_pod_phase(core, namespace, "victim", TERMINAL)
    assert pod.status.phase == "Failed"
    assert terminated(pod).exit_code == 137


GREEDY = """
from hlat_trainer import oom
group = oom.memory_cgroup()  # the container's own, as /proc and its mounts show it
names = [n for n in ("memory.max", "memory.limit_in_bytes") if (group / n).exists()]
print("limit seen", (group / names[0]).read_text().strip(), "in", group)
hoard = []
for _ in range(64):
    hoard.append(bytearray(16 << 20))  # zero-filled: every page touched
print("holding", 16 * len(hoard), "MiB")
"""


def test_a_container_over_its_memory_limit_is_oomkilled(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    """The kernel holds a container to `resources.limits.memory` (its memory cgroup), as a
    runtime does: 1 GiB wanted under a 128Mi limit is OOM-killed and reported so; under a
    limit above it, it runs to its end, and it sees its own memory cgroup, with that limit, at
    /sys/fs/cgroup (mounted read-only, as under a runtime)."""
    if not cgroups.can_limit_memory():
        pytest.skip("no writable memory cgroup on this machine: limits are not enforced")

    def sized(limit: str) -> dict[str, object]:
        return {"container": {"resources": {"limits": {"memory": limit}}}}

    core.create_namespaced_pod(namespace, python_pod("over", GREEDY, **sized("128Mi")))  # type: ignore[arg-type]
    core.create_namespaced_pod(namespace, python_pod("under", GREEDY, **sized("2Gi")))  # type: ignore[arg-type]
    over = wait_pod_phase(core, namespace, "over", TERMINAL)
    under = wait_pod_phase(core, namespace, "under", TERMINAL)
    assert over.status.phase == "Failed"
    assert (terminated(over).exit_code, terminated(over).reason) == (137, "OOMKilled")
    assert under.status.phase == "Succeeded"
    log = cluster.pod_log(namespace, "under")
    assert "holding 1024 MiB" in log
    assert f"limit seen {2 << 30} in /sys/fs/cgroup/" in log, log


def test_cli_fault_kill_with_a_signal(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, python_pod("victim", "import time; time.sleep(600)"))  # type: ignore[arg-type]
    wait_pod_running(core, namespace, "victim")
    subprocess.run([sys.executable, "-m", "hlat_testbed.cli", "fault", "kill", "victim", "-n",
                    namespace, "--signal", "SIGTERM"], check=True, env=_cli_env(cluster))
    pod = wait_pod_phase(core, namespace, "victim", TERMINAL)
    assert terminated(pod).exit_code == 128 + signal.SIGTERM


def _cli_env(cluster: Cluster) -> dict[str, str]:
    import os
    return {**os.environ, "HLAT_CLUSTER_DIR": str(cluster.config.state)}


COUNTER = """
import time, itertools
for i in itertools.count():
    print(i, flush=True)
    time.sleep(0.1)
"""


def _last_count(cluster: Cluster, namespace: str) -> int:
    lines = cluster.pod_log(namespace, "counter").split()
    return int(lines[-1]) if lines else -1


def test_hung_pod_makes_no_progress_until_resumed(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, python_pod("counter", COUNTER))  # type: ignore[arg-type]
    wait_pod_running(core, namespace, "counter")
    wait_for(lambda: _last_count(cluster, namespace) > 3, 20, "the counter to count")
    faults.hang(cluster.config, namespace, "counter")
    time.sleep(0.5)
    frozen = _last_count(cluster, namespace)
    time.sleep(1.5)
    assert _last_count(cluster, namespace) == frozen
    assert read_pod(core, namespace, "counter").status.phase == "Running"
    faults.resume(cluster.config, namespace, "counter")
    wait_for(lambda: _last_count(cluster, namespace) > frozen + 3, 20, "counting to resume")


GRACEFUL = """
import signal, sys, time
def bye(*_):
    print("got SIGTERM, saving", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
time.sleep(600)
"""

STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_deletion_sends_sigterm_then_sigkill_after_the_grace_period(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, python_pod("graceful", GRACEFUL))  # type: ignore[arg-type]
    core.create_namespaced_pod(namespace, python_pod("stubborn", STUBBORN,  # type: ignore[arg-type]
                                                     terminationGracePeriodSeconds=3))
    for name in ("graceful", "stubborn"):
        wait_pod_running(core, namespace, name)
        wait_for(lambda n=name: "ready" in cluster.pod_log(namespace, n), 20, f"{name} ready")
    started = time.monotonic()
    core.delete_namespaced_pod("graceful", namespace)
    core.delete_namespaced_pod("stubborn", namespace)
    wait_pod_gone(core, namespace, "graceful", timeout=20)
    assert "got SIGTERM, saving" in cluster.pod_log(namespace, "graceful")
    wait_pod_gone(core, namespace, "stubborn", timeout=20)
    assert time.monotonic() - started >= 2.5  # it was given its grace period
    assert "ignoring SIGTERM" in cluster.pod_log(namespace, "stubborn")


ENV_AND_VOLUMES = """
import os, socket
from pathlib import Path
for key in ("POD_NAME", "POD_NAMESPACE", "POD_IP", "NODE_NAME", "FROM_CM", "FROM_SECRET",
            "GREETING", "CM_key"):
    print(f"{key}={os.environ.get(key)}")
print("hostname=" + socket.gethostname())
print("cm-file=" + Path("/run/hlat-test/cm/key").read_text())
print("secret-file=" + Path("/run/hlat-test/secret/password").read_text())
Path("/run/hlat-test/scratch/x").write_text("scratch ok")
print("scratch=" + Path("/run/hlat-test/scratch/x").read_text())
Path("/run/hlat-test/fsx/from-" + os.environ["POD_NAME"]).write_text("shared")
print("shared=" + ",".join(sorted(os.listdir("/run/hlat-test/fsx"))))
"""


def test_env_and_volumes_reach_the_process(
        cluster: Cluster, core: client.CoreV1Api, namespace: str, tmp_path: Path) -> None:
    core.create_namespaced_config_map(namespace, {  # type: ignore[arg-type]
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
        "data": {"key": "cm-value"}})
    core.create_namespaced_secret(namespace, {  # type: ignore[arg-type]
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
        "stringData": {"password": "s3cret"}})
    shared = tmp_path / "fsx"
    cluster.create_shared_volume(namespace, "fsx", shared)
    # it returns with the claim Bound: a pod created now is not rejected for an unbound claim
    assert core.read_namespaced_persistent_volume_claim("fsx", namespace).status.phase == "Bound"

    def field(path: str) -> dict[str, object]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [{"name": "POD_NAME", **field("metadata.name")},
           {"name": "POD_NAMESPACE", **field("metadata.namespace")},
           {"name": "POD_IP", **field("status.podIP")},
           {"name": "NODE_NAME", **field("spec.nodeName")},
           {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "key"}}},
           {"name": "FROM_SECRET",
            "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
           {"name": "GREETING", "value": "hi $(POD_NAME)"}]
    mounts = [{"name": "cm", "mountPath": "/run/hlat-test/cm"},
              {"name": "secret", "mountPath": "/run/hlat-test/secret", "readOnly": True},
              {"name": "scratch", "mountPath": "/run/hlat-test/scratch"},
              {"name": "fsx", "mountPath": "/run/hlat-test/fsx"}]
    volumes = [{"name": "cm", "configMap": {"name": "cfg"}},
               {"name": "secret", "secret": {"secretName": "creds"}},
               {"name": "scratch", "emptyDir": {"medium": "Memory"}},
               {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx"}}]
    pod = python_pod("envvol", ENV_AND_VOLUMES, hostname="worker-0", volumes=volumes,
                     container={"env": env, "volumeMounts": mounts,
                                "envFrom": [{"configMapRef": {"name": "cfg"},
                                             "prefix": "CM_"}]})
    core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    done = wait_pod_phase(core, namespace, "envvol", TERMINAL)
    log = cluster.pod_log(namespace, "envvol")
    assert done.status.phase == "Succeeded", log
    for line in ("POD_NAME=envvol", f"POD_NAMESPACE={namespace}",
                 f"POD_IP={done.status.pod_ip}", f"NODE_NAME={done.spec.node_name}",
                 "FROM_CM=cm-value", "FROM_SECRET=s3cret", "GREETING=hi envvol",
                 "CM_key=cm-value", "hostname=worker-0", "cm-file=cm-value",
                 "secret-file=s3cret", "scratch=scratch ok", "shared=from-envvol"):
        assert line in log.splitlines(), log
    assert (shared / "from-envvol").read_text() == "shared"


DETACHING = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          start_new_session=True)  # as torchrun starts its workers
print(f"worker {worker.pid}", flush=True)
if os.environ.get("LINGER"):
    time.sleep(600)
sys.exit(1)
"""


def _worker_pid(cluster: Cluster, namespace: str, pod: str) -> int:
    wait_for(lambda: "worker " in cluster.pod_log(namespace, pod), 20, f"{pod}'s worker")
    return int(cluster.pod_log(namespace, pod).split("worker ")[1].split()[0])


def test_processes_a_container_started_in_other_sessions_die_with_it(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    """A worker in its own session outlives neither its container's exit nor its pod's
    deletion: left behind it would hold its ports and block in collectives."""
    core.create_namespaced_pod(namespace, python_pod("exits", DETACHING))  # type: ignore[arg-type]
    core.create_namespaced_pod(namespace, python_pod(  # type: ignore[arg-type]
        "deleted", DETACHING, container={"env": [{"name": "LINGER", "value": "1"}]}))
    assert wait_pod_phase(core, namespace, "exits", TERMINAL).status.phase == "Failed"
    orphan = _worker_pid(cluster, namespace, "exits")
    wait_pod_running(core, namespace, "deleted")
    deleted = _worker_pid(cluster, namespace, "deleted")
    wait_for(lambda: not is_alive(orphan), 15, "the exited container's worker to die")
    assert is_alive(deleted)
    core.delete_namespaced_pod("deleted", namespace)
    wait_pod_gone(core, namespace, "deleted", timeout=30)
    assert not is_alive(deleted)


REPORT = """
import json, pathlib
pathlib.Path("/run/hlat-test/out/result.json").write_text(json.dumps({"loss": 1.25, "step": 40}))
"""

CRASH = """
import pathlib, sys
for i in range(100):
    print(f"line {i}")
if len(sys.argv) > 1:
    pathlib.Path("/dev/termination-log").write_text(sys.argv[1])
sys.exit(3)
"""


def test_termination_message_is_its_file_or_else_its_log_tail(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    """state.terminated.message, as the kubelet makes it: what the container wrote at its
    terminationMessagePath; with FallbackToLogsOnError, a failed container that wrote nothing
    there gets the last 80 lines of its log instead."""
    fallback = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    core.create_namespaced_pod(namespace, python_pod(  # type: ignore[arg-type]
        "report", REPORT, container={"terminationMessagePath": "/run/hlat-test/out/result.json"}))
    core.create_namespaced_pod(namespace, python_pod("crash", CRASH, container=fallback))  # type: ignore[arg-type]
    core.create_namespaced_pod(namespace, python_pod(  # type: ignore[arg-type]
        "said", CRASH, container={**fallback, "args": ["disk full"]}))
    report = wait_pod_phase(core, namespace, "report", TERMINAL)
    crash = wait_pod_phase(core, namespace, "crash", TERMINAL)
    said = wait_pod_phase(core, namespace, "said", TERMINAL)
    assert report.status.phase == "Succeeded", cluster.pod_log(namespace, "report")
    assert json.loads(terminated(report).message) == {"loss": 1.25, "step": 40}
    assert (crash.status.phase, terminated(crash).exit_code) == ("Failed", 3)
    assert terminated(crash).message.splitlines() == [f"line {i}" for i in range(20, 100)]
    assert terminated(said).message == "disk full"  # the file, at the default path, wins


SIDECAR = """
import os, pathlib, sys, time
shared = pathlib.Path("/run/hlat-test/shared")
run = len(list(shared.glob("sidecar-*")))
(shared / f"sidecar-{run}").write_text(str(os.getpid()))
print(f"sidecar run {run}", flush=True)
if run == 0:
    sys.exit(1)  # restarted all the same, though the pod's restartPolicy is Never
time.sleep(600)
"""

SETUP = """
import pathlib, time
shared = pathlib.Path("/run/hlat-test/shared")
deadline = time.monotonic() + 30
while not (shared / "sidecar-1").exists():
    assert time.monotonic() < deadline, "the sidecar did not run again"
    time.sleep(0.1)
(shared / "setup-done").write_text("")
"""

BESIDE_SIDECAR = """
import os, pathlib, time
shared = pathlib.Path("/run/hlat-test/shared")
assert (shared / "setup-done").exists()
os.kill(int((shared / "sidecar-1").read_text()), 0)  # raises if the sidecar is not running
print("main: the sidecar runs beside me", flush=True)
time.sleep(3)
"""


def test_a_sidecar_runs_beside_the_containers_and_is_stopped_after_them(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    """A native sidecar (an init container with restartPolicy Always): the next init container
    starts once it has started, it is restarted when it exits, the containers run beside it,
    and once they are done it is stopped (SIGTERM) and the pod's phase is theirs alone."""
    shared = {"name": "shared", "mountPath": "/run/hlat-test/shared"}

    def init(name: str, script: str, **extra: object) -> dict[str, object]:
        return {"name": name, "image": "host", "volumeMounts": [shared], **extra,
                "command": [sys.executable, "-u", "-c", textwrap.dedent(script)]}

    core.create_namespaced_pod(namespace, python_pod(  # type: ignore[arg-type]
        "sidecar", BESIDE_SIDECAR, container={"volumeMounts": [shared]},
        volumes=[{"name": "shared", "emptyDir": {}}],
        initContainers=[init("proxy", SIDECAR, restartPolicy="Always"), init("setup", SETUP)]))
    running = wait_pod_running(core, namespace, "sidecar")
    proxy, setup = running.status.init_container_statuses
    assert proxy.state.running is not None and proxy.ready and proxy.started
    assert proxy.restart_count == 1
    assert (setup.state.terminated.exit_code, setup.ready) == (0, False)
    assert {c.type: c.status for c in running.status.conditions}["Initialized"] == "True"
    done = wait_pod_phase(core, namespace, "sidecar", TERMINAL, timeout=30)
    log = cluster.pod_log(namespace, "sidecar")
    assert done.status.phase == "Succeeded", log
    assert "main: the sidecar runs beside me" in log
    stopped = done.status.init_container_statuses[0].state.terminated
    assert stopped.exit_code == 128 + signal.SIGTERM, log  # its own exit code does not count
