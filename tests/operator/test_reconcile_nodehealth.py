"""Node health beyond Ready: a node its health reporters (or its worker) blame is a node fault.

The job restarts off the node without spending restart budget, the node is avoided, and the
status, the event and the metric name the node and the condition."""

from __future__ import annotations

from typing import Any

import pytest
from opfakes import World, raw_spec

from hlat_api import labels
from hlat_api.env import ExitCode
from hlat_api.labels import Reason
from hlat_operator.faults import classify_failed
from hlat_operator.metrics import OperatorMetrics
from hlat_operator.nodehealth import ACCELERATED_HARDWARE_READY, NEURON_HEALTH, NODE_FAULT_EXIT
from hlat_operator.observe import ObservedPod, node_from_raw


def raw_node(conditions: list[dict[str, str]], node_labels: dict[str, str] | None = None
             ) -> dict[str, Any]:
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
    return {"metadata": {"name": "node-a", "labels": node_labels or {}},
            "status": {"conditions": [ready, *conditions]}}


def cond(kind: str, status: str, reason: str, message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


@pytest.mark.parametrize(("conditions", "node_labels", "blamed"), [
    # the EKS node monitoring agent: False is the problem
    ([cond(ACCELERATED_HARDWARE_READY, "False", "NeuronHBMUncorrectableError")], {},
     "AcceleratedHardwareReady=False (NeuronHBMUncorrectableError)"),
    ([cond(ACCELERATED_HARDWARE_READY, "False", "NeuronDMAError", "Discovered DMA Error")], {},
     "AcceleratedHardwareReady=False (NeuronDMAError: Discovered DMA Error)"),
    ([cond(ACCELERATED_HARDWARE_READY, "True", "AcceleratedHardwareIsReady")], {}, None),
    # a reporter that stopped is no evidence: not every job in the cluster restarts
    ([cond(ACCELERATED_HARDWARE_READY, "Unknown", "")], {}, None),
    # the Neuron node problem detector: a problem condition, True is the problem
    ([cond(NEURON_HEALTH, "True", "NeuronHasError_DMA_ERROR")], {},
     "NeuronHealth=True (NeuronHasError_DMA_ERROR)"),
    ([cond(NEURON_HEALTH, "False", "NeuronHasNoError")], {}, None),
    # SageMaker HyperPod's label
    ([], {labels.NODE_HEALTH_LABEL: "UnschedulablePendingReplacement"},
     f"{labels.NODE_HEALTH_LABEL}=UnschedulablePendingReplacement"),
    ([], {labels.NODE_HEALTH_LABEL: "Schedulable"}, None),
    # another condition type is not ours to judge
    ([cond("KernelReady", "False", "SoftLockup")], {}, None),
])
def test_which_conditions_make_a_node_unhealthy(
        conditions: list[dict[str, str]], node_labels: dict[str, str], blamed: str | None) -> None:
    node = node_from_raw(raw_node(conditions, node_labels))
    assert node.healthy is (blamed is None)
    assert (node.problem.describe() if node.problem else None) == blamed


def running_world(**overrides: Any) -> World:
    w = World(raw_spec(**overrides))
    w.until("Running")
    w.beat(5)
    w.step()
    return w


def set_conditions(w: World, node: str, *conditions: dict[str, str]) -> None:
    raw = raw_node(list(conditions))
    raw["metadata"]["name"] = node
    w.nodes[node] = node_from_raw(raw)


@pytest.mark.parametrize(("condition", "named"), [
    (cond(ACCELERATED_HARDWARE_READY, "False", "NeuronHBMUncorrectableError"),
     "AcceleratedHardwareReady=False (NeuronHBMUncorrectableError)"),
    (cond(NEURON_HEALTH, "True", "NeuronHasError_HBM_UNCORRECTABLE_ERROR"),
     "NeuronHealth=True (NeuronHasError_HBM_UNCORRECTABLE_ERROR)"),
])
def test_a_condition_on_a_workers_node_restarts_the_job_off_it_without_budget(
        condition: dict[str, str], named: str) -> None:
    # no restart budget at all: a node fault must still restart the job
    w = running_world(**{"faultTolerance.maxRestarts": 0})
    node = w.pod_of(1).node
    assert node is not None
    set_conditions(w, node, condition)
    w.step()
    s = w.status
    assert s.phase == "Restarting"
    assert s.last_failure is not None and s.last_failure.reason == Reason.NODE_UNHEALTHY
    assert s.last_failure.node == node and named in s.last_failure.message
    assert s.restarts.total == 1 and s.restarts.counted == 0
    assert node in {e.node for e in s.avoided_nodes}
    event = next(e for e in w.events if e.reason == Reason.NODE_UNHEALTHY)
    assert node in event.message and named in event.message
    w.until("Running")
    assert node not in {p.node for p in w.live()}


def test_a_condition_on_a_node_without_workers_is_no_fault_but_keeps_new_pods_away() -> None:
    w = running_world()
    spare = next(n for n in w.nodes if n not in {p.node for p in w.live()})
    set_conditions(w, spare, cond(ACCELERATED_HARDWARE_READY, "False", "NeuronDMAError"))
    w.step()
    assert w.status.phase == "Running" and w.status.last_failure is None
    w.fail(0, exit_code=137)
    w.step()
    w.until("Running")
    assert spare not in {p.node for p in w.live()}


@pytest.mark.parametrize(("code", "reason", "infra", "permanent"), [
    (ExitCode.NODE_FAULT, Reason.NODE_UNHEALTHY, True, False),
    (ExitCode.CONFIG_ERROR, Reason.CONFIG_ERROR, False, True),
    (1, Reason.POD_FAILED, False, False),
])
def test_the_node_fault_exit_blames_the_node(
        code: int, reason: Reason, infra: bool, permanent: bool) -> None:
    fault = classify_failed(ObservedPod("p", 0, 0, phase="Failed", exit_code=code, node="n",
                                        message="hlat-launch: the node's Neuron driver is 2.26"))
    assert (fault.reason, fault.infrastructure, fault.permanent) == (reason, infra, permanent)
    assert (fault.problem is not None) is (code == ExitCode.NODE_FAULT)
    if fault.problem is not None:
        assert fault.problem.condition == NODE_FAULT_EXIT and "driver is 2.26" in fault.message


def test_a_driver_too_old_exit_avoids_that_node_and_the_job_runs_elsewhere() -> None:
    w = running_world(**{"faultTolerance.maxRestarts": 0})
    node = w.pod_of(0).node
    w.fail(0, exit_code=ExitCode.NODE_FAULT)
    w.step()
    s = w.status
    assert s.phase == "Restarting" and s.restarts.counted == 0
    assert s.last_failure is not None and s.last_failure.exit_code == ExitCode.NODE_FAULT
    assert node in {e.node for e in s.avoided_nodes}
    w.until("Running")
    assert node not in {p.node for p in w.live()}


def test_the_metric_names_the_node_and_the_condition() -> None:
    w = running_world()
    node = w.pod_of(0).node
    assert node is not None
    set_conditions(w, node, cond(ACCELERATED_HARDWARE_READY, "False", "NeuronDMAError"))
    metrics = OperatorMetrics()
    metrics.observe("default", "tiny", w.step())
    sample = metrics.registry.get_sample_value("hlat_job_node_faults_total", {
        "namespace": "default", "pretrainjob": "tiny", "node": node,
        "condition": ACCELERATED_HARDWARE_READY, "condition_reason": "NeuronDMAError"})
    assert sample == 1.0
    metrics.forget("default", "tiny")
    assert metrics.registry.get_sample_value("hlat_job_node_faults_total", {
        "namespace": "default", "pretrainjob": "tiny", "node": node,
        "condition": ACCELERATED_HARDWARE_READY, "condition_reason": "NeuronDMAError"}) is None


def test_an_unknown_condition_does_not_restart_the_job() -> None:
    w = running_world()
    node = w.pod_of(0).node
    assert node is not None
    set_conditions(w, node, cond(ACCELERATED_HARDWARE_READY, "Unknown", "NodeStatusUnknown"))
    w.step()
    assert w.status.phase == "Running"


def test_in_place_the_pod_on_the_blamed_node_goes_and_the_others_stay() -> None:
    """Under InPlace a trainer restarted on the same device would fail again: the pod on the
    node with the condition is deleted (its replacement avoids the node); the healthy pod
    stays, its trainer restarted in place."""
    from hlat_operator.reconcile import DeletePod

    w = running_world(**{"faultTolerance.restartStrategy": "InPlace"})
    bad, good = w.pod_of(1), w.pod_of(0)
    assert bad.node is not None
    set_conditions(w, bad.node, cond(ACCELERATED_HARDWARE_READY, "False", "NeuronDMAError"))
    d = w.step()
    assert [a.name for a in d.actions if isinstance(a, DeletePod)] == [bad.name]
    assert w.status.restarts.counted == 0 and bad.node in {e.node for e in w.status.avoided_nodes}
    w.until("Running")
    assert good.name in w.pods
    assert bad.node not in {p.node for p in w.live()}
