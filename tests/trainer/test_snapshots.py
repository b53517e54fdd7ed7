"""In-memory snapshots (checkpoint.memoryInterval) across real processes: two ranks (gloo,
torchrun), ZeRO-1 and stochastic rounding, every process SIGKILLed between durable checkpoints
while the launcher's snapshot directory (HLAT_SNAPSHOT_DIR) survives, as in a pod whose
trainers are restarted in place."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_distributed import (
    ENV,
    digests,
    kill_node,
    layout,
    losses,
    run,
    run_until_step,
    torchrun,
)

from hlat_api.layout import latest_complete
from hlat_trainer import replica

pytestmark = pytest.mark.slow


def by_step(stdout: str) -> dict[int, float]:
    return {int(e["step"]): float(e["loss"]) for e in map(json.loads, (
        line for line in stdout.splitlines() if line.startswith("{")))}


def resumed_from(stderr: str) -> tuple[str, int]:
    m = re.search(r"resumed from (in-memory snapshot|checkpoint) step_(\d+)", stderr)
    assert m, stderr[-3000:]
    return m.group(1), int(m.group(2))


def model_elements(snapshot: Path) -> int:
    payload = torch.load(snapshot, weights_only=True)
    return sum(t.numel() for t in payload["state"]["model"].values())


def optimizer_elements(snapshot: Path) -> int:
    """The elements of a snapshot's optimizer entries (`optim.tp<t>.<name>.<slot>`)."""
    payload = torch.load(snapshot, weights_only=True)
    return sum(v.numel() for k, v in payload["state"].items()
               if k.startswith("optim.") and isinstance(v, torch.Tensor))


@pytest.mark.parametrize("zero1", [True, False], ids=["zero1", "replicated-optimizer"])
def test_a_crashed_trainer_resumes_from_memory_losing_at_most_one_step_and_never_from_a_torn_one(
        write_config: Callable[..., Path], zero1: bool) -> None:
    """Killed at least 4 steps past the durable step_8, with snapshots every step:
    - each rank's snapshot holds half the weights (the two dp replicas hold them alike: each
      keeps its half, and a restore gathers them back), with the optimizer state split by
      ZeRO-1 or, without it, halved the same way;
    - the restart resumes from the newest snapshot both ranks hold, no older than one step
      before the last step logged, not from step_8;
    - with a copy of the same state whose rank-1 snapshots are truncated (a write cut off), no
      rank resumes from memory: the run resumes from step_8;
    - every loss of all three runs is the same at each step: model, ZeRO-1 optimizer shards,
      rounding generator, data position and RNG all restored (the durable path's exactness
      against an uninterrupted run is test_distributed's)."""
    config = write_config(train__steps=24, checkpoint__interval=8, checkpoint__memoryInterval=1,
                          precision="bf16-sr", parallelism__zero1=zero1)
    base = config.parent
    env = {**ENV, "HLAT_SNAPSHOT_DIR": str(base / "shm")}
    proc, lines = run_until_step(torchrun(config, 2, *layout(2, 1), f"checkpoint.dir={base}/ck"),
                                 12, env)
    kill_node(proc)
    assert proc.stdout is not None
    logged = by_step("".join(lines) + proc.stdout.read())
    last = max(logged)
    durable = latest_complete(base / "ck", "job")
    assert durable is not None and durable.step == 8 and last >= 12, (durable, last)
    shutil.copytree(base / "ck", base / "ck2")
    shutil.copytree(base / "shm", base / "shm2")

    partial = base / "shm" / "job" / "rank_00000" / "step_99.tmp"  # a write cut off
    partial.write_bytes(b"\0" * 4096)
    resumed = run(torchrun(config, 2, *layout(2, 1), f"checkpoint.dir={base}/ck"), env)
    assert not partial.exists(), "a partial snapshot's memory is freed at the restart"
    counted = re.search(r"([\d,]+) parameters", resumed.stderr)
    assert counted, resumed.stderr[-3000:]
    params = int(counted.group(1).replace(",", ""))
    for rank in (0, 1):
        newest = max((base / "shm" / "job" / f"rank_{rank:05d}").glob("step_*.pt"),
                     key=lambda f: int(f.stem.split("_")[1]))
        kept = model_elements(newest)  # pieces padded: at most one element more per tensor
        assert params / 2 <= kept <= params / 2 + 100, (rank, kept, params)
        if not zero1:  # AdamW's two moments a parameter, halved as the weights are
            moments = optimizer_elements(newest)
            assert params <= moments <= params + 300, (rank, moments, params)
    source, step = resumed_from(resumed.stderr)
    assert source == "in-memory snapshot" and step >= last - 1, (source, step, last)
    after = by_step(resumed.stdout)
    assert min(after) == step + 1 and max(after) == 24
    assert "step_16" in {p.name for p in (base / "ck" / "job").iterdir()}, \
        "durable checkpoints go on"

    torn = sorted((base / "shm2" / "job" / "rank_00001").glob("step_*.pt"))
    assert torn
    for f in torn:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    again = run(torchrun(config, 2, *layout(2, 1), f"checkpoint.dir={base}/ck2"),
                {**ENV, "HLAT_SNAPSHOT_DIR": str(base / "shm2")})
    assert resumed_from(again.stderr) == ("checkpoint", 8)
    durably = by_step(again.stdout)
    assert min(durably) == 9 and max(durably) == 24
    assert {s: logged[s] for s in logged if s > 8} == {s: durably[s] for s in logged if s > 8}
    assert after == {s: durably[s] for s in after}


@pytest.mark.parametrize(("old", "tp", "zero1"), [(3, 1, True), (4, 2, False)],
                         ids=["dp3-to-2-zero1", "tp2-dp2-to-1-replicated-optimizer"])
def test_a_shrunk_job_resumes_from_the_old_world_s_snapshots_resharded(
        write_config: Callable[..., Path], old: int, tp: int, zero1: bool) -> None:
    """`old` ranks (snapshots every step, durable every 8) killed past step 12, then 2 ranks
    (a node lost, the job shrunk in place): the launcher stages the old ranks' newest common
    snapshot (`replica.gather`, here from this pod's own files) and the 2 trainers take it,
    weights joined from the old dp ranks' pieces, each optimizer entry from its old owner
    (ZeRO-1) or joined like the weights, the data lanes resharded: they resume from that step,
    not from step_8, and train what an uninterrupted 2-rank run trains (the same global
    batches; losses up to the reduction order). With one old rank's staged file gone, no rank
    resumes from memory: step_8."""
    config = write_config(train__steps=20, train__microBatch=1, checkpoint__interval=8,
                          checkpoint__memoryInterval=1, parallelism__zero1=zero1)
    base = config.parent
    straight = run(torchrun(config, 2, *layout(2, tp), f"checkpoint.dir={base}/a")).stdout
    env = {**ENV, "HLAT_SNAPSHOT_DIR": str(base / "shm")}
    proc, lines = run_until_step(
        torchrun(config, old, *layout(old, tp), f"checkpoint.dir={base}/ck"), 12, env)
    kill_node(proc)
    assert proc.stdout is not None
    last = max(by_step("".join(lines) + proc.stdout.read()))
    durable = latest_complete(base / "ck", "job")
    assert durable is not None and durable.step == 8 and last >= 12, (durable, last)
    step = replica.gather(base / "shm", "job", {0: [("here", "own")]}, old, "here")
    assert step >= last - 1, (step, last)
    shutil.copytree(base / "ck", base / "ck2")
    shutil.copytree(base / "shm", base / "shm2")

    resumed = run(torchrun(config, 2, *layout(2, tp), f"checkpoint.dir={base}/ck"), env)
    assert resumed_from(resumed.stderr) == ("in-memory snapshot", step)
    assert (f"saved by {old} ranks (dp {old // tp}), on 2 ranks (dp {2 // tp})"
            in resumed.stderr)
    assert [json.loads(x)["step"] for x in resumed.stdout.splitlines()] == list(
        range(step + 1, 21))
    assert digests(resumed.stdout) == digests(straight)[step:]
    assert losses(resumed.stdout) == pytest.approx(losses(straight)[step:], rel=1e-5)

    replica.staged_path(base / "shm2", "job", 1, step).unlink()
    again = run(torchrun(config, 2, *layout(2, tp), f"checkpoint.dir={base}/ck2"),
                {**ENV, "HLAT_SNAPSHOT_DIR": str(base / "shm2")})
    assert resumed_from(again.stderr) == ("checkpoint", 8)
