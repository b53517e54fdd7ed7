"""Pure parts of the rig: no cluster, no root."""

from __future__ import annotations

import pytest

from hlat_testbed.config import ClusterConfig
from hlat_testbed.instancetypes import EFA, NEURON, NEURONCORE, instance_type
from hlat_testbed.podspec import expand


@pytest.mark.parametrize(
    ("value", "expected"),
    [("$(A)-x", "1-x"), ("$$(A)", "$(A)"), ("$(MISSING)", "$(MISSING)"), ("a$b", "a$b")],
)
def test_env_expansion_follows_kubernetes_rules(value: str, expected: str) -> None:
    assert expand(value, {"A": "1"}) == expected


def test_trn1_node_advertises_neuron_and_efa() -> None:
    cap = instance_type("trn1.32xlarge").capacity()
    assert (cap[NEURON], cap[NEURONCORE], cap[EFA]) == ("16", "32", "8")


def test_unknown_instance_type_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"trn1\.32xlarge"):
        instance_type("trn9.huge")


def test_nodes_get_disjoint_pod_ranges_outside_the_host_address() -> None:
    cfg = ClusterConfig(state_dir="/tmp/x")
    ranges = [cfg.node_cidr(i) for i in range(3)]
    assert cfg.host_ip == "10.244.0.1"
    assert [str(r) for r in ranges] == ["10.244.1.0/24", "10.244.2.0/24", "10.244.3.0/24"]
