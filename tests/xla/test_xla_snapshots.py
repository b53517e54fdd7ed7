"""In-memory snapshots on the neuron-xla engine (ManagedEngine), on real torch-xla (PJRT CPU)
with torch-xla's own ZeRO-1 optimizer and NxD's checkpoint glue replaced (xla_standin.py).

A snapshot holds what NxD's checkpoint holds of a rank (the optimizer's state_dict, master
weights included, and the model's), copied to the host, and the loop state; a restart loads it
in the durable load's order (the model, then the optimizer, which re-shards the loaded
parameters). What a user would notice: a trainer restarted in its pod trains on from the last
snapshot, not from the durable checkpoint, and ends exactly where the uninterrupted run ended;
a snapshot cut off mid-write is never used."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_xla_zero1_resume import run, weights

from hlat_api import Job


def lose_the_last_step(job: Job, snapshots: Path) -> None:
    """A trainer killed while writing step 8's snapshot, before its durable checkpoint: the
    newest state left is step 7's snapshot, the newest durable checkpoint step_4."""
    shutil.rmtree(Path(job.spec.checkpoint.dir, job.name, "step_8"))
    (snapshots / "step_8.pt").unlink()


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"],
                         ids=["zero1", "zero1-bf16-master-weights"])
def test_a_restarted_trainer_resumes_from_its_snapshot_exactly_and_never_from_a_torn_one(
        make_job: Callable[..., Job], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        precision: str) -> None:
    """fp32: the snapshot's model is what the optimizer re-shards (the load's order); bf16-sr:
    bf16 parameters under fp32 master weights, which only the optimizer's state holds."""
    monkeypatch.setenv("HLAT_SNAPSHOT_DIR", str(tmp_path / "shm"))
    job = make_job(precision=precision, parallelism={"zero1": True}, train__steps=8,
                   train__logInterval=1, checkpoint__interval=4, checkpoint__memoryInterval=1)
    snapshots = tmp_path / "shm" / job.name / "rank_00000"
    straight, straight_losses = run(job)
    assert straight.engine.takes_snapshots
    final = weights(straight)
    assert sorted(p.name for p in snapshots.iterdir()) == ["step_7.pt", "step_8.pt"]

    # step 7's snapshot cut off mid-write: not used, the durable step_4 is
    lose_the_last_step(job, snapshots)
    torn = snapshots / "step_7.pt"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    from_disk, disk_losses = run(job)
    assert from_disk.resumed_from == "checkpoint" and sorted(disk_losses) == [5, 6, 7, 8]
    assert disk_losses == {s: straight_losses[s] for s in disk_losses}

    # whole again (that run snapshotted steps 7 and 8): step 7's is what resumes
    lose_the_last_step(job, snapshots)
    resumed, resumed_losses = run(job)
    assert resumed.resumed_from == "snapshot" and sorted(resumed_losses) == [8]
    assert resumed_losses[8] == straight_losses[8]
    for name, tensor in final.items():
        torch.testing.assert_close(weights(resumed)[name], tensor, rtol=0, atol=0, msg=name)


def test_snapshots_of_another_model_are_passed_over_for_the_durable_checkpoint(
        make_job: Callable[..., Job], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's memory holds a job's snapshots of another model, newer than the durable
    checkpoint (the spec's model changed while the pods stayed): they do not fit this model on
    any rank, so no rank loads them (a load would fail half-way, inside the collectives), and
    the run resumes from the durable checkpoint and ends where the uninterrupted run ended.
    The wider run itself starts fresh past the narrower one's snapshots, for the same reason."""
    monkeypatch.setenv("HLAT_SNAPSHOT_DIR", str(tmp_path / "shm"))
    common = {"parallelism": {"zero1": True}, "train__steps": 8, "train__logInterval": 1,
              "checkpoint__interval": 4, "checkpoint__memoryInterval": 1}
    job = make_job(**common)
    straight, straight_losses = run(job)
    final = weights(straight)
    wider = make_job(model__hiddenSize=128, checkpoint__dir=str(tmp_path / "wider"), **common)
    assert wider.name == job.name  # the same snapshot directory in the pod's memory
    _, fresh_losses = run(wider)
    assert sorted(fresh_losses) == list(range(1, 9))  # from step 1: nothing loaded
    snapshots = tmp_path / "shm" / job.name / "rank_00000"
    assert sorted(p.name for p in snapshots.iterdir()) == ["step_7.pt", "step_8.pt"]

    shutil.rmtree(Path(job.spec.checkpoint.dir, job.name, "step_8"))  # durable: step_4
    resumed, losses = run(job)
    assert resumed.resumed_from == "checkpoint" and sorted(losses) == [5, 6, 7, 8]
    assert losses == {s: straight_losses[s] for s in losses}
    for name, tensor in final.items():
        torch.testing.assert_close(weights(resumed)[name], tensor, rtol=0, atol=0, msg=name)
