"""bench/bench_fidelity.py: its loss is the trainer's validation loss on the sample's held-out
set, and plain bf16 counts as behind mixed precision only beyond the seed-to-seed spread."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

import bench_fidelity as fid

HLAT_DATA = [sys.executable, "-m", "hlat_trainer.data.cli"]


def results(finals: dict[str, list[float]]) -> dict[str, list[fid.Result]]:
    return {mode: [fid.Result(fid.Run(mode, seed), evals=[(10, f)])
                   for seed, f in enumerate(values, start=1)]
            for mode, values in finals.items()}


def goals(finals: dict[str, list[float]]) -> dict[str, bool]:
    a = argparse.Namespace(seeds=3, steps=100, lr=3e-4, min_lr=3e-5, eval_batches=4,
                           spike_lr=2e-2, images=Path("/nowhere"))
    precision = results(finals)
    beta = {"beta2 0.95": precision["bf16-sr"], "beta2 0.99": precision["bf16-sr"]}
    section = fid.section(a, "now", "header", precision, beta, {}, {}, 1.0)
    return {g.text.split(" (")[0]: g.met for g in section.goals}


BEHIND = "plain bf16 behind mixed precision by more than the seed-to-seed std"


def test_plain_bf16_is_behind_only_beyond_the_seed_to_seed_spread() -> None:
    spread = [5.9, 6.0, 6.1]  # std 0.08, 1.4% of 6.0
    close = {"fp32": spread, "mixed": spread, "bf16-sr": spread,
             "bf16": [v + 0.03 for v in spread]}  # +0.5%: inside the spread
    assert not goals(close)[BEHIND]
    apart = {**close, "bf16": [v + 0.3 for v in spread]}  # +5%
    assert goals(apart)[BEHIND]


def test_the_held_out_batches_are_the_trainer_s_and_never_trained_on(tmp_path: Path) -> None:
    subprocess.run([*HLAT_DATA, "sample", "--out", str(tmp_path), "--docs", "400"],
                   check=True, capture_output=True)
    held = fid.validation_batches(tmp_path, 4, 64, 2)
    assert len(held) == 4 and all(x.shape == (2, 64) for x, _ in held)
    trained = {tuple(row.tolist()) for x, _ in fid.batches(tmp_path, 50, 64, 2) for row in x}
    assert not trained & {tuple(row.tolist()) for x, _ in held for row in x}


def test_a_sample_without_a_held_out_set_is_refused_with_the_fix(tmp_path: Path) -> None:
    subprocess.run([*HLAT_DATA, "sample", "--out", str(tmp_path), "--docs", "2000"], check=True,
                   capture_output=True)
    with pytest.raises(SystemExit, match=r"no held-out set .*hlat-data sample --docs N"):
        fid.validation_batches(tmp_path, 4, 64, 2)
