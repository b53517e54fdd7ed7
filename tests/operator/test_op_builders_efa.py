"""EFA as AWS's own manifests use it: a p5 worker gets the 2 MiB huge pages libfabric's EFA
provider allocates from (else the pod lands on the node and EFA falls back or fails), a Trainium
worker gets none (AWS's Neuron manifests request none), and the worker stays Guaranteed QoS
(huge pages too are requests = limits). What a pod cannot set (the memlock limit) is the node's:
docs/neuron.md, "EFA"."""

from __future__ import annotations

from typing import Any

import pytest
from opfakes import JOB, SETTINGS, raw_spec

from hlat_api import labels
from hlat_api.manifest import parse_spec
from hlat_operator import builders

PER_NODE = {"trn1.32xlarge": 32, "trn1n.32xlarge": 32, "trn2.48xlarge": 64, "trn1.2xlarge": 2,
            "p5.48xlarge": 8, "cpu": 1}


def _trainer(instance: str) -> dict[str, Any]:
    spec = parse_spec(raw_spec(instanceType=instance, processesPerNode=PER_NODE[instance],
                               **{"model.preset": "tiny", "train.globalBatch": 256,
                                  "train.microBatch": 1}))
    pod = builders.build_worker_pod(JOB, spec, 0, 0, SETTINGS)
    (trainer,) = [c for c in pod["spec"]["containers"] if c["name"] == builders.CONTAINER]
    return trainer


def test_p5_workers_request_the_huge_pages_of_awss_efa_gpu_manifests() -> None:
    resources = _trainer("p5.48xlarge")["resources"]
    assert resources["limits"]["hugepages-2Mi"] == "5120Mi"
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS
    assert resources["limits"][labels.EFA_RESOURCE] == "32"
    assert resources["limits"][labels.GPU_RESOURCE] == "8"


@pytest.mark.parametrize("instance", ["trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge",
                                      "trn1.2xlarge", "cpu"])
def test_no_huge_pages_where_aws_requests_none(instance: str) -> None:
    limits = _trainer(instance).get("resources", {}).get("limits", {})
    assert not [k for k in limits if k.startswith("hugepages-")], limits


def test_the_trainer_adds_no_capability_that_would_not_reach_it() -> None:
    """IPC_LOCK in capabilities.add reaches only the bounding set of a non-root process
    (kubernetes/kubernetes#56374: no ambient capabilities), so it would not lift the memlock
    limit for user 10001; the worker asks for nothing it cannot use."""
    for instance in ("trn1.32xlarge", "p5.48xlarge"):
        added = (_trainer(instance).get("securityContext") or {}).get("capabilities", {})
        assert not added.get("add"), added
