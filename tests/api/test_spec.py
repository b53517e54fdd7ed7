"""The spec's defaults are the paper's, and every impossible spec names its field and reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hlat_api import InvalidSpecError, load_job, parse_spec
from hlat_api.memory import params_per_rank
from hlat_api.spec import estimate_state_bytes_per_rank, micro_batch_share

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
    ({"model": {"preset": "125m", "kvHeads": 4}, "parallelism": {"tensor": 6}}, "spec.parallelism.tensor", "key/value heads"),
    ({"instanceType": "trn1.2xlarge", "parallelism": {"tensor": 4}}, "spec.parallelism.tensor", "within a node"),
    ({"parallelism": {"tensor": 8, "pipeline": 2}}, "spec.parallelism.pipeline", "not supported"),
    ({"instanceType": "cpu", "nodes": 1, "processesPerNode": 12}, "spec.nodes", "not divisible by tensor"),
    ({"train": {"tokens": 1e9, "globalBatch": 1000, "microBatch": 3}}, "spec.train.globalBatch", "not divisible by microBatch 3"),
    ({"train": {"tokens": 1e9, "globalBatch": 200}}, "spec.train.globalBatch", "fewer than the 256 data-parallel ranks"),
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
    ({"parallelism": {"tensor": 1}, "train": {"globalBatch": 2048}}, "spec.parallelism.tensor", "GiB per NeuronCore"),
    ({"model": {"preset": "70b"}}, "spec.parallelism.tensor", "GiB per NeuronCore"),
    ({"parallelism": {"tensor": 8, "sequenceParallel": False, "activationCheckpointing": "none"}}, "spec.parallelism.sequenceParallel", "GiB per NeuronCore"),
    ({"parallelism": {"tensor": 8, "activationCheckpointing": "some"}}, "spec.parallelism.activationCheckpointing", "Input should be"),
    # strings: empty, oversized, not absolute, not an object name
    ({"data": {"path": "", "tokenizer": "bytes"}}, "spec.data.path", "at least 1 character"),
    ({"data": {"path": "/d", "tokenizer": "t" * 5000}}, "spec.data.tokenizer", "at most 4096"),
    ({"image": ""}, "spec.image", "at least 1 character"),
    ({"storage": {"mountPath": "fsx"}}, "spec.storage.mountPath", "should match pattern"),
    ({"storage": {"claimName": "My_Claim"}}, "spec.storage.claimName", "should match pattern"),
    # devices: the backend and the process count the instance can run
    ({"backend": "cuda"}, "spec.backend", "cannot run on trn1.32xlarge"),
    ({"instanceType": "p5.48xlarge", "backend": "neuron-xla"}, "spec.backend", "cannot run on p5"),
    ({"instanceType": "cpu", "backend": "neuron-native"}, "spec.backend", "cannot run on cpu"),
    ({"processesPerNode": 64}, "spec.processesPerNode", "exceeds the 32 NeuronCores"),
    ({"nodes": 100000}, "spec.nodes", "less than or equal to 4096"),
    # strict like the API server: no NaN, no numbers or booleans in strings, whole seconds
    ({"optimizer": {"lr": float("nan")}}, "spec.optimizer.lr", "finite number"),
    ({"train": {"steps": None, "tokens": float("inf")}}, "spec.train.tokens", "finite number"),
    ({"nodes": "64"}, "spec.nodes", "valid integer"),
    ({"instanceType": []}, "spec.instanceType", "Input should be"),
    ({"suspend": "false"}, "spec.suspend", "valid boolean"),
    ({"faultTolerance": {"heartbeat": {"timeoutSeconds": 2.5}}}, "spec.faultTolerance.heartbeat.timeoutSeconds", "valid integer"),
    ({"instance_type": "cpu"}, "spec.instance_type", "unknown field"),
    # in-memory snapshots: restarts in place, the torch-native stack, room in the node's memory
    ({"checkpoint": {"memoryInterval": 0}}, "spec.checkpoint.memoryInterval", "greater than or equal to 1"),
    ({"checkpoint": {"memoryInterval": "often"}}, "spec.checkpoint.memoryInterval", "'auto'"),
    ({"checkpoint": {"memoryInterval": 1}, "faultTolerance": {"restartStrategy": "RecreateGang"}}, "spec.checkpoint.memoryInterval", "restartStrategy: InPlace"),
    # neuron-xla: each rank keeps its weights whole (NxD's state): the 70B at tp 32, 595 GiB a
    # node, which more nodes would not shrink (not suggested)
    ({"checkpoint": {"memoryInterval": 1}, "model": {"preset": "70b"}, "parallelism": {"tensor": 32}}, "spec.checkpoint.memoryInterval", "595 GiB per node"),
    ({"checkpoint": {"memoryInterval": 1}, "model": {"preset": "70b"}, "parallelism": {"tensor": 32}}, "spec.checkpoint.memoryInterval", "a higher parallelism.tensor)"),
    ({"elastic": {"minNodes": 32}}, "spec.elastic", "backend: neuron-native"),
    # the 70B on 64 nodes fits (each rank keeps 1/dp of its weights: 42 GiB a node); on 8, not
    ({"checkpoint": {"memoryInterval": 1}, "backend": "neuron-native", "model": {"preset": "70b"}, "parallelism": {"tensor": 32}, "precision": "bf16-sr", "nodes": 8}, "spec.checkpoint.memoryInterval", "more nodes)"),
    # held-out evaluation: held out, and a positive cadence
    ({"eval": {"path": "/fsx/data"}}, "spec.eval.path", "is data.path"),
    ({"eval": {"path": "/fsx/held-out", "interval": 0}}, "spec.eval.interval", "greater than or equal to 1"),
    ({"eval": {"interval": 10}}, "spec.eval.path", "Field required"),
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


def test_in_memory_snapshots_are_on_by_default_only_where_they_can_serve() -> None:
    """memoryInterval unset: auto with restarts in place on a torch-native backend and room in
    the node's memory; off, without an error, on the neuron-xla stack (the paper's default:
    there only when set, the path not yet run on Trainium), with RecreateGang, or short of
    memory; `off` turns them off; a value set is kept."""
    native = {"backend": "neuron-native", "precision": "bf16-sr"}
    assert parse_spec(paper_7b(**native)).snapshot_interval == "auto"
    assert parse_spec(paper_7b()).snapshot_interval is None  # neuron-xla: only when set
    assert parse_spec(paper_7b(checkpoint={"memoryInterval": 1})).snapshot_interval == 1
    assert parse_spec(paper_7b(**native, faultTolerance={
        "restartStrategy": "RecreateGang"})).snapshot_interval is None
    short = parse_spec(paper_7b(**native, nodes=8, model={"preset": "70b"},
                                parallelism={"tensor": 32}))
    assert short.snapshot_interval is None
    assert parse_spec(paper_7b(**native, checkpoint={"memoryInterval": "off"})
                      ).snapshot_interval is None
    assert parse_spec(paper_7b(**native, checkpoint={"memoryInterval": 4})
                      ).snapshot_interval == 4


def test_memory_estimate_shrinks_with_tp_and_zero1() -> None:
    base = parse_spec(paper_7b())
    no_zero = parse_spec(paper_7b(parallelism={"tensor": 8, "zero1": False}))
    tp32 = parse_spec(paper_7b(nodes=64, parallelism={"tensor": 32}))
    assert estimate_state_bytes_per_rank(base) < estimate_state_bytes_per_rank(no_zero)
    assert estimate_state_bytes_per_rank(tp32) < estimate_state_bytes_per_rank(base)
    # neuron-xla, bf16-sr, ZeRO-1: 6.74e9 / 8 params x (2 weight + 2 grad + (4 fp32 master +
    # 8 fp32 moments) / 256 dp ranks) bytes
    assert estimate_state_bytes_per_rank(base) / 2**30 == pytest.approx(
        6.738e9 / 8 * (4 + 12 / 256) / 2**30, rel=0.001)


@pytest.mark.parametrize(("backend", "precision", "zero1", "per_param"), [
    ("neuron-xla", "bf16-sr", True, 4 + 12 / 8), ("neuron-xla", "bf16-sr", False, 4 + 4),
    ("neuron-xla", "mixed", True, 6 + 12 / 8), ("neuron-xla", "fp32", False, 8 + 8),
    ("neuron-native", "bf16-sr", True, 4 + 8 / 8), ("neuron-native", "bf16", False, 4 + 4),
    ("neuron-native", "mixed", True, 8 + 8 / 8),
])
def test_memory_counts_what_each_stack_keeps(
    backend: str, precision: str, zero1: bool, per_param: float,
) -> None:
    """NxD's ZeRO-1 keeps an fp32 master shard and fp32 moments (and, for mixed, a full-size
    fp32 gradient accumulator); AdamWSR keeps fp32 moments and no master; torch's AdamW
    moments in the parameter dtype."""
    spec = parse_spec(paper_7b(nodes=1, backend=backend, precision=precision,
                               model={"preset": "1b"},
                               parallelism={"tensor": 4, "zero1": zero1, "sequenceParallel": True,
                                            "activationCheckpointing": "selective"}))
    assert spec.data_parallel == 8
    expected = spec.model.dims().param_count() / 4 * per_param
    assert estimate_state_bytes_per_rank(spec) == pytest.approx(expected, rel=1e-9)


def test_70b_at_tensor_32_replicates_kv_heads() -> None:
    """Each rank holds one whole kv head at tp 32 (8 kv heads); the state shrinks with dp."""
    def spec(nodes: int) -> Any:
        return parse_spec(paper_7b(nodes=nodes, model={"preset": "70b"},
                                   parallelism={"tensor": 32}))

    assert spec(16).parallelism.tensor == 32
    dims = spec(16).model.dims()
    # one whole kv head (k and v, every layer) per rank, 1/32 of everything else
    kv = dims.layers * 2 * dims.hidden_size * dims.kv_heads * dims.head_dim
    assert params_per_rank(dims, 32) == pytest.approx(
        (dims.param_count() - kv) / 32 + kv / dims.kv_heads)
    assert estimate_state_bytes_per_rank(spec(16)) > estimate_state_bytes_per_rank(spec(64))
    with pytest.raises(InvalidSpecError, match="GiB per NeuronCore"):
        spec(2)


@pytest.mark.parametrize(("preset", "instance", "nodes", "per_node", "tensor"), [
    ("7b", "trn1.32xlarge", 1, None, 8), ("70b", "trn1.32xlarge", 16, None, 32),
    ("1b", "trn1.2xlarge", 1, None, 1), ("tiny", "cpu", 1, None, 1),
    ("7b", "trn1.32xlarge", 4, 4, 4), ("1b", "trn1.32xlarge", 1, None, 1),
])
def test_tensor_defaults_to_the_paper_s_layout_for_the_preset(
    preset: str, instance: str, nodes: int, per_node: int | None, tensor: int,
) -> None:
    raw: dict[str, Any] = {"instanceType": instance, "model": {"preset": preset}, "nodes": nodes,
                           "data": {"path": "/d", "tokenizer": "bytes", "seqLen": 128},
                           "train": {"steps": 3000, "globalBatch": 256}}
    if per_node:
        raw["processesPerNode"] = per_node
    assert parse_spec(raw).parallelism.tensor == tensor


def test_the_default_spec_is_valid_as_written() -> None:
    """Only the data and the run length: 7B on one trn1.32xlarge, the paper's tp 8."""
    spec = parse_spec({"data": {"path": "/d", "tokenizer": "t"}, "train": {"steps": 10000}})
    assert (spec.parallelism.tensor, spec.data_parallel) == (8, 4)


def test_example_manifest_is_valid() -> None:
    job = load_job(EXAMPLES / "pretrainjob-tiny.yaml")
    assert job.name == "tiny"
    assert job.spec.world_size == 2 and job.spec.model.preset == "tiny"  # 2 CPU nodes


def test_docs_memory_table_is_current() -> None:
    from hlat_api.memory import table

    docs = (Path(__file__).parents[2] / "docs" / "neuron.md").read_text()
    assert table() in docs, "run: .venv/bin/python -c 'from hlat_api.memory import table; print(table())'"


def test_a_float_without_a_dot_reads_as_kubectl_reads_it(tmp_path: Path) -> None:
    """`3e-4` is a number to kubectl (sigs.k8s.io/yaml) and a string to plain PyYAML; read
    strictly, the same file must not be valid in one place and refused in the other."""
    from hlat_api.manifest import load_job

    doc = tmp_path / "job.yaml"
    doc.write_text("data: {path: /d, tokenizer: bytes}\ntrain: {steps: 4000}\n"
                   "optimizer: {lr: 3e-4, minLr: 3E-5}\n")
    spec = load_job(doc).spec
    assert spec.optimizer.lr == 3e-4 and spec.optimizer.min_lr == 3e-5
    quoted = tmp_path / "quoted.yaml"
    quoted.write_text("data: {path: /d, tokenizer: bytes}\ntrain: {steps: '4000'}\n")
    with pytest.raises(InvalidSpecError, match=r"train\.steps"):
        load_job(quoted)


def test_nulls_and_whole_floats_read_as_the_api_server_stores_them(tmp_path: Path) -> None:
    """The API server prunes a null for a field that cannot be null (its default applies) and
    stores `2.0` for an integer field as 2 (found by test_e2e_crd_agreement): locally too."""
    from hlat_api.manifest import load_job

    doc = tmp_path / "job.yaml"
    doc.write_text("nodes:\ninstanceType: cpu\nprocessesPerNode: 2.0\n"
                   "data: {path: /d, tokenizer: bytes, seqLen: null}\n"
                   "train: {steps: 4000.0, globalBatch: 8, microBatch: 4}\n"
                   "parallelism: {tensor: null}\n"
                   "scheduling: {tolerations: [{key: k, operator: Exists, effect: null}]}\n")
    spec = load_job(doc).spec
    assert (spec.nodes, spec.processes_per_node, spec.train.steps) == (1, 2, 4000)
    assert spec.data.seq_len == parse_spec({"data": {"path": "/d", "tokenizer": "bytes"},
                                            "train": {"steps": 4000}}).data.seq_len
    assert spec.scheduling.tolerations[0].effect is None  # nullable: kept as null
    for bad, field in (("nodes: 2.5", "nodes"), ("nodes: 9007199254740992.0", "nodes"),
                       ("train: {steps: true}", "train.steps")):
        doc.write_text(f"data: {{path: /d, tokenizer: bytes}}\n{bad}\n"
                       + ("" if bad.startswith("train") else "train: {steps: 4000}\n"))
        with pytest.raises(InvalidSpecError, match=field.replace(".", r"\.")):
            load_job(doc)


def test_the_sizes_a_job_can_train_at_keep_its_global_batch() -> None:
    """The paper's 7B on 64 trn1.32xlarge (TP 8: 4 data-parallel ranks a node, 1,024 sequences
    of micro-batch 1) can lose a node to 63: 252 ranks do not divide 1,024 micro-batches, so
    the first 16 ranks train 5 and the others 4, and a step takes 5/4 as long (32 nodes, the
    largest size that divides them, would take twice as long)."""
    seven = parse_spec(paper_7b())
    assert seven.sizes() == list(range(64, 0, -1))
    assert seven.sizes(min_nodes=20) == list(range(64, 19, -1))
    assert seven.speed_at(64) == 1 and seven.speed_at(63) == 0.8 and seven.speed_at(32) == 0.5
    assert seven.speed_at(52) == 0.8 and seven.speed_at(51) == 4 / 6  # 204 ranks: up to 6
    at63 = parse_spec(paper_7b(nodes=63))
    assert at63.uneven and not seven.uneven
    assert [at63.micro_batches(r) for r in (0, 15, 16, 251)] == [5, 5, 4, 4]
    assert sum(at63.micro_batches(r) for r in range(252)) == 1024
    assert at63.grad_accum_steps == 5 and seven.grad_accum_steps == 4
    # 3 CPU nodes of one rank, 12 sequences of 2 (6 micro-batches): every size holds them
    tiny = parse_spec({**paper_7b(nodes=3, instanceType="cpu", processesPerNode=1,
                                  train__globalBatch=12, train__microBatch=2, data__seqLen=64),
                       "model": {"preset": "tiny"}, "parallelism": {"tensor": 1}})
    assert tiny.sizes() == [3, 2, 1] and tiny.sizes(2) == [3, 2]


def test_an_elastic_spec_takes_the_size_of_the_world_its_trainers_were_started_in() -> None:
    """The trainers of a job resized in place read the spec as written (3 nodes, elastic) and
    are started in a world of 2 nodes' ranks: they train the spec at 2 nodes. A world the spec
    allows no size for, or a spec that is not elastic, is left as it is (the world check then
    names the mismatch)."""
    raw = {**paper_7b(nodes=3, instanceType="cpu", processesPerNode=2, train__globalBatch=12,
                      train__microBatch=2, data__seqLen=64),
           "model": {"preset": "tiny"}, "parallelism": {"tensor": 1},
           "elastic": {"minNodes": 2}}
    written = parse_spec(raw)
    at_two = written.at_world(4)
    assert (at_two.nodes, at_two.elastic, at_two.world_size) == (2, None, 4)
    assert at_two.train == written.train  # the same global batch: more accumulation
    assert written.at_world(6) is written  # its own size
    assert written.at_world(2) is written  # 1 node: below minNodes
    assert written.at_world(5) is written  # not whole nodes
    rigid = parse_spec({k: v for k, v in raw.items() if k != "elastic"})
    assert rigid.at_world(4) is rigid


@pytest.mark.parametrize("micro_batches", [1, 5, 12, 1024])
def test_every_micro_batch_of_a_step_goes_to_exactly_one_rank_in_order(micro_batches: int
                                                                       ) -> None:
    """At every data-parallel degree up to the micro-batches: the ranks' shares, in rank
    order, are the step's micro-batches in order, none twice, none left out, and no rank has
    more than one more than another."""
    for dp in range(1, min(micro_batches, 300) + 1):
        shares = [micro_batch_share(micro_batches, dp, r) for r in range(dp)]
        assert [m for share in shares for m in share] == list(range(micro_batches)), dp
        assert max(map(len, shares)) - min(map(len, shares)) <= (micro_batches % dp > 0)
