"""Manifests, bare specs and `--set` overrides, with errors that say what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hlat_api import InvalidSpecError, apply_overrides, load_job

SPEC = {
    "instanceType": "cpu",
    "model": {"preset": "tiny"},
    "data": {"path": "/data", "tokenizer": "bytes", "seqLen": 64},
    "train": {"steps": 10, "globalBatch": 4},
    "optimizer": {"warmupSteps": 2},
}


def write(tmp_path: Path, doc: object, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_manifest_and_bare_spec_give_the_same_spec(tmp_path: Path) -> None:
    manifest = {"apiVersion": "hlat.dev/v1alpha1", "kind": "PretrainJob",
                "metadata": {"name": "run-a"}, "spec": SPEC}
    a = load_job(write(tmp_path, manifest))
    b = load_job(write(tmp_path, SPEC, "bare.yaml"))
    assert a.spec == b.spec
    assert (a.name, b.name) == ("run-a", "bare")


def test_set_overrides_use_camel_case_paths_and_yaml_values(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, SPEC), [
        "train.steps=40", "checkpoint.dir=/tmp/ck", "checkpoint.interval=20",
        "data.path=/elsewhere", "optimizer.betas=[0.9, 0.99]", "checkpoint.async=false",
    ])
    s = job.spec
    assert (s.train.steps, s.checkpoint.dir, s.checkpoint.interval) == (40, "/tmp/ck", 20)
    assert (s.data.path, s.optimizer.betas, s.checkpoint.async_) == ("/elsewhere", (0.9, 0.99), False)


@pytest.mark.parametrize(("override", "message"), [
    ("train.stpes=4", "unknown key 'stpes'; train has: globalBatch, logInterval"),
    ("trian.steps=4", "unknown key 'trian'; spec has:"),
    ("train.steps.x=4", "has no sub-keys"),
    ("train.steps", "expected key.path=value"),
    ("train.steps=-3", "spec.train.steps: Input should be greater than or equal to 1"),
])
def test_bad_overrides_are_explained(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_job(write(tmp_path, SPEC), [override])


def test_override_creates_missing_sections() -> None:
    raw: dict[str, object] = {}
    apply_overrides(raw, ["faultTolerance.backoff.maxSeconds=5"])
    assert raw == {"faultTolerance": {"backoff": {"maxSeconds": 5}}}


def test_override_reaches_into_an_optional_section() -> None:
    """`eval` is optional (EvalSpec | None): its keys are set like any other section's (a
    precompile runs the real spec with `--set eval.interval=...`), and checked as strictly."""
    raw: dict[str, object] = {"eval": {"path": "/held-out"}}
    apply_overrides(raw, ["eval.interval=100"])
    assert raw == {"eval": {"path": "/held-out", "interval": 100}}
    with pytest.raises(InvalidSpecError, match="unknown key 'intervall'; eval has: batches"):
        apply_overrides(raw, ["eval.intervall=100"])


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match=r"missing\.yaml: file not found"):
        load_job(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(InvalidSpecError, match=r"bad\.yaml: not valid YAML"):
        load_job(bad)
    with pytest.raises(InvalidSpecError, match="expected PretrainJob"):
        load_job(write(tmp_path, {"kind": "Deployment", "spec": {}}))


def test_an_ultraserver_job_takes_no_spare_nodes(tmp_path: Path) -> None:
    """A spare cannot stand in for one of an UltraServer's NeuronLink-joined nodes (the
    launcher would refuse its node id at the promotion, failing the job then)."""
    spec = {**SPEC, "instanceType": "trn2u.48xlarge", "nodes": 4,
            "train": {"steps": 10, "globalBatch": 256},
            "faultTolerance": {"spareNodes": 1}}
    with pytest.raises(InvalidSpecError,
                       match=r"faultTolerance\.spareNodes: trn2u\.48xlarge takes no spare"):
        load_job(write(tmp_path, spec))
    spec["faultTolerance"] = {"spareNodes": 0}
    assert load_job(write(tmp_path, spec)).spec.instance_type == "trn2u.48xlarge"


@pytest.mark.parametrize(("nodes", "size"), [(8, 4), (4, 4), (6, 2), (3, None)])
def test_an_ultraserver_job_is_placed_on_whole_groups_unless_its_topology_says_otherwise(
        tmp_path: Path, nodes: int, size: int | None) -> None:
    """trn2u.48xlarge without scheduling.topology: whole groups of the size its launchers run
    (the largest of 4 and 2 dividing nodes), ranks by server then node id; an odd count runs
    one node per group and needs none. A topology the spec gives, or an elastic job, is left
    as it is."""
    spec = {**SPEC, "instanceType": "trn2u.48xlarge", "nodes": nodes,
            "train": {"steps": 10, "globalBatch": 64 * nodes}}
    topo = load_job(write(tmp_path, spec)).spec.scheduling.topology
    if size is None:
        assert topo is None
        return
    assert topo is not None
    server = f"neuron.amazonaws.com/ultraserver-server-id-{size}"
    assert (topo.preferred, topo.slice_size) == (server, size)
    assert topo.levels == [server, f"neuron.amazonaws.com/ultraserver-node-id-{size}"]
    own = {"preferred": "topology.k8s.aws/network-node-layer-3"}
    given = load_job(write(tmp_path, {**spec, "scheduling": {"topology": own}}))
    assert given.spec.scheduling.topology is not None
    assert given.spec.scheduling.topology.slice_size is None
    elastic = {**spec, "backend": "neuron-native",
               "elastic": {"minNodes": nodes // 2, "waitSeconds": 60}}
    assert load_job(write(tmp_path, elastic)).spec.scheduling.topology is None
