"""Node health beyond Ready: what the node's own health reporters say about its accelerators.

A node can be Ready to the kubelet and useless to a training job: an HBM uncorrectable error or
a DMA abort on one Neuron device fails every collective the gang runs there. Three reporters
say so on EKS, each in its own way, and a worker on such a node is a node fault (infrastructure:
no restart budget; the node is avoided), not a process fault that a restart on the same device
would repeat:

- the EKS node monitoring agent sets the condition `AcceleratedHardwareReady`; `False` is a
  problem, its reason names it (`NeuronHBMUncorrectableError`, `NeuronDMAError`,
  `NeuronNCUncorrectableError`, `NeuronSRAMUncorrectableError`, read from the kernel's
  `NEURON_HW_ERR=...` lines: aws/eks-node-monitoring-agent, monitors/neuron/monitor.go and
  pkg/reasons; EKS node auto repair replaces such a node after about 10 minutes);
- the Neuron node problem detector (node-problem-detector with the Neuron kernel-monitor rules)
  sets `NeuronHealth`, a node-problem-detector "problem" condition: `True` is a problem (reasons
  `NeuronHasError_HBM_UNCORRECTABLE_ERROR`, `NeuronHasError_DMA_ERROR`, ...), `False` with
  `NeuronHasNoError` is healthy (aws-neuron/aws-neuron-sdk, containers/tutorials/
  k8s-neuron-problem-detector-and-recovery.rst; kubernetes/node-problem-detector's condition
  convention: True means the problem is present);
- SageMaker HyperPod labels its nodes `sagemaker.amazonaws.com/node-health-status`; any value
  but `Schedulable` keeps work away (`hlat_api.labels.NODE_HEALTH_LABEL`).

A condition whose status is `Unknown` (its reporter stopped) is no evidence either way and is
not a fault: a stopped monitoring agent must not restart every job in the cluster.

And one more, from the worker itself: a trainer (or the launcher's driver check) that exits with
`ExitCode.NODE_FAULT` says the node's Neuron device or driver is at fault (`exit_problem`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hlat_api import labels
from hlat_api.env import ExitCode

ACCELERATED_HARDWARE_READY = "AcceleratedHardwareReady"
"""The EKS node monitoring agent's condition for GPUs and Neuron devices (True: healthy)."""
NEURON_HEALTH = "NeuronHealth"
"""The Neuron node problem detector's condition (True: a problem was found)."""
NODE_FAULT_EXIT = "NodeFaultExit"
"""The name given to a worker's `ExitCode.NODE_FAULT` where a condition's name would go."""

_PROBLEM_WHEN: Mapping[str, str] = {ACCELERATED_HARDWARE_READY: "False", NEURON_HEALTH: "True"}
"""The status that means trouble, per condition type."""


@dataclass(frozen=True)
class NodeProblem:
    """One reporter's verdict that a node cannot serve training now."""

    condition: str
    """The condition type (or the HyperPod label, or `NODE_FAULT_EXIT`)."""
    status: str
    """The condition's status, the label's value, or the exit code."""
    reason: str = ""
    message: str = ""

    def describe(self) -> str:
        """E.g. `AcceleratedHardwareReady=False (NeuronHBMUncorrectableError: ...)`."""
        detail = ": ".join(p for p in (self.reason, self.message.strip()[:200]) if p)
        return f"{self.condition}={self.status}" + (f" ({detail})" if detail else "")


def condition_problems(conditions: Iterable[Mapping[str, Any]]) -> list[NodeProblem]:
    """The problems a Node's status conditions report."""
    out = []
    for cond in conditions:
        kind = str(cond.get("type") or "")
        status = str(cond.get("status") or "")
        if kind in _PROBLEM_WHEN and status == _PROBLEM_WHEN[kind]:
            out.append(NodeProblem(kind, status, str(cond.get("reason") or ""),
                                   str(cond.get("message") or "")))
    return out


def label_problem(health: str | None) -> NodeProblem | None:
    """HyperPod's health label, when it keeps work away."""
    if health is None or health == labels.NODE_HEALTHY:
        return None
    return NodeProblem(labels.NODE_HEALTH_LABEL, health)


def node_problems(raw: Mapping[str, Any]) -> tuple[NodeProblem, ...]:
    """Every problem a raw Node carries: its conditions first, then HyperPod's label."""
    conditions = (raw.get("status") or {}).get("conditions") or []
    health = ((raw.get("metadata") or {}).get("labels") or {}).get(labels.NODE_HEALTH_LABEL)
    found = condition_problems(conditions)
    hyperpod = label_problem(health)
    return tuple(found + ([hyperpod] if hyperpod else []))


def exit_problem(code: int | None) -> NodeProblem | None:
    """A worker's exit code that blames its node."""
    if code != ExitCode.NODE_FAULT:
        return None
    return NodeProblem(NODE_FAULT_EXIT, str(int(code)), "NeuronDeviceOrDriver",
                       "the worker found its node's Neuron device or driver at fault")
