"""`hlat-eval`, our own evaluator (issue 33), on CPU: the held-out loss it takes of a durable
checkpoint is the loss the run took in its loop at that step; while it reads, retention
(checkpoint.keep) deletes nothing it holds; bad input names what to fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hlat_api import ExitCode, Job, step_dir
from hlat_api.layout import (
    PENDING_READER,
    READER_FRESH_SECONDS,
    READERS,
    being_read,
    list_checkpoints,
)
from hlat_trainer import evaluate
from hlat_trainer.checkpoint import Checkpointer
from hlat_trainer.errors import UserError
from hlat_trainer.train import Trainer


def _trained(make_job: Callable[..., Job], held_out: Path, **over: object
             ) -> tuple[Job, dict[int, float]]:
    """A run that evaluates and checkpoints every 2 steps; its in-loop validation losses."""
    job = make_job(train__steps=4, checkpoint__interval=2, checkpoint__keep=2,
                   eval={"path": str(held_out), "interval": 2, "batches": 2}, **over)
    seen: list[dict[str, object]] = []
    Trainer(job, sinks=[seen.append]).run()
    return job, {int(r["step"]): float(r["validation_loss"])  # type: ignore[arg-type]
                 for r in seen if "validation_loss" in r}


def test_the_loss_of_a_checkpoint_is_the_run_s_own_validation_loss_at_that_step(
        make_job: Callable[..., Job], held_out_data: Path, tmp_path: Path) -> None:
    job, in_loop = _trained(make_job, held_out_data)
    assert sorted(in_loop) == [2, 4]
    root = job.spec.checkpoint.dir
    for step in (2, 4):
        result = evaluate.evaluate(job.spec, job.name, evaluate.choose(root, job.name, step))
        assert result["step"] == step and result["tokens"] == step * job.spec.tokens_per_step
        assert result["validationLoss"] == pytest.approx(in_loop[step], rel=1e-6), (step, result)
        assert result["microBatches"] == 2
    # the command: the newest checkpoint by default, its result as JSON where it is told
    out = tmp_path / "result.json"
    config = tmp_path / "job.yaml"
    assert evaluate.main(["--config", str(config), "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    assert set(written) == {"validationLoss"}  # the score alone
    assert written["validationLoss"] == pytest.approx(in_loop[4], rel=1e-6)
    assert not (step_dir(root, job.name, 4) / READERS).exists(), "the reader left its mark"


def test_retention_keeps_a_checkpoint_being_read_and_deletes_it_once_read(
        make_job: Callable[..., Job], tmp_path: Path) -> None:
    job = make_job(train__steps=6, checkpoint__interval=2, checkpoint__keep=1)
    Trainer(job).run()
    root, name = job.spec.checkpoint.dir, job.name
    ckpt = Checkpointer(root, name, keep=1, async_=False)
    newest = step_dir(root, name, 6)
    # an evaluation of step 6 holds it while a newer checkpoint (8) arrives
    later = step_dir(root, name, 8)
    later.mkdir()
    (later / "done").write_text("")
    with evaluate.reading(newest) as mark:
        assert mark.is_file() and being_read(newest)
        ckpt.purge()
        assert (newest / "done").is_file(), "deleted while read"
    assert not being_read(newest)
    ckpt.purge()
    assert not newest.exists()
    # a reader that died stops holding it once its mark is stale
    stale = step_dir(root, name, 7)
    (stale / READERS).mkdir(parents=True)
    (stale / "done").write_text("")
    (stale / READERS / "gone-1").touch()
    old = time.time() - READER_FRESH_SECONDS - 1
    os.utime(stale / READERS / "gone-1", (old, old))
    ckpt.purge()
    assert not stale.exists()


def test_a_checkpoint_due_for_an_evaluation_job_is_held_until_its_sidecar_takes_over(
        make_job: Callable[..., Job], tmp_path: Path) -> None:
    """spec.evaluation: the trainer holds each checkpoint due for an evaluation Job from the
    moment it is complete (a pending reader dated to the Job's deadline), however fast the next
    ones come; the Job's sidecar (`hlat-eval --hold`) takes the hold over, and once it is
    stopped (SIGTERM, as the kubelet stops a sidecar) retention deletes the checkpoint."""
    job = make_job(train__steps=6, checkpoint__interval=2, checkpoint__keep=1,
                   evaluation={"every": 2, "command": ["lm_eval"], "deadlineSeconds": 600})
    Trainer(job).run()
    root, name = job.spec.checkpoint.dir, job.name
    kept = sorted(e.step for e in list_checkpoints(root, name) if e.complete)
    assert kept == [4, 6], "the checkpoint due for evaluation (4) was deleted, or 2 was kept"
    pending = step_dir(root, name, 4) / READERS / PENDING_READER
    assert pending.stat().st_mtime > time.time() + 500  # dated to the Job's deadline
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "hlat_trainer.evaluate", "--config", str(tmp_path / "job.yaml"),
         "--step", "4", "--hold"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while pending.exists() and time.monotonic() < deadline and sidecar.poll() is None:
            time.sleep(0.1)
        assert not pending.exists(), "the sidecar did not take the hold over"
        assert being_read(step_dir(root, name, 4))
        Checkpointer(root, name, keep=1, async_=False).purge()
        assert step_dir(root, name, 4).is_dir(), "deleted while its sidecar held it"
    finally:
        sidecar.send_signal(signal.SIGTERM)
        _, err = sidecar.communicate(timeout=30)
    assert sidecar.returncode == 0, err
    Checkpointer(root, name, keep=1, async_=False).purge()
    assert not step_dir(root, name, 4).exists()


def test_bad_input_names_what_to_fix(make_job: Callable[..., Job], held_out_data: Path,
                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    job = make_job(train__steps=2, checkpoint__interval=2)
    with pytest.raises(UserError, match=r"spec\.eval is not set"):
        evaluate.evaluation_spec(job.spec)
    with pytest.raises(UserError, match="no complete checkpoint under"):
        evaluate.choose(job.spec.checkpoint.dir, job.name, None)
    job, _ = _trained(make_job, held_out_data)
    with pytest.raises(UserError, match=r"step_3 is not complete"):
        evaluate.choose(job.spec.checkpoint.dir, job.name, 3)
    code = evaluate.main(["--config", str(tmp_path / "job.yaml"), "--step", "3"])
    assert code == ExitCode.CONFIG_ERROR
    assert "--step names a complete one" in capsys.readouterr().err
    # NxD's format (no torch.distributed.checkpoint metadata) is refused, naming the backend
    entry = evaluate.choose(job.spec.checkpoint.dir, job.name, 4)
    (entry.path / evaluate.DCP_METADATA).unlink()
    with pytest.raises(UserError, match="neuron-xla"):
        evaluate.evaluate(job.spec, job.name, entry)


@pytest.mark.slow
def test_a_checkpoint_saved_by_four_ranks_in_two_layouts_is_read_by_one_process(
        write_config: Callable[..., Path], held_out_data: Path) -> None:
    """dp 2 x tp 2 with sequence parallelism (torchrun, 4 ranks): one process reads its
    checkpoint (tensor-parallel shards resharded by torch.distributed.checkpoint), and the held-
    out loss of the set's 3 micro-batches (2 on one data-parallel rank, 1 on the other: the
    mean is over micro-batches, not of the ranks' means) is the run's own, to reduction order."""
    from test_distributed import ENV, layout, run, torchrun

    from hlat_api import load_job

    config = write_config(train__steps=4, checkpoint__interval=2, checkpoint__keep=2,
                          eval={"path": str(held_out_data), "interval": 2, "batches": 3})
    out = run(torchrun(config, 4, *layout(4, 2, **{"parallelism.sequenceParallel": "true"})),
              env=ENV)
    in_loop = {r["step"]: r["validationLoss"] for r in map(json.loads, (
        line for line in out.stdout.splitlines() if line.startswith("{")))
        if "validationLoss" in r}
    job = load_job(config)
    four = job.spec.model_copy(update={"processes_per_node": 4})
    four.parallelism = four.parallelism.model_copy(update={"tensor": 2})
    result = evaluate.evaluate(four, job.name, evaluate.choose(four.checkpoint.dir, job.name, 4))
    assert result["microBatches"] == 3  # eval.batches: all of them, in one process
    assert result["validationLoss"] == pytest.approx(in_loop[4], rel=1e-5), (result, in_loop)
