"""Node health beyond Ready, end to end: a node its health reporter or its own worker blames.

Real operator, real trainers, the rig's process kubelets. What must hold: the job restarts off
that node within the detection bound (the operator's resync) without spending restart budget,
the node is avoided, the status and an event name the node and the condition, and the job
trains on elsewhere.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from e2e_env import Env
from e2e_spec import tiny_spec
from kubernetes import client

from hlat_testbed import faults
from hlat_testbed.demo import RIG_OPERATOR_ENV
from hlat_testbed.kubelet import STATUS_PERIOD_S

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RESYNC_SECONDS = float(RIG_OPERATOR_ENV["HLAT_OPERATOR_RESYNC_SECONDS"])
DETECTION_BOUND = RESYNC_SECONDS + 8.0
"""The operator re-reads every live job at least once per resync (nodes from its watch): the
bound, plus slack for two shared cores running the trainers."""
CONDITION = "AcceleratedHardwareReady"


def _pods_of(env: Env, attempt: int) -> list[Any]:
    return [p for p in env.pods() if p.metadata.labels.get("hlat.dev/attempt") == str(attempt)]


def _condition(env: Env, node: str, kind: str) -> dict[str, Any] | None:
    raw = client.CoreV1Api(env.cluster.admin_api()).read_node(node).to_dict()
    return next((c for c in raw["status"]["conditions"] or [] if c["type"] == kind), None)


def test_accelerated_hardware_not_ready_moves_the_job_off_its_node(job_env: Env) -> None:
    """The EKS node monitoring agent's `AcceleratedHardwareReady=False` (reason
    NeuronHBMUncorrectableError) set on the node of a training worker, as the agent sets it (a
    status condition, `hlat-cluster fault condition`)."""
    job_env.create(tiny_spec(steps=400))
    job_env.wait("training", lambda s: s.get("phase") == "Running"
                 and s.get("progress", {}).get("step", 0) >= 1, 180)
    node = _pods_of(job_env, 0)[1].spec.node_name
    api = job_env.cluster.admin_api()
    try:
        set_at = time.monotonic()
        faults.set_node_condition(api, node, CONDITION, "False", "NeuronHBMUncorrectableError",
                                  "Discovered HBM Uncorrectable Error")
        status = job_env.wait("the node fault", lambda s: (s.get("lastFailure") or {}).get(
            "reason") == "NodeUnhealthy", 60)
        detected = time.monotonic() - set_at
        print(f"AcceleratedHardwareReady=False detected in {detected:.1f}s "
              f"(bound {DETECTION_BOUND:.0f}s)")
        assert detected <= DETECTION_BOUND
        failure = status["lastFailure"]
        assert failure["node"] == node
        assert "AcceleratedHardwareReady=False (NeuronHBMUncorrectableError" in failure["message"]
        status = job_env.wait("attempt 1 training", lambda s: s.get("attempt") == 1
                              and s.get("phase") == "Running"
                              and s.get("progress", {}).get("step", 0) >= 1, 180)
        assert status["restarts"]["counted"] == 0 and status["restarts"]["total"] == 1
        assert node in [a["node"] for a in status["avoidedNodes"]]
        assert node not in {p.spec.node_name for p in _pods_of(job_env, 1)}
        named = [m for r, m in job_env.event_messages() if r == "NodeUnhealthy"]
        assert any(node in m and f"{CONDITION}=False" in m for m in named), named
        # the rig's kubelet patches its own conditions every STATUS_PERIOD_S: it must not
        # have wiped the one it does not own (it merges by type, as a real kubelet does)
        time.sleep(max(0.0, set_at + STATUS_PERIOD_S + 2 - time.monotonic()))
        kept = _condition(job_env, node, CONDITION)
        assert kept is not None and kept["status"] == "False", kept
    finally:  # the cluster outlives this test: the node is healthy again for the next one
        faults.set_node_condition(api, node, CONDITION, "True", "AcceleratedHardwareIsReady")


def test_a_node_whose_neuron_driver_is_too_old_is_avoided(job_env: Env, tmp_path: Path) -> None:
    """The launcher's real driver check refuses one node (exit 4, ExitCode.NODE_FAULT): that
    node is avoided and the job runs elsewhere, not failed as a configuration error.

    How the check fires on one node only with the rig's CPU backend: the pod template sets
    `HLAT_NEURON_DRIVER_FILE=<dir>/$(HLAT_NODE_NAME)/version` (the launcher checks a driver
    file the pod names whatever the backend; `$(HLAT_NODE_NAME)` is expanded from the
    operator's downward-API variable, as a kubelet does), and `<dir>/<node>/version` holds a
    too-old `2.20.0.0` for one node and a current `2.30.0.0` for the others: the per-node
    stand-in for `/sys/module/neuron/version`. A preferred node affinity for the stale node
    makes the first attempt use it."""
    nodes = job_env.cluster.nodes()
    stale = nodes[0]
    drivers = tmp_path / "drivers"
    for node in nodes:
        (drivers / node).mkdir(parents=True)
        (drivers / node / "version").write_text("2.20.0.0\n" if node == stale else "2.30.0.0\n")
    spec = tiny_spec(steps=400)
    prefer = {"weight": 100, "preference": {"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [stale]}]}}
    spec["template"] = {"spec": {
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [prefer]}},
        "containers": [{"name": "trainer", "env": [
            {"name": "HLAT_NEURON_DRIVER_FILE",
             "value": f"{drivers}/$(HLAT_NODE_NAME)/version"}]}]}}
    job_env.create(spec)
    status = job_env.wait("the node fault", lambda s: (s.get("lastFailure") or {}).get(
        "reason") == "NodeUnhealthy" or s.get("phase") == "Failed", 120)
    failure = status["lastFailure"]
    assert status.get("phase") != "Failed", failure
    assert failure["node"] == stale and failure["exitCode"] == 4, failure
    status = job_env.wait("training elsewhere", lambda s: s.get("phase") == "Running"
                          and s.get("progress", {}).get("step", 0) >= 1, 180)
    assert status["restarts"]["counted"] == 0
    assert stale in [a["node"] for a in status["avoidedNodes"]]
    assert stale not in {p.spec.node_name for p in _pods_of(job_env, status["attempt"])}
