"""Workers as EKS needs them, end to end on the local cluster: the pod template, any job name,
Pod Security admission, placement that recovers, and gang admission with Volcano's real
scheduler.

Same rig as test_e2e_lifecycle (real API server, scheduler, controllers, operator process and
trainers); this module's operator reports unplaceable pods after 4 s instead of 120 s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_env import Env
from e2e_spec import tiny_spec
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed import faults, volcano
from hlat_testbed.cluster import Cluster
from hlat_testbed.testing import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

UNSCHEDULABLE_AFTER = 4
OPERATOR_ENV = {"HLAT_OPERATOR_UNSCHEDULABLE_AFTER_SECONDS": str(UNSCHEDULABLE_AFTER)}
PRIORITY_CLASS = "hlat-e2e-high"


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def _pods_of(env: Env, attempt: int) -> list[Any]:
    return [p for p in env.pods() if p.metadata.labels["hlat.dev/attempt"] == str(attempt)]


# --- the pod template ------------------------------------------------------------------------


@pytest.fixture
def priority_class(cluster: Cluster) -> Iterator[str]:
    api = client.SchedulingV1Api(cluster.admin_api())
    with contextlib.suppress(ApiException):
        api.create_priority_class({"apiVersion": "scheduling.k8s.io/v1",  # type: ignore[arg-type]
                                   "kind": "PriorityClass", "metadata": {"name": PRIORITY_CLASS},
                                   "value": 1000})
    yield PRIORITY_CLASS


def test_the_template_s_account_env_volume_toleration_and_priority_reach_running_workers(
        job_env: Env, priority_class: str) -> None:
    """The workers run as the user's ServiceAccount (IRSA's way in) and still heartbeat:
    the progress in status comes only from their Leases."""
    core = job_env.core
    core.create_namespaced_service_account(job_env.ns, {  # type: ignore[arg-type]
        "metadata": {"name": "trainer-s3",
                     "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}}})
    core.create_namespaced_config_map(job_env.ns, {  # type: ignore[arg-type]
        "metadata": {"name": "extra"}, "data": {"team.txt": "research"}})
    spec = tiny_spec(steps=4)
    spec["template"] = {
        "metadata": {"labels": {"team": "research"}, "annotations": {"owner": "ml-platform"}},
        "spec": {
            "serviceAccountName": "trainer-s3",
            "priorityClassName": priority_class,
            "tolerations": [{"key": "example.com/spot", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "volumes": [{"name": "extra", "configMap": {"name": "extra"}}],
            "containers": [{
                "name": "trainer",
                "env": [{"name": "TEAM", "value": "research"}],
                "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra"}],
            }],
        },
    }
    job_env.create(spec)
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    assert done["progress"]["step"] == 4  # heartbeats renewed as trainer-s3
    pod = _pods_of(job_env, 0)[0]
    assert pod.spec.service_account_name == "trainer-s3"
    assert pod.spec.priority_class_name == priority_class and pod.spec.priority == 1000
    assert any(t.key == "example.com/spot" for t in pod.spec.tolerations)
    assert "extra" in {v.name for v in pod.spec.volumes}
    (trainer,) = pod.spec.containers
    assert {"name": "TEAM", "value": "research"} in [
        {"name": e.name, "value": e.value} for e in trainer.env]
    assert "/etc/extra" in {m.mount_path for m in trainer.volume_mounts}
    assert trainer.command[0].endswith("hlat-launch")  # the operator's entrypoint
    assert pod.metadata.labels["team"] == "research"
    assert pod.metadata.labels["hlat.dev/job"] == job_env.name
    assert pod.metadata.annotations["owner"] == "ml-platform"


def test_a_dotted_job_name_runs(job_env: Env) -> None:
    """`llama-3.1-tiny` is a valid object name but not a valid Service name or hostname."""
    env = job_env.other("llama-3.1-tiny")
    env.create(tiny_spec(steps=4))
    done = env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    assert done["progress"]["step"] == 4
    services = [s.metadata.name for s in env.core.list_namespaced_service(env.ns).items]
    assert len(services) == 1 and services[0].startswith("llama-3-1-tiny-"), services
    env.delete()


# --- Pod Security ----------------------------------------------------------------------------


def _trn1_spec(**template: Any) -> dict[str, Any]:
    spec = tiny_spec(steps=4)
    spec.update(instanceType="trn1.32xlarge", nodes=1)
    if template:
        spec["template"] = template
    return spec


def test_workers_pass_pod_security_baseline(job_env: Env) -> None:
    """A namespace enforcing `baseline`: the CPU job runs; a Trainium job's pods are admitted
    once its compile cache is not a hostPath (and are Guaranteed QoS); with the default
    hostPath cache the job ends Failed with the admission's reason, it does not hang."""
    job_env.core.patch_namespace(job_env.ns, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "baseline"}}})
    job_env.create(tiny_spec(steps=4))
    assert job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)

    cached = job_env.other("trn-emptydir")
    cached.create(_trn1_spec(spec={"volumes": [{"name": "neuron-cache", "emptyDir": {}}]}))
    pods = cached.wait_pods(1, 60)
    assert pods[0].status.qos_class == "Guaranteed"
    resources = pods[0].spec.containers[0].resources
    assert resources.requests == resources.limits
    assert resources.requests["aws.amazon.com/neuron"] == "16"
    cached.delete()

    hostpath = job_env.other("trn-hostpath")
    hostpath.create(_trn1_spec())
    failed = hostpath.wait("Failed", lambda s: s.get("phase") == "Failed", 60)
    condition = _condition(failed, "Failed")
    assert condition["reason"] == "Rejected"
    assert "PodSecurity" in condition["message"] and "hostPath" in condition["message"]
    assert not hostpath.pods()


# --- placement -------------------------------------------------------------------------------


def test_an_unplaceable_job_says_so_with_the_scheduler_s_message(job_env: Env) -> None:
    spec = tiny_spec(steps=4)
    spec["template"] = {"spec": {"nodeSelector": {"example.com/pool": "nowhere"}}}
    job_env.create(spec)
    created = time.monotonic()
    status = job_env.wait("Schedulable=False",
                          lambda s: _condition(s, "Schedulable").get("status") == "False", 30)
    waited = time.monotonic() - created
    assert waited >= UNSCHEDULABLE_AFTER - 1
    message = _condition(status, "Schedulable")["message"]
    assert "2 of 2 worker pods cannot be placed" in message
    assert "node affinity/selector" in message, message  # the scheduler's own words
    assert status["phase"] == "Pending"
    assert ("Unschedulable", message) in job_env.event_messages() or any(
        r == "Unschedulable" for r, _ in job_env.event_messages())


def test_two_failed_nodes_do_not_keep_the_job_off_a_pool_that_has_recovered(
        job_env: Env) -> None:
    """Two of three nodes fail one after the other; the job needs two. The first failed node is
    let back (least recently failed) so the gang runs again, and status lists what is avoided."""
    job_env.create(tiny_spec(steps=400))
    down: list[str] = []
    try:
        for attempt in (0, 1):
            job_env.wait(f"attempt {attempt} training", lambda s, a=attempt: s.get("attempt") == a
                         and s.get("phase") == "Running"
                         and s.get("progress", {}).get("step", 0) >= 1, 180)
            node = next(p.spec.node_name for p in _pods_of(job_env, attempt)
                        if p.spec.node_name not in down)
            faults.node_down(job_env.cluster.config, node)
            down.append(node)
            job_env.wait(f"restart {attempt + 1}",
                         lambda s, a=attempt: s.get("attempt", 0) > a, 120)
            if attempt == 0:  # the first node comes back before the second fails
                faults.node_up(job_env.cluster.config, node)
                job_env.cluster.wait_nodes_ready([node], timeout=60)
        status = job_env.wait("attempt 2 running", lambda s: s.get("attempt") == 2
                              and s.get("phase") == "Running", 120)
        assert [a["node"] for a in status["avoidedNodes"]] == down
        placed = {p.spec.node_name for p in _pods_of(job_env, 2)}
        assert down[1] not in placed and down[0] in placed  # the pool is 2 without the last
    finally:
        for node in down:
            faults.node_up(job_env.cluster.config, node)
        job_env.cluster.wait_nodes_ready(down, timeout=60)


# --- gang admission --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def volcano_scheduler(cluster: Cluster) -> Iterator[None]:
    volcano.start(cluster)
    yield
    volcano.stop(cluster)


def _gang_spec(steps: int, **fault_tolerance: Any) -> dict[str, Any]:
    spec = tiny_spec(steps=steps, **fault_tolerance)
    spec["scheduling"] = {"schedulerName": "volcano"}
    # one worker per node: 100 of a node's 128 CPUs (what stands in for a Trainium node's
    # accelerators, which a cpu job does not request)
    size = {"cpu": "100", "memory": "6Gi"}
    spec["template"] = {"spec": {"containers": [
        {"name": "trainer", "resources": {"requests": size, "limits": size}}]}}
    return spec


def test_volcano_admits_a_gang_whole_or_not_at_all(job_env: Env, volcano_scheduler: None
                                                   ) -> None:
    """Two two-node jobs on three nodes: one runs; the other gets no node at all (not one of
    two, which would hold a node while waiting) until the first finishes, then runs."""
    first, second = job_env.other("gang-a"), job_env.other("gang-b")
    first.create(_gang_spec(steps=30))
    first.wait("gang-a running", lambda s: s.get("phase") == "Running", 120)
    second.create(_gang_spec(steps=4))
    group = wait_for(lambda: volcano.pod_group(job_env.cluster.admin_api(), job_env.ns,
                                               "gang-b"), 30, "gang-b's PodGroup")
    assert group["spec"]["minMember"] == 2 and group["spec"]["queue"] == "default"
    waiting = second.wait("gang-b Schedulable=False",
                          lambda s: _condition(s, "Schedulable").get("status") == "False", 60)
    assert waiting["phase"] == "Pending"
    # While both of gang-a's workers hold their nodes, gang-b holds none. Once one has exited
    # (its rank finishes a moment before the other), two nodes are free and Volcano may place
    # gang-b before gang-a's last worker is done or the operator has marked it Succeeded.
    # gang-b is read first: gang-a's pods still live after it were live when it was read.
    while True:
        placed = [p.metadata.name for p in second.pods() if p.spec.node_name]
        live = [p for p in first.pods() if p.status.phase in ("Pending", "Running")]
        if len(live) < 2:
            break
        assert not placed, "a pod of the waiting gang was placed while gang-a held its nodes"
        time.sleep(0.5)
    first.wait("gang-a Succeeded", lambda s: s.get("phase") == "Succeeded", 60)
    done = second.wait("gang-b Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    assert done["progress"]["step"] == 4
    assert _condition(done, "Schedulable")["status"] == "True"
    first.delete()
    second.delete()


def test_with_volcano_a_spare_never_takes_the_node_a_rank_needs(job_env: Env,
                                                                 volcano_scheduler: None) -> None:
    """Two ranks and a spare, one worker per node, with only two nodes schedulable: both ranks
    run and the spare waits, unplaced (it asks for a node only once every rank has one); once
    the third node is back the spare runs there, warm, and the job ends with it stopped."""
    core = client.CoreV1Api(job_env.cluster.admin_api())
    third = sorted(n.metadata.name for n in core.list_node().items)[-1]
    core.patch_node(third, {"spec": {"unschedulable": True}})
    try:
        job_env.create(_gang_spec(steps=300, restartStrategy="InPlace", spareNodes=1))
        job_env.wait("both ranks running", lambda s: s.get("phase") == "Running", 120)
        spare = f"{job_env.name}-s0"
        wait_for(lambda: spare in {p.metadata.name for p in job_env.pods()}, 30, "the spare")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the ranks keep their nodes; the spare gets none
            pods = {p.metadata.name: p for p in job_env.pods()}
            assert pods[spare].spec.node_name is None, "the spare was placed on a rank's node"
            assert all(p.status.phase == "Running" for n, p in pods.items() if n != spare)
            time.sleep(0.5)
    finally:
        core.patch_node(third, {"spec": {"unschedulable": False}})
    ready = job_env.wait("the spare ready",
                         lambda s: (s.get("spares") or {}).get("ready") == 1, 90)
    assert ready["phase"] == "Running" and ready["restarts"]["total"] == 0
    placed = core.read_namespaced_pod(f"{job_env.name}-s0", job_env.ns)
    assert placed.spec.node_name == third
    job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
