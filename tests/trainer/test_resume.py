"""Exact resume: a run killed after its checkpoint at N and started again equals an
uninterrupted run, step for step and bit for bit (losses and gradient norms), on CPU."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TRAIN = [sys.executable, "-m", "hlat_trainer"]


def records(stdout: str) -> list[dict[str, float]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def run_to_end(config: Path, ckpt: Path) -> list[dict[str, float]]:
    done = subprocess.run([*TRAIN, "--config", str(config), "--set", f"checkpoint.dir={ckpt}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return records(done.stdout)


def run_and_kill_after(config: Path, ckpt: Path, step: int) -> list[dict[str, float]]:
    """SIGKILL the trainer as soon as it reports `step` (its checkpoint is then complete)."""
    proc = subprocess.Popen([*TRAIN, "--config", str(config), "--set", f"checkpoint.dir={ckpt}"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(json.loads(line))
            if seen[-1]["step"] == step:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-sr", "mixed"])
def test_killed_and_resumed_run_equals_uninterrupted_run(
    write_config: Callable[..., Path], tmp_path: Path, precision: str
) -> None:
    n = 3
    config = write_config(precision=precision, train__steps=2 * n, checkpoint__interval=n)
    straight = run_to_end(config, tmp_path / "a")
    before = run_and_kill_after(config, tmp_path / "b", n)
    assert (tmp_path / "b" / "job" / f"step_{n}" / "done").exists()
    assert not (tmp_path / "b" / "job" / f"step_{2 * n}").exists()
    after = run_to_end(config, tmp_path / "b")

    assert [r["step"] for r in straight] == list(range(1, 2 * n + 1))
    assert after[0]["step"] == n + 1, "a run resumed from step_N must log step N+1 first"
    resumed = before[:n] + after
    for key in ("loss", "gradNorm", "paramNorm", "lr", "tokens"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
