"""The memory check counts activations: it refuses what would run out of device memory after
the whole first compile, accepts the paper's layouts, and every preset's defaults fit."""

from __future__ import annotations

from typing import Any

import pytest

from hlat_api import InvalidSpecError, parse_spec
from hlat_api.memory import GIB, Layout, _layer_terms, activation_bytes
from hlat_api.presets import MODEL_PRESETS, PAPER_PRECISION
from hlat_api.spec import memory_estimate


def job(preset: str = "7b", nodes: int = 1, instance: str = "trn1.32xlarge",
        **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"nodes": nodes, "instanceType": instance, "model": {"preset": preset},
                           "data": {"path": "/fsx/data", "tokenizer": "/fsx/tok.json"},
                           "train": {"steps": 10_000, "globalBatch": 1024}}
    raw.update(over)
    return raw


def test_7b_tp8_without_sequence_parallel_or_recompute_is_refused_with_the_figures() -> None:
    """The issue's case: 7B, tp 8, 4096 tokens, micro-batch 1 on trn1, state alone fits."""
    raw = job(parallelism={"tensor": 8, "sequenceParallel": False,
                           "activationCheckpointing": "none"})
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(raw)
    text = str(info.value)
    assert "spec.parallelism.sequenceParallel" in text
    assert "GiB per NeuronCore but a trn1.32xlarge NeuronCore has 16 GiB" in text
    assert "5.5 GiB model state" in text and "22.8 GiB activations" in text
    assert "turn on parallelism.sequenceParallel and activationCheckpointing: selective" in text


def test_the_issue_s_attention_estimate_is_what_the_model_counts() -> None:
    """NxD's eager core keeps the fp32 softmax output and its bf16 cast: 6 a s^2 / t bytes per
    layer, 12.9 GB over 7B's 32 layers at tp 8 (the issue's "about 13 GB")."""
    dims = MODEL_PRESETS["7b"]
    eager = Layout(4096, 1, 8, False, "none", "bf16-sr", managed=True, zero1=True,
                   eager_attention=True)
    s2 = _layer_terms(dims, eager)["attention core"] - 3 * 2 * 4096 * 4096 / 8
    assert s2 * dims.layers == pytest.approx(6 * 32 / 8 * 4096**2 * 32)
    assert s2 * dims.layers / 1e9 == pytest.approx(12.9, abs=0.05)
    fused = Layout(4096, 1, 8, False, "none", "bf16-sr", managed=False, zero1=True,
                   eager_attention=False)
    assert _layer_terms(dims, fused)["attention core"] < s2 / 20  # no s x s term


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activations_follow_korthikanti_s_scaling(mode: str) -> None:
    """Sequence parallel divides what each layer keeps by t (selective: exactly the
    sequence-sharded and tp-sharded terms); recompute only lowers it; micro-batch scales it."""
    dims = MODEL_PRESETS["7b"]

    def per_layer(sp: bool, b: int = 1, ac: str = mode) -> float:
        lay = Layout(4096, b, 8, sp, ac, "bf16-sr", managed=True, zero1=True,
                     eager_attention=True)
        return activation_bytes(dims, lay).per_layer

    assert per_layer(True) < per_layer(False)
    assert per_layer(True, b=2) == pytest.approx(2 * per_layer(True))
    if mode != "none":
        assert per_layer(True) < per_layer(True, ac="none")
    if mode == "selective":
        # with SP and the core recomputed, every kept tensor is 1/t of the sequence or of the
        # heads/columns (34sbh/t in GPT): t times the SP-off, tp-1 figure of the same layout
        # would be the whole layer; here check against the tp 1 figure directly
        tp1 = Layout(4096, 1, 1, False, "selective", "bf16-sr", managed=True, zero1=True,
                     eager_attention=True)
        q_kv = 2 * 4096 * (4096 / 8 + 2 * 4096 / 8) - 2 * 4096 * (4096 + 2 * 4096) / 8
        assert per_layer(True) == pytest.approx(
            activation_bytes(dims, tp1).per_layer / 8 + q_kv)


def test_the_paper_s_7b_layout_fits_trn1() -> None:
    """SP + selective at tp 8 (awslabs/HLAT 7b/), from 1 node to the paper's 64."""
    for nodes in (1, 64):
        spec = parse_spec(job(nodes=nodes, parallelism={
            "tensor": 8, "sequenceParallel": True, "activationCheckpointing": "selective"}))
        est = memory_estimate(spec)
        assert est is not None and est.fits and est.activations < 4


def test_70b_at_tp32_on_8_trn1_nodes() -> None:
    """Accepted in bf16-sr, whose unset checkpointing becomes full (selective: 16.7 GiB);
    the paper's own 70B precision (mixed) needs 16 nodes without its pipeline degree of 8."""
    spec = parse_spec(job("70b", nodes=8, precision="bf16-sr"))
    assert (spec.parallelism.tensor, spec.parallelism.activation_checkpointing) == (32, "full")
    with pytest.raises(InvalidSpecError, match=r"spec\.parallelism\.activationCheckpointing"):
        parse_spec(job("70b", nodes=8, precision="bf16-sr",
                       parallelism={"activationCheckpointing": "selective"}))
    with pytest.raises(InvalidSpecError, match=r"spec\.nodes: .*15\.9 GiB model state \(mixed"):
        parse_spec(job("70b", nodes=8))


@pytest.mark.parametrize("precision", ["mixed", "bf16-sr"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_70b_on_4_trn1_nodes_runs_out_of_memory_as_the_paper_s_did(
        precision: str, mode: str) -> None:
    """The paper's Figure 4: 70B out of memory on 4 nodes. Predicted here for every precision
    and recompute mode at tp 32 (docs/neuron.md puts the figures side by side)."""
    with pytest.raises(InvalidSpecError, match="GiB per NeuronCore"):
        parse_spec(job("70b", nodes=4, precision=precision,
                       parallelism={"activationCheckpointing": mode}))


MEANT_FOR = [
    ("7b", "trn1.32xlarge", 1), ("7b", "trn1.32xlarge", 64), ("7b", "trn1n.32xlarge", 4),
    ("7b", "trn2.48xlarge", 1), ("7b", "p5.48xlarge", 4),
    ("70b", "trn1.32xlarge", 16), ("70b", "trn1.32xlarge", 64), ("70b", "trn1n.32xlarge", 32),
    ("70b", "trn2.48xlarge", 4), ("70b", "trn2.48xlarge", 64),
    ("1b", "trn1.32xlarge", 1), ("1b", "trn2.48xlarge", 1), ("125m", "trn1.2xlarge", 1),
    ("125m", "p5.48xlarge", 1), ("tiny", "cpu", 1),
]


@pytest.mark.parametrize(("preset", "instance", "nodes"), MEANT_FOR,
                         ids=[f"{p}-{i}-{n}" for p, i, n in MEANT_FOR])
def test_every_preset_s_defaults_pass_their_own_memory_check(
        preset: str, instance: str, nodes: int) -> None:
    raw = job(preset, nodes=nodes, instance=instance,
              train={"steps": 10_000, "globalBatch": 4096})
    raw["data"]["seqLen"] = min(4096, MODEL_PRESETS[preset].max_seq_len)
    spec = parse_spec(raw)
    est = memory_estimate(spec)
    assert est is None or est.fits, est
    assert spec.precision == PAPER_PRECISION.get(preset, "bf16-sr")
    p = spec.parallelism
    if instance.startswith("trn"):
        assert p.sequence_parallel == (p.tensor > 1)
        full = (preset, instance[:4]) in (("70b", "trn1"), ("1b", "trn1"))
        assert p.activation_checkpointing == ("full" if full else "selective")
    else:
        assert (p.sequence_parallel, p.activation_checkpointing) == (False, "none")


def test_1b_on_a_trn1_2xlarge_needs_tensor_2() -> None:
    """At tp 1 one layer's s x s attention (32 heads) in backward alone is 3 GiB: the default
    tp of 1 does not fit a 16 GiB NeuronCore even with full recompute; the check says so."""
    raw = job("1b", instance="trn1.2xlarge", train={"steps": 10_000, "globalBatch": 4096})
    with pytest.raises(InvalidSpecError, match=r"raise parallelism\.tensor"):
        parse_spec(raw)
    est = memory_estimate(parse_spec({**raw, "parallelism": {"tensor": 2}}))
    assert est is not None and est.fits


def test_what_the_user_sets_is_kept() -> None:
    spec = parse_spec(job(precision="bf16", parallelism={
        "sequenceParallel": False, "activationCheckpointing": "full"}))
    assert (spec.precision, spec.parallelism.sequence_parallel,
            spec.parallelism.activation_checkpointing) == ("bf16", False, "full")


def test_the_crd_leaves_the_preset_dependent_fields_unset() -> None:
    """A schema default would be filled in by the API server, so the preset's could never
    apply to a manifest: these fields carry none."""
    from hlat_api import PretrainJobSpec

    schema = PretrainJobSpec.model_json_schema(by_alias=True)
    par = schema["$defs"]["ParallelismSpec"]["properties"]
    assert "default" not in par["sequenceParallel"]
    assert "default" not in par["activationCheckpointing"]
    assert "default" not in schema["properties"]["precision"]


def test_the_estimate_is_in_gib_of_2_30_bytes() -> None:
    assert GIB == 1 << 30
