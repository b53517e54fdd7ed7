"""Jobs on nodes modelled as Karpenter and SageMaker HyperPod make them (hlat_testbed.eksnodes):
AWS's published allocatable, labels and taints, with the scheduler, operator and trainers real.

The module adds four one-node pools to the session's cluster (removed at its end): a Karpenter
NodePool of trn1.32xlarge and one of trn2.48xlarge (481,894Mi / 1,938,410Mi allocatable, the
`aws.amazon.com/neuron` taint), an EKS Auto Mode NodePool of trn1.32xlarge (Karpenter's figures,
Auto Mode's labels) and a HyperPod instance group of trn1.32xlarge (labelled
`ml.trn1.32xlarge`). The session's own nodes are a managed node group's: every provisioner runs
a job. The jobs ask for the real instance types, so their pods carry the real
requests (Neuron devices, EFA, cpu, memory), selectors and tolerations; the rig has no Trainium,
so this module's operator starts the launcher with `-- --set instanceType=cpu` and the trainer
runs the CPU backend inside those pods (the launcher itself still takes the Neuron path).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from e2e_env import Env
from e2e_spec import tiny_spec

from hlat_testbed import demo
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import OperatorProcess
from hlat_testbed.testing import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FIRST_INDEX = 40  # pod ranges 10.x.41.0/24..: clear of the session's node-<i>


@pytest.fixture(scope="module")
def pools(cluster: Cluster) -> Iterator[dict[str, str]]:
    """Pool name -> its node."""
    made: dict[str, str] = {}
    try:
        for i, (pool, instance, provisioner) in enumerate([
                ("karp-trn1", "trn1.32xlarge", "karpenter"),
                ("karp-trn2", "trn2.48xlarge", "karpenter"),
                ("hp-trn1", "trn1.32xlarge", "hyperpod"),
                ("auto-trn1", "trn1.32xlarge", "auto")]):
            (made[pool],) = cluster.add_node_pool(pool, 1, instance, provisioner,  # type: ignore[arg-type]
                                                  FIRST_INDEX + i)
        yield made
    finally:
        cluster.remove_nodes(list(made.values()))


@pytest.fixture(scope="module")
def operator(cluster: Cluster, crd: None, pools: dict[str, str],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, OperatorProcess]]:
    """The module's operator, its trainer command ending in `-- --set instanceType=cpu`."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    launch = f"{demo.venv_bin('hlat-launch')} -- --set instanceType=cpu"
    with mock.patch.object(demo, "venv_bin", lambda _name: launch):
        op = OperatorProcess(cluster, log, ["test-*"]).start()
    yield {"op": op}
    op.stop()
    print(f"operator log: {log}")


def _spec(instance: str, pool_selector: dict[str, str], **template: Any) -> dict[str, Any]:
    spec = tiny_spec(steps=4)
    spec.update(instanceType=instance, nodes=1)
    spec["scheduling"] = {"nodeSelector": pool_selector}
    # a node-local compile cache the rig needs no hostPath for
    pod: dict[str, Any] = {"volumes": [{"name": "neuron-cache", "emptyDir": {}}], **template}
    spec["template"] = {"spec": pod}
    return spec


def _trains_on(env: Env, node: str) -> Any:
    done = env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    assert done["progress"]["step"] == 4
    (pod,) = [p for p in env.pods() if p.metadata.labels["hlat.dev/attempt"] == "0"]
    assert pod.spec.node_name == node
    return pod


def test_trn1_on_karpenter_nodes_old_requests_stay_pending_new_ones_train(
        job_env: Env, pools: dict[str, str]) -> None:
    """480Gi (the old request) is above Karpenter's 481,894Mi trn1.32xlarge: the scheduler
    cannot place it (Karpenter would launch nothing); the default request (440Gi) trains."""
    selector = {"karpenter.sh/nodepool": "karp-trn1"}
    old = job_env.other("old-requests")
    sized = {"requests": {"cpu": "120", "memory": "480Gi"},
             "limits": {"cpu": "120", "memory": "480Gi"}}
    old.create(_spec("trn1.32xlarge", selector,
                     containers=[{"name": "trainer", "resources": sized}]))

    def unschedulable() -> str:
        for pod in old.pods():
            for cond in pod.status.conditions or []:
                if cond.type == "PodScheduled" and cond.reason == "Unschedulable":
                    return str(cond.message)
        return ""

    message = wait_for(unschedulable, 60, "the 480Gi worker reported Unschedulable")
    assert "Insufficient memory" in message, message
    old.delete()
    wait_for(lambda: not old.pods(), 60, "the old job's pods gone")

    job_env.create(_spec("trn1.32xlarge", selector))
    pod = _trains_on(job_env, pools["karp-trn1"])
    resources = pod.spec.containers[0].resources
    assert resources.requests == resources.limits and resources.requests["memory"] == "440Gi"
    assert pod.status.qos_class == "Guaranteed"
    assert any(t.key == "aws.amazon.com/neuron" for t in pod.spec.tolerations)


def test_trn2_on_a_karpenter_node_trains(job_env: Env, pools: dict[str, str]) -> None:
    job_env.create(_spec("trn2.48xlarge", {"karpenter.sh/nodepool": "karp-trn2"}))
    pod = _trains_on(job_env, pools["karp-trn2"])
    assert pod.spec.containers[0].resources.requests["memory"] == "1850Gi"


def test_an_ml_instance_type_runs_on_the_hyperpod_pool(job_env: Env,
                                                       pools: dict[str, str]) -> None:
    """No pool selector: `ml.trn1.32xlarge` alone selects HyperPod's node (the session's
    managed trn1.32xlarge nodes do not carry the `ml.` name)."""
    spec = _spec("ml.trn1.32xlarge", {})
    del spec["scheduling"]
    job_env.create(spec)
    pod = _trains_on(job_env, pools["hp-trn1"])
    assert pod.spec.node_selector["node.kubernetes.io/instance-type"] == "ml.trn1.32xlarge"


def test_trn1_on_an_auto_mode_pool_trains(job_env: Env, pools: dict[str, str]) -> None:
    """Selected the way AWS's docs select Auto Mode nodes in a mixed cluster
    (`eks.amazonaws.com/compute-type: auto`): the default request fits Auto Mode's Karpenter."""
    job_env.create(_spec("trn1.32xlarge", {"eks.amazonaws.com/compute-type": "auto"}))
    pod = _trains_on(job_env, pools["auto-trn1"])
    assert pod.spec.containers[0].resources.requests["memory"] == "440Gi"
