"""ManagedEngine's resume across ranks (the neuron-xla path, driven by the CPU stand-in)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from test_distributed import STANDIN, layout, run, torchrun

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
