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


def test_the_demo_s_goodput_table_shows_each_cause_and_its_share_next_to_uptime() -> None:
    from hlat_testbed.demo import goodput_table

    table = goodput_table({
        "uptime": {"ratio": 0.98}, "lostSteps": 4,
        "goodput": {"ratio": 0.25, "wallSeconds": 40.0, "productiveSeconds": 10.0,
                    "lostWorkSeconds": 1.5,
                    "badputSeconds": {"startup": 20.0, "detection": 10.0, "compile": 0}}})
    lines = table.splitlines()
    assert "goodput 25.0% of 40.0s" in lines[0] and "uptime" in lines[0] and "98.0%" in lines[0]
    assert "4 steps" in lines[0]
    rows = {line.split()[0]: line.split()[1:3] for line in lines[1:]}
    assert rows == {"productive": ["10.0s", "25.0%"], "startup": ["20.0s", "50.0%"],
                    "detection": ["10.0s", "25.0%"]}  # causes at 0 are left out
