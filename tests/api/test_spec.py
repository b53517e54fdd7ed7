"""The spec's defaults are the paper's, and every impossible spec names its field and reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hlat_api import InvalidSpecError, load_job, parse_spec
from hlat_api.spec import estimate_state_bytes_per_rank

EXAMPLES = Path(__file__).parents[2] / "examples"
DELETE = object()


def paper_7b(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "nodes": 64,
        "instanceType": "trn1.32xlarge",
        "model": {"preset": "7b"},
        "parallelism": {"tensor": 8, "sequenceParallel": True},
        "data": {"path": "/fsx/data", "tokenizer": "/fsx/tokenizer.json"},
        "train": {"tokens": 1.8e12},
    }
    for key, value in over.items():
        section, _, leaf = key.partition("__")
        if leaf:
            raw.setdefault(section, {})[leaf] = value
        else:
            raw[section] = value
    return raw


def test_paper_defaults() -> None:
    spec = parse_spec(paper_7b())
    o = spec.optimizer
    assert (o.lr, o.min_lr, o.betas, o.eps, o.weight_decay, o.grad_clip, o.warmup_steps) == (
        3e-4, 3e-5, (0.9, 0.95), 1e-8, 0.1, 1.0, 2000
    )
    assert (spec.data.seq_len, spec.train.global_batch, spec.precision) == (4096, 1024, "bf16-sr")
    # 64 nodes x 32 NeuronCores / TP 8 = DP 256 (paper 3.2); 1024 sequences = 4 per DP rank
    assert (spec.world_size, spec.data_parallel, spec.grad_accum_steps) == (2048, 256, 4)
    assert spec.tokens_per_step == 4_194_304  # "about 4 million tokens" per step
    assert spec.total_steps == 429_154  # 1.8T tokens


def test_yaml_round_trip_uses_camel_case() -> None:
    spec = parse_spec(paper_7b())
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["checkpoint"]["async"] is True and "globalBatch" in dumped["train"]
    assert parse_spec(dumped) == spec


INVALID = [
    ({"parallelism": {"tensor": 3}}, "spec.parallelism.tensor", "attention heads"),
    ({"model": {"preset": "70b"}, "parallelism": {"tensor": 16}}, "spec.parallelism.tensor", "key/value heads"),
    ({"instanceType": "trn1.2xlarge", "parallelism": {"tensor": 4}}, "spec.parallelism.tensor", "within a node"),
    ({"parallelism": {"tensor": 8, "pipeline": 2}}, "spec.parallelism.pipeline", "not supported"),
    ({"instanceType": "cpu", "nodes": 1, "processesPerNode": 12}, "spec.nodes", "not divisible by tensor"),
    ({"train": {"tokens": 1e9, "globalBatch": 1000}}, "spec.train.globalBatch", "not divisible"),
    ({"train": {"steps": 10, "tokens": 1e9}}, "spec.train", "exactly one"),
    ({"train": {"tokens": None}}, "spec.train", "exactly one"),
    ({"train": {"steps": 0}}, "spec.train.steps", "greater than or equal to 1"),
    ({"train": {"tokens": None, "steps": 100}}, "spec.optimizer.warmupSteps", "exceeds"),
    ({"data": {"path": "/d", "tokenizer": "bytes", "seqLen": 8192}}, "spec.data.seqLen", "maxSeqLen"),
    ({"data": {"tokenizer": DELETE}}, "spec.data.tokenizer", "Field required"),
    ({"data": {"tokenizer": "bytes", "path": "/d", "txtColumn": "t"}}, "spec.data.txtColumn", "unknown field"),
    ({"model": {"preset": "13b"}}, "spec.model.preset", "Input should be"),
    ({"model": {"preset": None, "hiddenSize": 64}}, "spec.model", "dimensions are required"),
    ({"model": {"preset": "tiny", "hiddenSize": 130}}, "spec.model.hiddenSize", "not divisible by heads"),
    ({"model": {"preset": "tiny", "kvHeads": 3}}, "spec.model.kvHeads", "multiple of kvHeads"),
    ({"instanceType": "trn3.xlarge"}, "spec.instanceType", "Input should be"),
    ({"nodes": 0}, "spec.nodes", "greater than or equal to 1"),
    ({"nodes": "two"}, "spec.nodes", "valid integer"),
    ({"precision": "fp16"}, "spec.precision", "Input should be"),
    ({"optimizer": {"lr": -1}}, "spec.optimizer.lr", "greater than 0"),
    ({"optimizer": {"lr": 1e-4, "minLr": 1e-3}}, "spec.optimizer.minLr", "above optimizer.lr"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "spec.optimizer.betas.1", "less than 1"),
    ({"checkpoint": {"interval": 0}}, "spec.checkpoint.interval", "greater than or equal to 1"),
    ({"faultTolerance": {"heartbeat": {"timeoutSeconds": "soon"}}}, "spec.faultTolerance.heartbeat.timeoutSeconds", "auto"),
    ({"faultTolerance": {"backoff": {"initialSeconds": 900}}}, "spec.faultTolerance.backoff.initialSeconds", "maxSeconds"),
    ({"parallelism": {"tensor": 1}, "train": {"globalBatch": 2048}}, "spec.parallelism.tensor", "GiB per rank"),
    ({"model": {"preset": "70b"}}, "spec.parallelism.tensor", "GiB per rank"),
    ({"parallelism": {"tensor": 8, "activationCheckpointing": "some"}}, "spec.parallelism.activationCheckpointing", "Input should be"),
]


@pytest.mark.parametrize(("change", "field", "reason"), INVALID, ids=[i[1] + ":" + i[2] for i in INVALID])
def test_invalid_specs_name_field_and_reason(change: dict[str, Any], field: str, reason: str) -> None:
    raw = paper_7b()
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and key in raw else value
        if isinstance(raw[key], dict):
            raw[key] = {k: v for k, v in raw[key].items() if v is not DELETE}
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(raw)
    fields = [f for f, _ in info.value.problems]
    assert field in fields, info.value
    assert reason in str(info.value)


def test_memory_estimate_shrinks_with_tp_and_zero1() -> None:
    base = parse_spec(paper_7b())
    no_zero = parse_spec(paper_7b(parallelism={"tensor": 8, "zero1": False}))
    tp32 = parse_spec(paper_7b(nodes=64, parallelism={"tensor": 32}))
    assert estimate_state_bytes_per_rank(base) < estimate_state_bytes_per_rank(no_zero)
    assert estimate_state_bytes_per_rank(tp32) < estimate_state_bytes_per_rank(base)
    # 6.74e9 / 8 params x (2 weight + 2 grad + 8/256 optimizer) bytes
    assert estimate_state_bytes_per_rank(base) / 2**30 == pytest.approx(3.17, rel=0.01)


def test_example_manifest_is_valid() -> None:
    job = load_job(EXAMPLES / "pretrainjob-tiny.yaml")
    assert job.name == "tiny"
    assert job.spec.world_size == 2 and job.spec.model.preset == "tiny"  # 2 CPU nodes
