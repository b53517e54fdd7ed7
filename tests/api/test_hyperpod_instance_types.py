"""HyperPod's `ml.` instance type names: accepted as the same type, and its workers select the
nodes by the label HyperPod sets (`node.kubernetes.io/instance-type: ml.trn1.32xlarge`)."""

from __future__ import annotations

from typing import Any

import pytest

from hlat_api import InvalidSpecError, parse_spec
from hlat_api.labels import INSTANCE_TYPE_LABEL
from hlat_api.presets import HYPERPOD_INSTANCE_TYPES, canonical_instance_type


def _spec(instance: str, **extra: Any) -> dict[str, Any]:
    return {"nodes": 2, "instanceType": instance, "model": {"preset": "7b"},
            "parallelism": {"tensor": 8}, "data": {"path": "/fsx/d", "tokenizer": "/fsx/t.json"},
            "train": {"tokens": 1.0e12}, **extra}


@pytest.mark.parametrize("name", ["trn1.32xlarge", "trn2.48xlarge", "p5.48xlarge"])
def test_an_ml_name_is_the_same_job_as_the_plain_name(name: str) -> None:
    hyperpod = parse_spec(_spec(f"ml.{name}"))
    plain = parse_spec(_spec(name))
    assert hyperpod.instance_type == name
    assert hyperpod.scheduling.node_selector == {INSTANCE_TYPE_LABEL: f"ml.{name}"}
    assert hyperpod.model_dump(exclude={"scheduling"}) == plain.model_dump(exclude={"scheduling"})


def test_the_user_s_node_selector_wins_over_the_ml_label() -> None:
    spec = parse_spec(_spec("ml.trn1.32xlarge", scheduling={"nodeSelector": {
        INSTANCE_TYPE_LABEL: "trn1.32xlarge", "pool": "a"}}))
    assert spec.scheduling.node_selector == {INSTANCE_TYPE_LABEL: "trn1.32xlarge", "pool": "a"}


def test_there_is_no_ml_cpu() -> None:
    assert "ml.cpu" not in HYPERPOD_INSTANCE_TYPES
    with pytest.raises(InvalidSpecError, match="instanceType"):
        parse_spec(_spec("ml.cpu"))


def test_canonical_names() -> None:
    assert canonical_instance_type("ml.trn2.48xlarge") == "trn2.48xlarge"
    assert canonical_instance_type("trn2.48xlarge") == "trn2.48xlarge"
