"""hlat-launch: the operator's environment -> the torchrun line (pure), and main's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hlat_api import Env, ExitCode, PretrainJobSpec, parse_spec
from hlat_trainer import launch, neuron_env
from hlat_trainer.launch import LaunchError, build_command

CONFIG = "/etc/hlat/spec.json"


def spec_raw(instance: str = "trn1.32xlarge", nodes: int = 4, **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "instanceType": instance, "nodes": nodes, "model": {"preset": "tiny"},
        "data": {"path": "/fsx/data", "tokenizer": "bytes", "seqLen": 128},
        "train": {"globalBatch": 512, "steps": 10}, "optimizer": {"warmupSteps": 1},
    }
    raw.update(over)
    return raw


def make_spec(instance: str = "trn1.32xlarge", nodes: int = 4, **over: Any) -> PretrainJobSpec:
    return parse_spec(spec_raw(instance, nodes, **over))


def pod_env(**over: str) -> dict[str, str]:
    """What the operator sets in node rank 2's pod of a 4-node trn1 job."""
    env = {
        Env.CONFIG: CONFIG, Env.NNODES: "4", Env.NODE_RANK: "2", Env.NPROC_PER_NODE: "32",
        Env.MASTER_ADDR: "llama-0.llama.ml.svc", Env.MASTER_PORT: "29500",
        Env.JOB_NAME: "llama", "PATH": "/usr/bin",
    }
    env.update(over)
    return {str(k): v for k, v in env.items()}


def test_multi_node_command_and_environment() -> None:
    argv, extra = build_command(pod_env(), make_spec())
    assert argv == [
        "torchrun", "--nnodes", "4", "--nproc-per-node", "32", "--node-rank", "2",
        "--master-addr", "llama-0.llama.ml.svc", "--master-port", "29500", "--max-restarts", "0",
        "-m", "hlat_trainer", "--config", CONFIG,
    ]
    assert extra["FI_PROVIDER"] == "efa"
    assert extra["NEURON_CC_FLAGS"].endswith("--cache_dir=/var/tmp/neuron-compile-cache")
    assert extra["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"


def test_the_environment_s_own_values_win() -> None:
    _, extra = build_command(pod_env(NEURON_CC_FLAGS="--model-type=transformer -O2"), make_spec())
    assert "NEURON_CC_FLAGS" not in extra and "NEURON_FUSE_SOFTMAX" in extra


def test_single_node_is_standalone_and_needs_no_rendezvous_vars() -> None:
    env = {Env.CONFIG.value: CONFIG, Env.NNODES.value: "1", Env.NPROC_PER_NODE.value: "2"}
    argv, extra = build_command(env, make_spec("cpu", 1, train={"globalBatch": 4, "steps": 2}))
    assert argv == ["torchrun", "--nnodes", "1", "--nproc-per-node", "2", "--standalone",
                    "--max-restarts", "0", "-m", "hlat_trainer", "--config", CONFIG]
    assert extra == {"OMP_NUM_THREADS": "1"}  # cpu: no Neuron environment; one thread a rank


def test_nodes_and_processes_default_to_the_spec() -> None:
    argv, _ = build_command({Env.CONFIG.value: CONFIG}, make_spec("trn1.32xlarge", 1))
    assert argv[:5] == ["torchrun", "--nnodes", "1", "--nproc-per-node", "32"]


def test_compile_only_prefixes_neuron_parallel_compile_and_passes_trainer_args() -> None:
    spec = make_spec(neuron={"compileOnly": True})
    argv, _ = build_command(pod_env(), spec, ["--set", "train.steps=4"])
    assert argv[:2] == ["neuron_parallel_compile", "torchrun"]
    assert argv[-3:] == [CONFIG, "--set", "train.steps=4"]


@pytest.mark.parametrize(("env", "message"), [
    (pod_env(**{Env.CONFIG: ""}), "$HLAT_CONFIG is not set"),
    (pod_env(**{Env.NNODES: "four"}), "$HLAT_NNODES='four' is not an integer"),
    (pod_env(**{Env.NNODES: "0"}), "$HLAT_NNODES=0 must be at least 1"),
    (pod_env(**{Env.NPROC_PER_NODE: "-1"}), "$HLAT_NPROC_PER_NODE=-1 must be at least 1"),
    (pod_env(**{Env.NODE_RANK: "4"}), "$HLAT_NODE_RANK=4 must be below $HLAT_NNODES=4"),
    (pod_env(**{Env.MASTER_ADDR: ""}), "$HLAT_MASTER_ADDR is not set"),
    (pod_env(**{Env.MASTER_PORT: "70000"}), "$HLAT_MASTER_PORT=70000 is not a TCP port"),
])
def test_bad_environment_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError) as err:
        build_command(env, make_spec())
    assert message in str(err.value)


def test_missing_node_rank_is_named() -> None:
    env = pod_env()
    del env[Env.NODE_RANK]
    with pytest.raises(LaunchError, match=r"\$HLAT_NODE_RANK is not set"):
        build_command(env, make_spec())


def test_compile_only_off_neuron_is_a_launch_error() -> None:
    spec = make_spec("cpu", 1, train={"globalBatch": 4, "steps": 2}, neuron={"compileOnly": True})
    with pytest.raises(LaunchError, match="compileOnly needs backend neuron-xla"):
        build_command({Env.CONFIG.value: CONFIG}, spec)


# --- main: reads the real environment and the config file -------------------------------------


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    """A 4-node trn1 spec whose node-local and shared compile caches are under tmp_path."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec_raw(
        checkpoint={"dir": str(tmp_path / "fsx")},
        neuron={"cacheDir": str(tmp_path / "local-cache")})))
    return path


def _set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for var in Env:
        monkeypatch.delenv(var.value, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_main_runs_torchrun_with_the_merged_environment(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file), Env.MASTER_ADDR: "localhost",
                                     Env.ATTEMPT: "17"}))
    monkeypatch.delenv("FI_PROVIDER", raising=False)
    monkeypatch.delenv("NEURON_RT_ROOT_COMM_ID", raising=False)
    seen: dict[str, Any] = {}

    def fake_supervise(args: list[str], env: dict[str, str], exit_file: Path) -> int:
        seen.update(file=args[0], args=args, env=env)
        return 0

    monkeypatch.setattr(launch, "supervise", fake_supervise)
    assert launch.main([]) == 0
    assert seen["file"] == "torchrun" and seen["args"][-1] == str(config_file)
    assert seen["env"]["FI_PROVIDER"] == "efa" and seen["env"][Env.JOB_NAME] == "llama"
    # torchrun (and so the trainer) is the one beside hlat-launch, not whatever PATH finds
    # first (the local rig's kubelets may have been started from another checkout)
    assert seen["env"]["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert float(seen["env"][Env.LAUNCHED_MONOTONIC]) > 0
    # the runtime's root communicator: node rank 0's IP (not its DNS name) and attempt 17's port
    assert seen["env"]["NEURON_RT_ROOT_COMM_ID"] in ("127.0.0.1:48621", "[::1]:48621")


def test_main_dry_run_prints_the_command(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file)}))
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("dry run must not exec"))
    assert launch.main(["--dry-run", "--", "--set", "train.steps=2"]) == ExitCode.OK
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("torchrun --nnodes 4 --nproc-per-node 32 --node-rank 2")
    assert out[-1].endswith("--set train.steps=2")
    assert "FI_EFA_FORK_SAFE=1" in out


@pytest.mark.parametrize("case", ["no-config-var", "missing-file", "invalid-spec", "bad-var"])
def test_main_config_errors_exit_with_config_error(
    case: str, config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    env = pod_env(**{Env.CONFIG: str(config_file)})
    expected = {"no-config-var": "HLAT_CONFIG", "missing-file": "file not found",
                "invalid-spec": "spec.nodes", "bad-var": "HLAT_MASTER_PORT"}[case]
    if case == "no-config-var":
        del env[Env.CONFIG]
    elif case == "missing-file":
        env[Env.CONFIG] = str(tmp_path / "absent.json")
    elif case == "invalid-spec":
        config_file.write_text(json.dumps(spec_raw(nodes=0)))
    else:
        env[Env.MASTER_PORT] = "port"
    _set_env(monkeypatch, env)
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("must not exec"))
    assert launch.main([]) == ExitCode.CONFIG_ERROR
    assert expected in capsys.readouterr().err


def test_the_launcher_does_not_import_torch() -> None:
    code = "import sys, hlat_trainer.launch; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_workers_get_the_launcher_s_compiler_flags_through_the_operator_s_pod() -> None:
    """The pod the operator builds, then the launcher in it: the flags and runtime settings the
    launcher computes reach the workers (the pod sets none that would shadow them), and the
    pod reserves the root communicator's ports."""
    from hlat_operator import builders
    from hlat_operator.config import OperatorSettings

    spec = make_spec(nodes=2, parallelism={"activationCheckpointing": "selective"})
    job = builders.JobRef("llama", "ml", "uid-1")
    pod = builders.build_worker_pod(job, spec, 0, 1, OperatorSettings())
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    _, extra = build_command(env, spec)
    merged = {**env, **extra}
    flags = merged["NEURON_CC_FLAGS"].split()
    assert "--distribution-strategy=llm-training" in flags and "-O1" not in flags
    assert merged["NEURON_RT_NUM_CORES"] == "32"
    assert merged["NEURON_RT_EXEC_TIMEOUT"] == "4000"
    assert merged["XLA_DISABLE_FUNCTIONALIZATION"] == "0"
    from hlat_trainer.neuron_env import root_comm_port
    sysctls = {s["name"]: s["value"] for s in pod["spec"]["securityContext"]["sysctls"]}
    low, high = (int(p) for p in sysctls["net.ipv4.ip_local_reserved_ports"].split("-"))
    assert all(low <= root_comm_port(a) <= high for a in range(64))


def test_main_refuses_a_node_whose_neuron_driver_is_too_old(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file)}))
    version = tmp_path / "version"
    version.write_text("2.26.5.0\n")
    monkeypatch.setattr(launch, "NEURON_DRIVER_VERSION_FILE", str(version))
    monkeypatch.setattr(launch, "supervise", lambda *a: pytest.fail("must not start torchrun"))
    # the node's fault, not the job's: the operator avoids the node instead of failing the job
    assert launch.main([]) == ExitCode.NODE_FAULT
    assert "Neuron driver is 2.26.5.0" in capsys.readouterr().err


@pytest.mark.parametrize(("written", "expected"), [
    ("2.26.5.0", ExitCode.NODE_FAULT),  # too old: this node cannot run the image
    (None, None),  # no file: nothing claimed, the launcher goes on
])
def test_a_driver_file_the_pod_names_is_checked_on_any_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str | None,
    expected: int | None,
) -> None:
    """HLAT_NEURON_DRIVER_FILE (the local cluster's per-node stand-in for sysfs) is checked
    whatever the backend; the tiny CPU job would not look at sysfs at all."""
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps(spec_raw("cpu", 1, train={"globalBatch": 4, "steps": 2},
                                          checkpoint={"dir": str(tmp_path / "fsx")})))
    version = tmp_path / "node" / "version"
    if written is not None:
        version.parent.mkdir()
        version.write_text(written + "\n")
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config), Env.NNODES: "1",
                                      Env.NPROC_PER_NODE: "1",
                                      launch.NEURON_DRIVER_FILE_ENV: str(version)}))
    started = []
    monkeypatch.setattr(launch, "supervise", lambda *a: started.append(a) or 0)
    code = launch.main([])
    if expected is None:
        assert code == 0 and started
    else:
        assert code == expected and not started


@pytest.mark.parametrize(("script", "written", "expected"), [
    ("exit 0", None, 0),
    ("exit 1", None, 1),
    ("exit 1", "2", ExitCode.CONFIG_ERROR),  # a worker failed for good; torchrun says 1
    ("exit 1", "4", ExitCode.NODE_FAULT),  # a worker found its Neuron device at fault
    ("exit 1", "garbage", 1),
    ("kill -KILL $$", None, 137),
])
def test_the_supervisor_reports_the_exit_code_the_operator_must_see(
        tmp_path: Path, script: str, written: str | None, expected: int) -> None:
    exit_file = tmp_path / "exit-code"
    if written is not None:
        exit_file.write_text(written)
    env = {"PATH": os.environ["PATH"]}
    assert launch.supervise(["sh", "-c", script], env, exit_file) == expected


def test_the_supervisor_forwards_sigterm_to_torchrun(tmp_path: Path) -> None:
    """The kubelet's SIGTERM (pod deletion) must reach torchrun, which stops the workers."""
    import signal
    import subprocess
    import time

    marker = tmp_path / "got-term"
    child = (f"import signal, sys, time, pathlib\n"
             f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r})"
             f".write_text('x'), sys.exit(143)))\n"
             f"print('ready', flush=True)\ntime.sleep(60)\n")
    code = (f"import sys, pathlib; from hlat_trainer import launch; "
            f"sys.exit(launch.supervise([sys.executable, '-c', {child!r}], "
            f"{{'PATH': ''}}, pathlib.Path({str(tmp_path / 'exit')!r})))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert marker.read_text() == "x"


# --- the compile cache and the root communicator, through main ------------------------------


def test_the_workers_start_with_the_shared_cache_and_their_new_graphs_are_published(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A node (a replacement, a spare) starts warm from what its peers published, and what it
    compiles reaches the next node: the launcher copies before torchrun, publishes after."""
    shared, local = tmp_path / "fsx" / ".neuron-compile-cache", tmp_path / "local-cache"
    version = "neuronxcc-2.21.18209.0+043b1bf7"
    old = shared / version / "MODULE_1+aa"
    old.mkdir(parents=True)
    (old / "model.neff").write_bytes(b"compiled by a peer")
    (old / "model.done").write_text("")
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file), Env.MASTER_ADDR: "127.0.0.1"}))
    monkeypatch.delenv("NEURON_RT_ROOT_COMM_ID", raising=False)
    seen: dict[str, Any] = {}

    def fake_supervise(args: list[str], env: dict[str, str], exit_file: Path) -> int:
        seen["at_start"] = (local / version / "MODULE_1+aa" / "model.neff").read_bytes()
        new = local / version / "MODULE_2+aa"  # what this node's workers compiled
        new.mkdir(parents=True)
        (new / "model.neff").write_bytes(b"compiled here")
        (new / "model.done").write_text("")
        return 0

    monkeypatch.setattr(launch, "supervise", fake_supervise)
    assert launch.main([]) == 0
    assert seen["at_start"] == b"compiled by a peer"
    assert (shared / version / "MODULE_2+aa" / "model.neff").read_bytes() == b"compiled here"
    assert "seeded" in capsys.readouterr().err


def test_an_unwritable_shared_cache_does_not_stop_training(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "fsx").write_text("not a directory")  # the shared volume is broken
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file), Env.MASTER_ADDR: "127.0.0.1"}))
    (tmp_path / "local-cache" / "neuronxcc-1" / "MODULE_1+aa").mkdir(parents=True)
    for name in ("model.neff", "model.done"):
        (tmp_path / "local-cache" / "neuronxcc-1" / "MODULE_1+aa" / name).write_text("")
    monkeypatch.setattr(launch, "supervise", lambda *a: 0)
    assert launch.main([]) == 0
    assert "error" in capsys.readouterr().err


def test_an_unresolvable_master_ends_the_pod_as_a_retryable_failure(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from hlat_trainer import neuron_env

    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file),
                                     Env.MASTER_ADDR: "no-such-host.invalid"}))
    monkeypatch.delenv("NEURON_RT_ROOT_COMM_ID", raising=False)
    monkeypatch.setattr(neuron_env, "RESOLVE_SECONDS", 0.5)
    monkeypatch.setattr(launch, "supervise", lambda *a: pytest.fail("must not start torchrun"))
    assert launch.main([]) == 1  # not CONFIG_ERROR: the next attempt may resolve it
    assert "'no-such-host.invalid' ($HLAT_MASTER_ADDR)" in capsys.readouterr().err


def _agent_made_by_main(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run hlat-launch's main up to the in-place agent it makes (not run); the agent's
    keyword arguments."""
    from hlat_trainer import agent

    monkeypatch.delenv("NEURON_RT_ROOT_COMM_ID", raising=False)
    made: dict[str, Any] = {}

    class FakeAgent:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.update(kwargs)

        def run(self, *args: Any) -> int:
            return 0

    monkeypatch.setattr(agent, "Agent", FakeAgent)
    monkeypatch.setattr(agent.LeaseControl, "from_environment", staticmethod(lambda env: None))
    assert launch.main([]) == 0
    return made


def test_the_in_place_agent_resolves_the_root_comm_per_attempt(
    config_file: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under InPlace node rank 0 can change between attempts (a spare takes it): the address
    is resolved when each attempt starts, on that attempt's port."""
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file), Env.GANG_LEASE: "llama-gang"}))
    made = _agent_made_by_main(monkeypatch)
    assert made["attempt_env"]("127.0.0.1", 2, 4, 5) == {
        "NEURON_RT_ROOT_COMM_ID": "127.0.0.1:48625"}


def test_on_an_ultraserver_each_attempt_gets_the_runtime_s_topology_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """trn2u.48xlarge: the agent's per-attempt variables add what AWS's UltraServer init
    script writes, from the driver's files (here a directory standing for its sysfs), for the
    node's rank of that attempt; a rank the node's group position contradicts is refused."""
    config = tmp_path / "spec.json"
    config.write_text(json.dumps(spec_raw("trn2u.48xlarge",
                                          checkpoint={"dir": str(tmp_path / "fsx")},
                                          neuron={"cacheDir": str(tmp_path / "cache")})))
    sysfs = tmp_path / "neuron_device"
    sysfs.mkdir()
    for name, value in (("ultraserver_mode", "1 2 3 4\n"), ("server_id_4", "bog79p1y8tetj5uu\n"),
                        ("node_id_4", "2\n")):
        (sysfs / name).write_text(value)
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config), Env.GANG_LEASE: "llama-gang",
                                     Env.NPROC_PER_NODE: "64",
                                     "HLAT_NEURON_DEVICE_SYSFS": str(sysfs)}))
    made = _agent_made_by_main(monkeypatch)
    got = made["attempt_env"]("127.0.0.1", 2, 4, 5)
    assert got == {"NEURON_RT_ROOT_COMM_ID": "127.0.0.1:48625", "NEURON_GLOBAL_TOPOID": "2",
                   "NEURON_GLOBAL_TOPOID0_HOST": "127.0.0.1", "NEURON_RT_ULTRASERVER_MODE": "1",
                   "NEURON_RT_ULTRASERVER_SERVER_ID": "bog79p1y8tetj5uu",
                   "NEURON_RT_ULTRASERVER_NODE_ID": "2"}
    with pytest.raises(neuron_env.UltraServerError, match="node rank 1 is on node id 2"):
        made["attempt_env"]("127.0.0.1", 1, 4, 6)


def test_a_pod_cache_url_the_compiler_would_ignore_is_refused(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file),
                                     "NEURON_COMPILE_CACHE_URL": "s3://bucket/cache"}))
    monkeypatch.setattr(launch, "supervise", lambda *a: pytest.fail("must not start torchrun"))
    assert launch.main([]) == ExitCode.CONFIG_ERROR
    assert "NEURON_COMPILE_CACHE_URL=s3://bucket/cache" in capsys.readouterr().err


def test_the_in_place_agent_s_trainers_share_a_snapshot_directory_in_memory_for_the_pod_s_life(
    config_file: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HLAT_SNAPSHOT_DIR (checkpoint.memoryInterval): one directory per pod on /dev/shm, in
    the environment of every trainer the agent starts, there while it runs, gone after."""
    from hlat_trainer import agent

    _set_env(monkeypatch, pod_env(**{Env.CONFIG: str(config_file), Env.GANG_LEASE: "llama-gang"}))
    seen: dict[str, Any] = {}

    class FakeAgent:
        def __init__(self, layout: Any, argv: Any, env: dict[str, str], *args: Any,
                     **kwargs: Any) -> None:
            seen["dir"] = Path(env[Env.SNAPSHOT_DIR])

        def run(self, *args: Any) -> int:
            seen["existed"] = seen["dir"].is_dir()
            (seen["dir"] / "job").mkdir()
            return 0

    monkeypatch.setattr(agent, "Agent", FakeAgent)
    monkeypatch.setattr(agent.LeaseControl, "from_environment", staticmethod(lambda env: None))
    assert launch.main([]) == 0
    assert seen["existed"] and seen["dir"].parent == Path("/dev/shm")
    assert not seen["dir"].exists()
