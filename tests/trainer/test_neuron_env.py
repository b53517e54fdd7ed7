"""The Neuron environment and compile-only prefix computed from the spec (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest

from hlat_api import PretrainJobSpec, parse_spec
from hlat_trainer.neuron_env import (
    EFA_ENV,
    check_neuron_driver,
    compile_command_prefix,
    compiler_flags,
    extracting_graphs_only,
    worker_environment,
)


def make_spec(instance: str = "trn1.32xlarge", nodes: int = 1, **over: Any) -> PretrainJobSpec:
    raw: dict[str, Any] = {
        "instanceType": instance, "nodes": nodes, "model": {"preset": "tiny"},
        "data": {"path": "/fsx/data", "tokenizer": "bytes", "seqLen": 128},
        "train": {"globalBatch": 512, "steps": 10}, "optimizer": {"warmupSteps": 1},
    }
    for key, value in over.items():
        node = raw
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return parse_spec(raw)


def test_trn1_single_node_has_the_paper_settings_and_no_efa() -> None:
    env = worker_environment(make_spec("trn1.32xlarge"), nnodes=1)
    assert env == {
        "NEURON_CC_FLAGS": "--model-type=transformer --enable-saturate-infinity "
                           "--cache_dir=/var/tmp/neuron-compile-cache",
        "NEURON_COMPILE_CACHE_URL": "/var/tmp/neuron-compile-cache",
        "NEURON_FUSE_SOFTMAX": "1",
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "3",
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1",
        "NEURON_RT_STOCHASTIC_ROUNDING_SEED": "1",
        "MALLOC_ARENA_MAX": "64",
        "NEURON_RT_NUM_CORES": "32",
    }


@pytest.mark.parametrize("instance", ["trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"])
def test_efa_variables_only_when_multi_node(instance: str) -> None:
    spec = make_spec(instance, nodes=4)
    multi = worker_environment(spec, nnodes=4)
    assert {k: multi[k] for k in EFA_ENV} == dict(EFA_ENV)
    assert multi["CCOM_SOCKET_IFNAME"] == "eth0" and multi["FI_PROVIDER"] == "efa"
    single = worker_environment(spec, nnodes=1)  # e.g. a one-node compile run of the same spec
    assert not set(EFA_ENV) & set(single)


def test_nnodes_defaults_to_the_spec() -> None:
    assert "FI_PROVIDER" in worker_environment(make_spec("trn1.32xlarge", nodes=2))


def test_instance_without_efa_gets_no_efa_variables() -> None:
    spec = make_spec("trn1.2xlarge", nodes=2, train__globalBatch=4)  # no EFA interfaces
    assert "FI_PROVIDER" not in worker_environment(spec, nnodes=2)


@pytest.mark.parametrize(("instance", "saturate", "cores"), [
    ("trn1.32xlarge", True, "32"), ("trn1n.32xlarge", True, "32"), ("trn2.48xlarge", False, "64"),
])
def test_saturate_infinity_on_trn1_only_and_cores_per_instance(
    instance: str, saturate: bool, cores: str
) -> None:
    env = worker_environment(make_spec(instance), nnodes=1)
    assert ("--enable-saturate-infinity" in env["NEURON_CC_FLAGS"].split()) is saturate
    assert env["NEURON_RT_NUM_CORES"] == cores
    assert env.get("NEURON_LOGICAL_NC_CONFIG") == (None if saturate else "2")


@pytest.mark.parametrize(("precision", "sr"), [("bf16-sr", "1"), ("bf16", "0"), ("mixed", "0"),
                                               ("fp32", "0")])
def test_stochastic_rounding_only_for_bf16_sr(precision: str, sr: str) -> None:
    env = worker_environment(make_spec(precision=precision, train__seed=42), nnodes=1)
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == sr
    assert env.get("NEURON_RT_STOCHASTIC_ROUNDING_SEED") == ("42" if sr == "1" else None)


def test_cache_dir_is_the_local_one_from_the_spec_and_last() -> None:
    spec = make_spec(neuron__cacheDir="/local/ncc",
                     neuron__compilerFlags=["--model-type=transformer", "--cache_dir=/fsx/cc"])
    flags = compiler_flags(spec)
    assert flags[-1] == "--cache_dir=/local/ncc"
    assert sum(f.startswith("--cache_dir") for f in flags) == 1  # the shared one is dropped


def test_selective_checkpointing_adds_O1_unless_a_level_is_given() -> None:
    sel = make_spec(parallelism__activationCheckpointing="selective")
    assert "-O1" in compiler_flags(sel)
    assert "-O1" not in compiler_flags(make_spec(parallelism__activationCheckpointing="full"))
    own = make_spec(parallelism__activationCheckpointing="selective",
                    neuron__compilerFlags=["--model-type=transformer", "-O2"])
    assert [f for f in compiler_flags(own) if f.startswith("-O")] == ["-O2"]


def test_fuse_softmax_and_inflight_follow_the_spec() -> None:
    env = worker_environment(make_spec(neuron__fuseSoftmax=False,
                                       neuron__asyncExecMaxInflightRequests=7), nnodes=1)
    assert env["NEURON_FUSE_SOFTMAX"] == "0"
    assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "7"


@pytest.mark.parametrize(("instance", "backend"), [("cpu", "auto"), ("cpu", "cpu")])
def test_cpu_gets_no_device_environment(instance: str, backend: str) -> None:
    spec = make_spec(instance, nodes=2, backend=backend, train__globalBatch=64)
    assert worker_environment(spec, nnodes=2) == {}


def test_gpus_get_only_efa_and_only_across_nodes() -> None:
    spec = make_spec("p5.48xlarge", nodes=2, train__globalBatch=64)
    assert worker_environment(spec, nnodes=2) == dict(EFA_ENV)
    assert worker_environment(spec, nnodes=1) == {}


def test_neuron_native_gets_the_runtime_environment_too() -> None:
    env = worker_environment(make_spec("trn2.48xlarge", backend="neuron-native"), nnodes=1)
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"


def test_compile_only_prefix() -> None:
    assert compile_command_prefix(make_spec()) == []
    assert compile_command_prefix(make_spec(neuron__compileOnly=True)) == [
        "neuron_parallel_compile"]
    with pytest.raises(ValueError, match="compileOnly needs backend neuron-xla"):
        compile_command_prefix(make_spec("cpu", neuron__compileOnly=True, train__globalBatch=4))


def test_extracting_graphs_only_reads_the_tools_variable() -> None:
    assert extracting_graphs_only({"NEURON_EXTRACT_GRAPHS_ONLY": "1"})
    assert not extracting_graphs_only({"NEURON_EXTRACT_GRAPHS_ONLY": "0"})
    assert not extracting_graphs_only({})


@pytest.mark.parametrize(("version", "ok"), [
    ("2.26.5.0", False), ("2.19.64.0", False), ("2.27.0.0", True), ("2.30.1.0", True),
    ("3.0.0", True), (None, True),
])
def test_neuron_driver_older_than_the_image_needs_is_named(version: str | None, ok: bool) -> None:
    problem = check_neuron_driver(version)
    assert (problem is None) is ok
    if not ok:
        assert version in problem and "aws-neuronx-dkms" in problem  # type: ignore[operator]
