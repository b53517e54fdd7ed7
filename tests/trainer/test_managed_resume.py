"""ManagedEngine's resume across ranks (the neuron-xla path, driven by the CPU stand-in)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from test_distributed import STANDIN, layout, run, torchrun

from hlat_api.layout import DONE, PENDING_READER, READERS

pytestmark = pytest.mark.slow


def test_a_checkpoint_one_rank_cannot_read_is_skipped_by_all_before_any_collective_load(
    write_config: Callable[..., Path],
) -> None:
    """Rank 1 lost its shard of step_4. The ranks vote before loading, so all of them move to
    step_2; voting after the load would leave rank 0 waiting inside the load's collective
    while rank 1 waits in the vote (until the collective timeout)."""
    config = write_config(train__steps=4, checkpoint__interval=2, checkpoint__keep=3)
    sets = [*layout(2, 1), "checkpoint.dir=" + str(config.parent / "ck")]
    run(torchrun(config, 2, *sets, entry=(STANDIN,)))
    ck = config.parent / "ck" / "job"
    (ck / "step_4" / "shard_1.pt").unlink()
    resumed = run(torchrun(config, 2, *sets, "train.steps=6", entry=(STANDIN,)))
    assert json.loads(resumed.stdout.splitlines()[0])["step"] == 3
    assert "step_4 is not readable on every rank: trying an older one" in resumed.stderr
    assert (ck / "step_6" / "done").exists()


def test_retention_keeps_checkpoint_keep_and_spares_one_being_read(
    write_config: Callable[..., Path],
) -> None:
    """NxD is told to keep every checkpoint (num_kept_ckpts=None: its purge knows nothing of
    readers); ManagedEngine purges to checkpoint.keep itself and spares a checkpoint a reader
    holds (an evaluation Job's hlat-eval, or its sidecar), as the torch-native engines do."""
    config = write_config(train__steps=4, checkpoint__interval=2, checkpoint__keep=1)
    sets = [*layout(2, 1), "checkpoint.dir=" + str(config.parent / "ck")]
    run(torchrun(config, 2, *sets, entry=(STANDIN,)))
    ck = config.parent / "ck" / "job"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_4"]
    reader = ck / "step_4" / READERS / "an-evaluator"
    reader.parent.mkdir()
    reader.touch()  # fresh for READER_FRESH_SECONDS: longer than the run below
    resumed = run(torchrun(config, 2, *sets, "train.steps=8", entry=(STANDIN,)))
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_4", "step_8"], resumed.stderr
    assert "step_4 is being read" in resumed.stderr


def test_a_checkpoint_due_for_an_evaluation_job_is_held_from_its_save(
    write_config: Callable[..., Path],
) -> None:
    """spec.evaluation on the neuron-xla path: the checkpoint an evaluation Job will read is
    held (a pending reader dated to the Job's deadline) from its save on, as the torch-native
    engines hold it from their commit, so keep 1 does not delete it before the Job starts."""
    config = write_config(train__steps=6, checkpoint__interval=2, checkpoint__keep=1,
                          evaluation={"every": 2, "command": ["lm_eval"],
                                      "deadlineSeconds": 600})
    sets = [*layout(2, 1), "checkpoint.dir=" + str(config.parent / "ck")]
    run(torchrun(config, 2, *sets, entry=(STANDIN,)))
    ck = config.parent / "ck" / "job"
    kept = sorted(p.name for p in ck.glob("step_*") if (p / DONE).exists())
    assert kept == ["step_4", "step_6"], "the checkpoint due for evaluation (4) was deleted"
    assert (ck / "step_4" / READERS / PENDING_READER).exists()
