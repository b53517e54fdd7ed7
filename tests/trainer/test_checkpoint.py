"""The checkpointer's asynchronous saves: staged once per save into buffers kept for the run."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from hlat_api.layout import step_dir
from hlat_trainer.checkpoint import Checkpointer


def _join_alone() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0,  # type: ignore[attr-defined]
                                world_size=1)


def test_each_asynchronous_save_holds_its_own_step_s_values(tmp_path: Path) -> None:
    """Training overwrites the weights in place the moment the save's copy is taken
    (`wait_staged`, what the engine calls before its update), while the write of that step
    (and, through the reused staging buffers, the next one's copy) is in flight: every
    checkpoint still holds exactly the values of its own step."""
    _join_alone()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    ck = Checkpointer(tmp_path, "job", keep=5, async_=True)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(step)
        expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        ck.save(step, {"model": model.state_dict()})
        ck.wait_staged()
        with torch.no_grad():  # the next steps train on at once, in place
            for p in model.parameters():
                p.mul_(-3.0)
    ck.wait()
    assert ck.committed == 3
    for step, values in expected.items():
        assert (step_dir(tmp_path, "job", step) / "done").exists()
        loaded = {k: torch.zeros_like(v) for k, v in values.items()}
        dcp_load({"model": loaded}, checkpoint_id=step_dir(tmp_path, "job", step))
        for name, value in values.items():
            assert torch.equal(loaded[name], value), (step, name)


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a checkpoint volume that fills during a save."""
    volume = tmp_path / "fsx"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(volume)], check=True)
    try:
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)


@pytest.mark.parametrize("floats", [300_000, 2_000_000])
def test_a_save_on_a_full_volume_says_the_volume_is_full(small_volume: Path, floats: int
                                                         ) -> None:
    """A volume that fills during a save: with 1.2 MB to write torch.save reports only
    "unexpected pos" (the write that hit the full disk is inside its zip writer), with 8 MB the
    OS's ENOSPC; either way the trainer's error says the volume is full, how full, and what to
    do, and the step stays incomplete."""
    _join_alone()
    ck = Checkpointer(small_volume, "job", keep=2, async_=False)
    with pytest.raises(OSError) as raised:
        ck.save(7, {"model": {"w": torch.randn(floats)}})
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC
    assert "No space left on device: checkpoint step_7" in message, message
    assert f"checkpoint volume {small_volume} has" in message and "MiB free of 1.0 MiB" in message
    assert "lower checkpoint.keep, or grow the volume" in message
    assert not (step_dir(small_volume, "job", 7) / "done").exists()


def test_an_asynchronous_save_on_a_full_volume_logs_that_the_volume_is_full(
        small_volume: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The asynchronous save's failure does not stop training (the next save may succeed); its
    error log says the volume is full, as the synchronous save's error does."""
    _join_alone()
    ck = Checkpointer(small_volume, "job", keep=2, async_=True)
    with caplog.at_level("ERROR", logger="hlat_trainer.checkpoint"):
        ck.save(7, {"model": {"w": torch.randn(300_000)}})
        ck.wait()
    assert "No space left on device: checkpoint step_7 could not be written" in caplog.text
    assert ck.committed != 7 and not (step_dir(small_volume, "job", 7) / "done").exists()
