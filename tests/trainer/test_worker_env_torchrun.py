"""Under `restartStrategy: InPlace` the workers get what the real torchrun gives its workers.

hlat-launch runs `torchrun` under Recreate and starts the workers itself under InPlace (the
default: `hlat_trainer.agent`). Whatever the trainer or its libraries read from torchrun's
environment must be there both ways: torch-xla's Neuron set-up gives each worker its own
NeuronCore only when `torch.distributed.is_torchelastic_launched()` (TORCHELASTIC_RUN_ID is
set); without it the first of a node's 32 workers reserves all 32 cores and the others fail.

The reference is the real torchrun of this environment's torch, run with the line
`launch.build_command` makes, its `-m hlat_trainer` swapped for a script that writes out its
environment. The in-place side is `launch.main` itself in the pod's environment, with two
stand-ins: the restart record (nothing to read: attempt 0 runs to its end) and the warm
standbys, replaced by processes that run the same script in the environment a standby hands
the trainer: the one it was started with, updated with the attempt's (`standby.main`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from hlat_api import Env, load_job
from hlat_trainer import agent, launch

DUMP = textwrap.dedent("""
    import json, os, sys
    seen = {"env": dict(os.environ)}
    if "--ask-torch" in sys.argv:
        import torch.distributed
        seen["torchelastic"] = torch.distributed.is_torchelastic_launched()
    if "--neuron" in sys.argv:  # what torch-xla's Neuron set-up makes of this environment
        from torch_xla._internal import neuron
        neuron.configure_pjrt_environment()
        seen["neuron"] = {k: v for k, v in os.environ.items() if k.startswith(
            ("NEURON_RT_VISIBLE_CORES", "NEURON_PJRT_", "PJRT_LOCAL_PROCESS_"))}
    with open(os.path.join(sys.argv[1], "rank-" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(seen, f)
""")

ABSENT_UNDER_INPLACE = {
    # torch >= 2.10 puts the agent's own setting (which signals *it* handles) into its
    # os.environ (torch/distributed/launcher/api.py), whence the workers inherit it; only the
    # agent reads it (elastic/multiprocessing/api.py). hlat-launch handles its own signals.
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
}
"""Variables torchrun's workers have and in-place workers need not, each with its reason."""

SAME_VALUE = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")
"""Equal, rank by rank, in both launches of the same layout."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec_file(tmp_path: Path, nodes: int) -> Path:
    raw: dict[str, Any] = {
        "instanceType": "cpu", "nodes": nodes, "model": {"preset": "tiny"},
        "data": {"path": "/fsx/data", "tokenizer": "bytes", "seqLen": 128},
        "train": {"globalBatch": 8, "steps": 2}, "optimizer": {"warmupSteps": 1}}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw))
    return path


def _pods(config: Path, nnodes: int, nproc: int) -> list[dict[str, str]]:
    """What the operator sets in each pod of the job (InPlace: with the gang Lease)."""
    port = str(_free_port())
    return [{Env.CONFIG.value: str(config), Env.NNODES.value: str(nnodes),
             Env.NPROC_PER_NODE.value: str(nproc), Env.NODE_RANK.value: str(rank),
             Env.MASTER_ADDR.value: "127.0.0.1", Env.MASTER_PORT.value: port,
             Env.JOB_NAME.value: "llama", Env.ATTEMPT.value: "0"}
            for rank in range(nnodes)]


def _read(out: Path, count: int) -> dict[int, dict[str, Any]]:
    seen = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert sorted(seen) == list(range(count)), f"workers that wrote: {sorted(seen)}"
    return seen


def torchrun_workers(tmp_path: Path, script: Path, pods: Sequence[Mapping[str, str]]
                     ) -> tuple[list[dict[str, str]], dict[int, dict[str, Any]]]:
    """Each node's real torchrun, as `launch.main` runs it (line and environment); the
    environment each node's torchrun was given, and what each worker saw, by rank."""
    out = tmp_path / "torchrun"
    out.mkdir()
    procs, given = [], []
    for pod in pods:
        env = {**os.environ, **pod}
        argv, extra = launch.build_command(env, load_job(pod[Env.CONFIG]).spec)
        assert argv[0] == "torchrun"
        line = [sys.executable, "-m", "torch.distributed.run", *argv[1:argv.index("-m")],
                str(script), str(out)]
        given.append({**env, **extra, "PATH": launch.own_bin_first(env.get("PATH", ""))})
        procs.append(subprocess.Popen(line, env=given[-1], stdout=subprocess.DEVNULL))
    for proc in procs:
        assert proc.wait(timeout=180) == 0
    return given, _read(out, len(pods) * int(pods[0][Env.NPROC_PER_NODE]))


class Quiet:
    """The restart record, never readable: attempt 0 runs to its end."""

    pushed = False

    def record(self, fresh: bool = False) -> None:
        return None

    def report_exit(self, attempt: int, rank: int, code: int, reason: str | None = None
                    ) -> None:
        pytest.fail(f"a worker of attempt {attempt} exited with {code}")

    def report_unreachable(self, attempt: int, rank: int, ranks: list[int],
                           since: object) -> bool:
        return True  # no neighbour answers on this host: nothing to report


@pytest.fixture
def handlers() -> Iterator[None]:
    """`launch.main` installs its signal handlers in this process: put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in launch.FORWARDED}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def inplace_workers(tmp_path: Path, script: Path, pods: Sequence[Mapping[str, str]],
                    monkeypatch: pytest.MonkeyPatch, *asks: str) -> dict[int, dict[str, Any]]:
    """`launch.main` in each pod's environment (a node after the other: nothing here meets
    at a rendezvous); what each worker saw, by rank. `asks`: flags of DUMP's."""
    out = tmp_path / "inplace"
    out.mkdir()

    class Spawned:
        def __init__(self, env: Mapping[str, str], argv: Sequence[str] = ()) -> None:
            self.env = dict(env)

        def go(self, env: Mapping[str, str], argv: Sequence[str]) -> subprocess.Popen[bytes]:
            return subprocess.Popen([sys.executable, str(script), str(out), "--ask-torch",
                                     *asks],
                                    env={**self.env, **env}, start_new_session=True)

        def discard(self) -> None:
            pass

    monkeypatch.setattr(agent, "Standby", Spawned)
    monkeypatch.setattr(agent.LeaseControl, "from_environment", lambda env: Quiet())
    for pod in pods:
        with monkeypatch.context() as m:
            for key, value in {**pod, Env.GANG_LEASE.value: "llama-gang"}.items():
                m.setenv(key, value)
            assert launch.main([]) == 0
    return _read(out, len(pods) * int(pods[0][Env.NPROC_PER_NODE]))


def side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nnodes: int, nproc: int,
                 *asks: str) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """The same job launched by torchrun and in place; what each side's workers saw, by rank,
    once the in-place ones are checked against torchrun's."""
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    pods = _pods(_spec_file(tmp_path, nnodes), nnodes, nproc)
    given, ref = torchrun_workers(tmp_path, script, pods)
    ours = inplace_workers(tmp_path, script, pods, monkeypatch, *asks)

    for rank in ref:
        theirs, mine = ref[rank]["env"], ours[rank]["env"]
        node = given[rank // nproc]
        added = {k for k in theirs if node.get(k) != theirs[k]}
        missing = sorted(added - ABSENT_UNDER_INPLACE - set(mine))
        assert not missing, f"rank {rank}: torchrun gives {missing}, the in-place launcher not"
        assert {k: mine.get(k) for k in SAME_VALUE} == {k: theirs[k] for k in SAME_VALUE}
        # what torch-xla's Neuron set-up asks before it gives the worker its NeuronCore
        assert ours[rank]["torchelastic"] is True, f"rank {rank}: not torchelastic-launched"
        if nnodes > 1:  # static rendezvous at node rank 0's address, on the pod's port
            assert mine["MASTER_ADDR"] == theirs["MASTER_ADDR"] == "127.0.0.1"
            assert mine["MASTER_PORT"] == theirs["MASTER_PORT"] == pods[0][Env.MASTER_PORT]
        # torchrun's agent serves the store (its workers are clients); none does here, so
        # rank 0 must serve it: "True" would leave every rank waiting for nobody
        assert theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "False"

    for side in (ref, ours):  # one run id for the whole attempt; an error file per worker
        assert len({w["env"]["TORCHELASTIC_RUN_ID"] for w in side.values()}) == 1
        assert all(w["env"]["TORCHELASTIC_RUN_ID"] for w in side.values())
        assert len({w["env"]["TORCHELASTIC_ERROR_FILE"] for w in side.values()}) == len(side)
        assert len({w["env"]["MASTER_PORT"] for w in side.values()}) == 1
    return ref, ours


@pytest.mark.parametrize(("nnodes", "nproc"), [(1, 2), (2, 2)])
def test_inplace_workers_get_every_variable_torchrun_gives_its_workers(
        nnodes: int, nproc: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        handlers: None) -> None:
    side_by_side(tmp_path, monkeypatch, nnodes, nproc)


class Recorded:
    """Stands in for `agent.Standby`: keeps the attempt's environment it was handed."""

    def __init__(self, env: Mapping[str, str], argv: Sequence[str] = ()) -> None:
        self.handed: dict[str, str] = {}

    def go(self, env: Mapping[str, str], argv: Sequence[str]) -> Any:
        self.handed = dict(env)
        return type("Proc", (), {"pid": 0, "poll": lambda _: None})()


def test_each_attempt_is_a_run_of_its_own_named_alike_on_every_node(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt N in place is what a fresh `torchrun --max-restarts 0` is under Recreate: its
    own rendezvous (run id and port), no restart counted by an agent."""
    made: list[Recorded] = []

    def standby(env: Mapping[str, str], argv: Sequence[str] = ()) -> Recorded:
        made.append(Recorded(env))
        return made[-1]

    monkeypatch.setattr(agent, "Standby", standby)
    nodes = [agent.Agent(agent.NodeLayout(2, 2, rank, "llama-0.llama", 29500), [],
                         {Env.JOB_NAME.value: "llama"}, control=Quiet(), wait_bound=1,
                         warm=False) for rank in range(2)]

    def attempt(n: int) -> list[dict[str, str]]:
        made.clear()
        for node in nodes:
            node._start(attempt=n, steps_done=0, started=0.0)
        return [r.handed for r in made]

    fifth, sixth = attempt(5), attempt(6)
    assert [w["RANK"] for w in fifth] == ["0", "1", "2", "3"]
    assert len({w["TORCHELASTIC_RUN_ID"] for w in fifth}) == 1  # every node alike
    assert {w["TORCHELASTIC_RUN_ID"] for w in fifth}.isdisjoint(
        w["TORCHELASTIC_RUN_ID"] for w in sixth)
    assert {w["MASTER_PORT"] for w in fifth} == {str(29500 + 5)}
    assert {(w["TORCHELASTIC_RESTART_COUNT"], w["TORCHELASTIC_MAX_RESTARTS"])
            for w in fifth + sixth} == {("0", "0")}
