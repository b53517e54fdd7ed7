"""The Neuron environment and compile-only prefix computed from the spec (pure functions), and
the root communicator's address (resolved, bounded)."""

from __future__ import annotations

import itertools
import socket
from typing import Any

import pytest

from hlat_api import PretrainJobSpec, labels, parse_spec
from hlat_trainer import neuron_env
from hlat_trainer.neuron_env import (
    EFA_ENV,
    RootCommError,
    cache_url_conflict,
    check_neuron_driver,
    compile_command_prefix,
    compiler_flags,
    extracting_graphs_only,
    neuron_runtime_environment,
    resolve_ip,
    root_comm_id,
    root_comm_port,
    shared_cache_dir,
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
        "NEURON_CC_FLAGS": "--model-type=transformer --distribution-strategy=llm-training "
                           "--cache_dir=/var/tmp/neuron-compile-cache",
        "NEURON_COMPILE_CACHE_URL": "/var/tmp/neuron-compile-cache",
        "NEURON_RT_EXEC_TIMEOUT": "4000",
        "XLA_DISABLE_FUNCTIONALIZATION": "0",
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


@pytest.mark.parametrize(("instance", "cores", "lnc"), [
    ("trn1.32xlarge", "32", None), ("trn1n.32xlarge", "32", None), ("trn2.48xlarge", "64", "2"),
])
def test_the_paper_s_flags_on_every_instance_and_cores_per_instance(
    instance: str, cores: str, lnc: str | None
) -> None:
    """The paper's compiler section: --distribution-strategy=llm-training and
    --model-type=transformer; no --enable-saturate-infinity added behind the spec's back (the
    paper's scripts ran without it, the compiler reference warns of its cost)."""
    flags = worker_environment(make_spec(instance), nnodes=1)["NEURON_CC_FLAGS"].split()
    assert flags[:2] == ["--model-type=transformer", "--distribution-strategy=llm-training"]
    assert "--enable-saturate-infinity" not in flags
    env = worker_environment(make_spec(instance), nnodes=1)
    assert env["NEURON_RT_NUM_CORES"] == cores
    assert env.get("NEURON_LOGICAL_NC_CONFIG") == lnc


def test_flags_the_spec_asks_for_are_kept() -> None:
    own = ["--model-type=transformer", "--enable-saturate-infinity", "-O1"]
    assert compiler_flags(make_spec(neuron__compilerFlags=own))[:-1] == own


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


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_checkpointing_does_not_force_O1(mode: str) -> None:
    """NxD's checkpoint wrapper (neuronx-distributed src/neuronx_distributed/utils/
    activation_checkpoint.py:37-46) is torch-xla's checkpoint, whose backward puts an
    optimization barrier before the recompute (torch-xla v2.9.0 torch_xla/utils/
    checkpoint.py:168-177), so the compiler keeps it at the default level; -O1 would slow every
    step for nothing."""
    flags = compiler_flags(make_spec(parallelism__activationCheckpointing=mode))
    assert not [f for f in flags if f.startswith("-O") or f.startswith("--optlevel")]


def test_exec_timeout_outlasts_a_peer_s_compile_and_follows_the_spec() -> None:
    """The runtime's default (30 s / 600 s) times out every peer of a node still compiling;
    the paper's scripts set 4000 s."""
    assert neuron_runtime_environment(make_spec())["NEURON_RT_EXEC_TIMEOUT"] == "4000"
    env = neuron_runtime_environment(make_spec(neuron__execTimeoutSeconds=7200))
    assert env["NEURON_RT_EXEC_TIMEOUT"] == "7200"


@pytest.mark.parametrize(("instance", "backend"), [("trn1.32xlarge", "neuron-xla"),
                                                   ("trn2.48xlarge", "neuron-native")])
def test_functionalization_is_on(instance: str, backend: str) -> None:
    """torch-neuronx's default (1) gives wrong values for split views (pytorch/xla#8640)."""
    env = worker_environment(make_spec(instance, backend=backend), nnodes=1)
    assert env["XLA_DISABLE_FUNCTIONALIZATION"] == "0"


def test_fuse_softmax_and_inflight_follow_the_spec() -> None:
    env = worker_environment(make_spec(neuron__fuseSoftmax=False,
                                       neuron__asyncExecMaxInflightRequests=7), nnodes=1)
    assert env["NEURON_FUSE_SOFTMAX"] == "0"
    assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "7"


@pytest.mark.parametrize(("instance", "backend"), [("cpu", "auto"), ("cpu", "cpu")])
def test_cpu_gets_no_device_environment(instance: str, backend: str) -> None:
    spec = make_spec(instance, nodes=2, backend=backend, train__globalBatch=64)
    assert worker_environment(spec, nnodes=2) == {"OMP_NUM_THREADS": "1"}  # the thread rule below


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


# --- the shared compile cache and NEURON_COMPILE_CACHE_URL -----------------------------------


def test_the_shared_cache_defaults_beside_the_checkpoints_and_can_be_named_or_turned_off() -> None:
    assert shared_cache_dir(make_spec(checkpoint__dir="/fsx/ckpt/")) == (
        "/fsx/ckpt/.neuron-compile-cache")
    assert shared_cache_dir(make_spec(neuron__sharedCacheDir="/fsx/ncc")) == "/fsx/ncc"
    assert shared_cache_dir(make_spec(neuron__shareCache=False)) is None
    assert shared_cache_dir(make_spec("cpu", train__globalBatch=4)) is None


def test_a_shared_cache_equal_to_the_local_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"spec\.neuron\.sharedCacheDir: must differ"):
        make_spec(neuron__sharedCacheDir="/var/tmp/neuron-compile-cache")


@pytest.mark.parametrize(("env", "conflict"), [
    ({}, False),
    ({"NEURON_COMPILE_CACHE_URL": "/var/tmp/neuron-compile-cache/"}, False),
    ({"NEURON_COMPILE_CACHE_URL": "s3://bucket/cache"}, True),  # --cache_dir would win
    ({"NEURON_COMPILE_CACHE_URL": "s3://bucket/cache", "NEURON_CC_FLAGS": "-O2"}, False),
])
def test_a_cache_url_the_compiler_would_ignore_is_named(env: dict[str, str],
                                                        conflict: bool) -> None:
    problem = cache_url_conflict(env, make_spec())
    assert (problem is not None) is conflict
    if conflict:
        assert "sharedCacheDir" in problem and "--cache_dir" in problem  # type: ignore[operator]


# --- NEURON_RT_ROOT_COMM_ID ------------------------------------------------------------------


def test_root_comm_id_is_an_ip_and_port() -> None:
    assert root_comm_id("10.1.2.3", 0) == "10.1.2.3:48620"
    assert root_comm_id("localhost", 0).split(":")[0] in ("127.0.0.1", "[::1]")
    six = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::5", 0, 0, 0))]
    assert root_comm_id("llama-0.llama", 1, resolve=lambda *a, **k: six) == "[fd00::5]:48621"


def test_root_comm_ports_differ_between_attempts_and_are_all_reserved() -> None:
    low, high = (int(p) for p in labels.NEURON_RESERVED_PORTS.split("-"))
    ports = [root_comm_port(a) for a in range(40)]
    assert all(low <= p <= high for p in ports)
    assert all(a != b for a, b in itertools.pairwise(ports))


def test_an_address_that_resolves_late_is_waited_for_within_the_bound() -> None:
    now = [0.0]
    calls = []

    def resolve(host: str, *_: Any, **__: Any) -> list[tuple[Any, ...]]:
        calls.append(now[0])
        if now[0] < 3:
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 0))]

    def sleep(s: float) -> None:
        now[0] += s

    assert resolve_ip("llama-0.llama", resolve=resolve, sleep=sleep, clock=lambda: now[0],
                      bound=10) == "10.0.0.7"
    assert len(calls) > 2


def test_an_address_that_never_resolves_is_a_clear_error_at_the_bound() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    def never(*_: Any, **__: Any) -> list[tuple[Any, ...]]:
        raise socket.gaierror(-2, "Name or service not known")

    with pytest.raises(RootCommError, match=r"'llama-0.llama' \(\$HLAT_MASTER_ADDR\).*30s"):
        resolve_ip("llama-0.llama", resolve=never, sleep=sleep, clock=lambda: now[0], bound=30)
    assert 30 <= now[0] < 36
    assert neuron_env.RESOLVE_SECONDS >= 60  # a pod's record may take a while to appear


def test_a_rig_cpu_worker_computes_on_one_thread_and_an_accelerator_node_keeps_torchrun_s_rule(
) -> None:
    """The rig runs several `cpu` nodes on one host: each rank gets one intra-op thread, or one
    node's pause would speed up its neighbours (their compute times, which the straggler
    detector compares, would move together). Accelerator nodes are left to torchrun's rule."""
    cpu = make_spec("cpu", nodes=2, train__globalBatch=4, processesPerNode=1)
    assert worker_environment(cpu)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in worker_environment(make_spec("trn1.32xlarge", nodes=2))
    from hlat_api.env import Env
    from hlat_trainer.launch import build_command
    _, extra = build_command({Env.CONFIG: "/job.yaml", "OMP_NUM_THREADS": "4",
                                Env.NODE_RANK: "0", Env.MASTER_ADDR: "10.0.0.1",
                                Env.MASTER_PORT: "29500"}, cpu)
    assert "OMP_NUM_THREADS" not in extra  # the user's own (the pod template's env) is kept


def _sysfs(tmp_path: Any, **files: str) -> Any:
    """A directory standing for the Neuron driver's /sys/class/neuron_device on a trn2u node."""
    root = tmp_path / "neuron_device"
    root.mkdir()
    for name, value in files.items():
        (root / name).write_text(value + "\n")
    return root


@pytest.mark.parametrize(("nnodes", "config"), [(4, 4), (8, 4), (2, 2), (6, 2), (3, 1), (1, 1)])
def test_the_ultraserver_group_is_the_largest_of_4_2_1_dividing_the_nodes(
        nnodes: int, config: int) -> None:
    assert neuron_env.ultraserver_node_config(nnodes, {}) == config


def test_a_node_config_the_pod_sets_must_divide_the_nodes() -> None:
    assert neuron_env.ultraserver_node_config(8, {"NEURON_ULTRASERVER_NODE_CONFIG": "2"}) == 2
    with pytest.raises(neuron_env.UltraServerError, match="not a multiple"):
        neuron_env.ultraserver_node_config(6, {"NEURON_ULTRASERVER_NODE_CONFIG": "4"})
    with pytest.raises(neuron_env.UltraServerError, match="must be 1, 2 or 4"):
        neuron_env.ultraserver_node_config(8, {"NEURON_ULTRASERVER_NODE_CONFIG": "8"})


@pytest.mark.parametrize(("modes", "mode"), [("1 2 3 4", "3"), ("1_2_4", "2"), ("2\n4", "2")])
def test_two_nodes_take_the_vertical_pair_where_the_driver_offers_it(
        tmp_path: Any, modes: str, mode: str) -> None:
    """AWS's init script: 2 nodes -> X2V (3) if listed, else X2H (2); the files of the
    2-node group, server_id_2 and node_id_2."""
    root = _sysfs(tmp_path, ultraserver_mode=modes, server_id_2="u5wy80u0o2saugxy",
                  node_id_2="1", server_id_4="bog79p1y8tetj5uu", node_id_4="3")
    got = neuron_env.ultraserver_environment(3, 6, "job-0.job", {}, root)
    assert got == {"NEURON_GLOBAL_TOPOID": "3", "NEURON_GLOBAL_TOPOID0_HOST": "job-0.job",
                   "NEURON_RT_ULTRASERVER_MODE": mode,
                   "NEURON_RT_ULTRASERVER_SERVER_ID": "u5wy80u0o2saugxy",
                   "NEURON_RT_ULTRASERVER_NODE_ID": "1"}


def test_a_node_without_the_group_or_the_mode_is_refused_naming_the_file(tmp_path: Any) -> None:
    root = _sysfs(tmp_path, ultraserver_mode="4")  # standalone only: no 4-node group
    with pytest.raises(neuron_env.UltraServerError, match="does not offer the 4-node"):
        neuron_env.ultraserver_environment(0, 4, "job-0.job", {}, root)
    (root / "ultraserver_mode").write_text("1 2 3 4\n")
    with pytest.raises(neuron_env.UltraServerError, match="server_id_4"):
        neuron_env.ultraserver_environment(0, 4, "job-0.job", {}, root)
    # one node: the standalone mode, no group needed (the script's X1)
    alone = neuron_env.ultraserver_environment(0, 1, "job-0.job", {}, root)
    assert alone["NEURON_RT_ULTRASERVER_MODE"] == "4"
    assert alone["NEURON_RT_ULTRASERVER_NODE_ID"] == "-1"
