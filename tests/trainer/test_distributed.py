"""The trainer across processes (gloo on CPU, launched by torchrun as in the pods): tensor and
sequence parallel, data parallel with ZeRO-1, two "nodes", a killed rank, a crash mid-save."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
ENV = {**os.environ, "HLAT_COLLECTIVE_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STANDIN = str(Path(__file__).with_name("standin_managed.py"))


def torchrun(config: Path, nproc: int, *sets: str, nnodes: int = 1, node_rank: int = 0,
             endpoint: str | None = None, entry: tuple[str, ...] = ("-m", "hlat_trainer"),
             ) -> list[str]:
    rdzv = ["--standalone"] if endpoint is None else [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "hlat-test",
        "--node-rank", str(node_rank)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc-per-node", str(nproc), *rdzv, "--monitor-interval", "0.5",
           *entry, "--config", str(config)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env or ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def losses(stdout: str) -> list[float]:
    return [json.loads(line)["loss"] for line in stdout.splitlines() if line.startswith("{")]


def digests(stdout: str) -> list[str]:
    return [json.loads(line)["batchDigest"] for line in stdout.splitlines()
            if line.startswith("{")]


def layout(nproc: int, tp: int, **extra: object) -> list[str]:
    sets = [f"processesPerNode={nproc}", f"parallelism.tensor={tp}"]
    return sets + [f"{k}={v}" for k, v in extra.items()]


def test_tp_sp_matches_data_parallel_and_zero1_shards_optimizer_state(
    write_config: Callable[..., Path],
) -> None:
    """dp=2 x tp=2 with sequence parallel == dp=2 x tp=1 (same streams), within fp32 noise."""
    config = write_config(train__steps=4, train__microBatch=1)
    ref = run(torchrun(config, 2, *layout(2, 1, **{"parallelism.zero1": "false"}),
                       "checkpoint.dir=" + str(config.parent / "a")))
    zero = run(torchrun(config, 2, *layout(2, 1), "checkpoint.dir=" + str(config.parent / "b")))
    tpsp = run(torchrun(config, 4, *layout(4, 2, **{"parallelism.sequenceParallel": "true"}),
                        "checkpoint.dir=" + str(config.parent / "c")))
    base = losses(ref.stdout)
    assert len(base) == 4 and base[-1] < base[0]
    # Only the order of floating-point reductions differs (all-reduces, sharded matmuls):
    # fp32 round-off, amplified a little by 4 Adam steps, stays far below 1e-4 relative.
    assert losses(zero.stdout) == pytest.approx(base, rel=1e-5)
    assert losses(tpsp.stdout) == pytest.approx(base, rel=1e-4)
    # the same sequences: a tensor-parallel group's ranks read theirs once in the digest
    assert digests(tpsp.stdout) == digests(zero.stdout) == digests(ref.stdout)
    owned = [tuple(map(int, m)) for m in re.findall(
        r"updates (\d+) of (\d+) parameter elements \(zero1=True\)", zero.stderr)]
    full = [tuple(map(int, m)) for m in re.findall(
        r"updates (\d+) of (\d+) parameter elements \(zero1=False\)", ref.stderr)]
    assert len(owned) == 2 and len(full) == 2
    total = owned[0][1]
    assert sum(o for o, _ in owned) == total, "each parameter has exactly one owner"
    for o, _ in owned:  # about half each (whole tensors are assigned, balanced by size)
        assert abs(o / total - 0.5) < 0.1
    assert all(o == t for o, t in full)


def test_two_nodes_train_together_like_one(write_config: Callable[..., Path]) -> None:
    config = write_config(train__steps=3)
    single = run(torchrun(config, 2, *layout(2, 1), "checkpoint.dir=" + str(config.parent / "a")))
    endpoint = f"127.0.0.1:{free_port()}"
    sets = ["nodes=2", "processesPerNode=1", "checkpoint.dir=" + str(config.parent / "b")]
    nodes = [subprocess.Popen(torchrun(config, 1, *sets, nnodes=2, node_rank=r, endpoint=endpoint),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for r in (0, 1)]
    outs = [n.communicate(timeout=600) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert losses(outs[0][0] + outs[1][0]) == losses(single.stdout)


def worker_pids(launcher: psutil.Process) -> list[int]:
    return [c.pid for c in launcher.children(recursive=True)
            if any(m in " ".join(c.cmdline()) for m in ("hlat_trainer", "standin_managed"))]


def kill_node(proc: subprocess.Popen[str]) -> None:
    """SIGKILL torchrun and its workers at once, as when a node goes down."""
    victims = [proc.pid, *worker_pids(psutil.Process(proc.pid))]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    psutil.wait_procs([p for p in map(_proc, victims) if p is not None], timeout=30)


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def run_until_step(cmd: list[str], step: int, env: dict[str, str]) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("{") and json.loads(line)["step"] == step:
            break
    return proc, lines


def test_sigkill_one_rank_stops_all_and_resume_continues_exactly(
    write_config: Callable[..., Path],
) -> None:
    config = write_config(train__steps=6, checkpoint__interval=2, checkpoint__async=True)
    sets = [*layout(2, 1), "checkpoint.dir=" + str(config.parent / "ck")]
    straight = losses(run(torchrun(config, 2, *layout(2, 1),
                                   "checkpoint.dir=" + str(config.parent / "a"))).stdout)
    proc, lines = run_until_step(torchrun(config, 2, *sets), 3, ENV)
    done = config.parent / "ck" / "job" / "step_2" / "done"
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:  # the async write of step_2
        time.sleep(0.05)
    victim = worker_pids(psutil.Process(proc.pid))[-1]
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    proc.wait(timeout=90)
    stopped = time.monotonic() - start
    assert proc.returncode != 0 and stopped < 60, stopped
    assert not psutil.pid_exists(victim)
    resumed = run(torchrun(config, 2, *sets))
    first = json.loads(resumed.stdout.splitlines()[0])
    assert first["step"] == 3, "the last complete checkpoint was step_2"
    assert losses("".join(lines))[:2] + losses(resumed.stdout) == straight


def test_crash_during_async_save_leaves_no_done_and_the_previous_checkpoint_loads(
    write_config: Callable[..., Path],
) -> None:
    config = write_config(train__steps=6, checkpoint__interval=2, checkpoint__async=True)
    sets = [*layout(2, 1), "checkpoint.dir=" + str(config.parent / "ck")]
    run(torchrun(config, 2, *sets, "train.steps=2"))
    slow = {**ENV, "HLAT_FAULT_CHECKPOINT_WRITE_DELAY_SECONDS": "60"}
    proc, _ = run_until_step(torchrun(config, 2, *sets), 4, slow)  # step_4's write is stalled
    kill_node(proc)
    ck = config.parent / "ck" / "job"
    assert (ck / "step_2" / "done").exists()
    assert not (ck / "step_4" / "done").exists()
    resumed = run(torchrun(config, 2, *sets))
    assert json.loads(resumed.stdout.splitlines()[0])["step"] == 3
    assert (ck / "step_6" / "done").exists()


def test_resume_with_zero1_switched_or_another_data_parallel_degree(
    write_config: Callable[..., Path],
) -> None:
    """A checkpoint saved by dp=2 with ZeRO-1 resumes (a) without ZeRO-1: the optimizer state is
    keyed by parameter name, so the same run continues (within fp32 noise); (b) on one rank
    (a node was lost): each data lane goes on where it stopped, so the run trains the same
    global batches with twice the gradient accumulation: the same losses up to the reduction
    order (summing micro-batches on one rank instead of all-reducing two ranks' means)."""
    config = write_config(train__steps=6, checkpoint__interval=2)
    ck, ck_one = config.parent / "ck", config.parent / "ck1"
    straight_out = run(torchrun(config, 2, *layout(2, 1),
                                "checkpoint.dir=" + str(config.parent / "a"))).stdout
    straight = losses(straight_out)
    proc, _ = run_until_step(torchrun(config, 2, *layout(2, 1), f"checkpoint.dir={ck}"), 5, ENV)
    kill_node(proc)
    assert (ck / "job" / "step_4" / "done").exists()
    shutil.copytree(ck, ck_one)

    no_zero1 = run(torchrun(config, 2, *layout(2, 1, **{"parallelism.zero1": "false"}),
                            f"checkpoint.dir={ck}"))
    assert [json.loads(x)["step"] for x in no_zero1.stdout.splitlines()] == [5, 6]
    assert losses(no_zero1.stdout) == pytest.approx(straight[4:], rel=1e-5)

    one = run(torchrun(config, 1, *layout(1, 1), f"checkpoint.dir={ck_one}"))
    assert [json.loads(x)["step"] for x in one.stdout.splitlines()] == [5, 6]
    assert ("saved by 2 ranks (dp 2), on 1 ranks (dp 1): data: every lane goes on where it "
            "stopped") in one.stderr
    assert losses(one.stdout) == pytest.approx(straight[4:], rel=1e-5)
    # the same sequences, step by step: the global batches' digests are equal
    assert digests(one.stdout) == digests(straight_out)[4:]
    assert len(set(digests(straight_out))) == 6, "every step's data differs from the others'"


def test_a_data_parallel_degree_that_does_not_divide_the_micro_batches_trains_the_same_run(
    write_config: Callable[..., Path],
) -> None:
    """4 micro-batches a step on 3 ranks (a node of 64 lost, in small): rank 0 trains 2, ranks
    1 and 2 one each, and the step is the same as on 2 ranks: the same sequences (digests), the
    same losses up to the reduction order, through a crash and a resume on 2 ranks from the
    3 ranks' checkpoint."""
    config = write_config(train__steps=6, train__microBatch=1, checkpoint__interval=2)
    ck = config.parent / "ck"
    two_out = run(torchrun(config, 2, *layout(2, 1),
                           "checkpoint.dir=" + str(config.parent / "a"))).stdout
    proc, lines = run_until_step(torchrun(config, 3, *layout(3, 1), f"checkpoint.dir={ck}"),
                                 5, ENV)
    kill_node(proc)
    three_out = "".join(lines)
    assert digests(three_out) == digests(two_out)[:5]
    assert losses(three_out) == pytest.approx(losses(two_out)[:5], rel=1e-5)
    resumed = run(torchrun(config, 2, *layout(2, 1), f"checkpoint.dir={ck}"))
    assert [json.loads(x)["step"] for x in resumed.stdout.splitlines()] == [5, 6]
    assert digests(resumed.stdout) == digests(two_out)[4:]
    assert losses(resumed.stdout) == pytest.approx(losses(two_out)[4:], rel=1e-5)


def test_a_backend_that_manages_itself_resumes_exactly_after_a_crash(
    write_config: Callable[..., Path],
) -> None:
    """The ManagedEngine path (neuron-xla's) with a CPU stand-in that checkpoints as NxD does:
    asynchronously, `done` only when the next save begins. Killed after step 5, step_4 is not
    complete; the restart resumes from step_2 and repeats the uninterrupted run's losses."""
    config = write_config(train__steps=6, checkpoint__interval=2, checkpoint__async=True)
    entry = (STANDIN,)
    straight = losses(run(torchrun(config, 2, *layout(2, 1), "checkpoint.dir="
                                   + str(config.parent / "a"), entry=entry)).stdout)
    sets = [*layout(2, 1), "checkpoint.dir=" + str(config.parent / "ck")]
    proc, lines = run_until_step(torchrun(config, 2, *sets, entry=entry), 5, ENV)
    kill_node(proc)
    ck = config.parent / "ck" / "job"
    assert (ck / "step_2" / "done").exists() and not (ck / "step_4" / "done").exists()
    assert sorted(p.name for p in (ck / "step_2" / "hlat").iterdir()) == [
        "rank_00000.pt", "rank_00001.pt"]
    assert json.loads((ck / "step_2" / "hlat.json").read_text())["layout"] == {
        "world": 2, "dp": 2, "tp": 1, "zero1": True}
    resumed = run(torchrun(config, 2, *sets, entry=entry))
    assert json.loads(resumed.stdout.splitlines()[0])["step"] == 3
    assert losses("".join(lines))[:2] + losses(resumed.stdout) == straight
    assert (ck / "step_6" / "done").exists(), "the last save is finalised before exit"


SLOW_UPDATE_S = 2.0
SLOWED = '''"""hlat-train with rank 1's optimizer update {delay} s slower (a host slowed by a noisy
neighbour, a throttled CPU): the test's fail-slow host."""
import os
import sys
import time

import torch

from hlat_trainer import optim
from hlat_trainer.cli import main

if os.environ["RANK"] == "1":
    for cls in (torch.optim.AdamW, optim.AdamWSR):
        def slow(self, *args, _step=cls.step, **kwargs):
            time.sleep({delay})
            return _step(self, *args, **kwargs)
        cls.step = slow
sys.exit(main())
'''


@pytest.mark.parametrize("zero1", [True, False])
def test_a_rank_waiting_for_a_slow_peer_s_update_counts_it_as_sync_not_as_its_own_host_work(
        write_config: Callable[..., Path], zero1: bool) -> None:
    """Rank 1's optimizer update takes 2 s longer. Rank 0 waits for it after its own update:
    in ZeRO-1's broadcast of the updated shards, or (without ZeRO-1) in the loss's all-reduce.
    That wait is the gradient sync's kind (`sync_seconds`, waiting on peers), not rank 0's host
    overhead (`host_seconds`, the node's own work the straggler score counts): counted as host,
    every healthy node would look as slow as the slow one."""
    config = write_config(train__steps=5, checkpoint__interval=100)
    script = config.parent / "slowed.py"
    script.write_text(SLOWED.format(delay=SLOW_UPDATE_S))
    out = run(torchrun(config, 2, *layout(2, 1, **{"parallelism.zero1": str(zero1).lower()}),
                       "checkpoint.dir=" + str(config.parent / "ck"), entry=(str(script),)))
    last = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")][-1]
    assert last["syncSeconds"] >= SLOW_UPDATE_S / 2 > last["hostSeconds"], last
