"""bench/bench_gpu.py without a GPU: the recorded GPU run is shown as recorded, never as a
measurement of the current run, and the training-step table is built from the figures."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import bench_gpu
import report


def test_the_recorded_run_is_labelled_in_its_body_and_in_every_goal(tmp_path: Path) -> None:
    goal = report.verdict("On a GPU: SR AdamW <= 1.0x", {"median": 0.95}, lambda r: r <= 1.0)
    saved = report.Section("gpu", "t", "cmd", "Measured on **NVIDIA H200**.", [goal])
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(asdict(saved)))
    shown = bench_gpu.recorded_section(path)
    assert shown.body.startswith("**Recorded, not measured in this run**")
    assert "Measured on **NVIDIA H200**." in shown.body
    assert [g.figures for g in shown.goals] == ["recorded GPU run: 0.95 median"]
    assert shown.goals[0].met


def test_without_a_recorded_run_there_are_no_figures_and_no_goals(tmp_path: Path) -> None:
    shown = bench_gpu.recorded_section(tmp_path / "absent.json")
    assert "no figures" in shown.body and not shown.goals


def test_the_repository_carries_a_recorded_gpu_run_with_its_goal() -> None:
    shown = bench_gpu.recorded_section()
    assert "MFU" in shown.body and shown.goals


def test_mfu_is_the_model_flops_over_the_step_time_against_both_peaks() -> None:
    dims = bench_gpu.MODEL_PRESETS["1b"]
    args = argparse.Namespace(batch=8, seq_len=2048, rounds=3, steps=1, preset="1b")
    flops = dims.flops_per_token(2048) * 8 * 2048
    card = bench_gpu.Card("H200", 132, 140.0, "t", "t", "c", peak_tflops=1000.0,
                          matmul_tflops=800.0)
    step = flops / 400e12  # fastest at 400 TFLOP/s, median at 200: 40% and 20% of the peak
    train = ({"hlat": [step, 2 * step, 2 * step], "hf": [4 * step] * 3},
             {"hlat": 1.0, "hf": 2.0})
    table = bench_gpu.training_table(dims, card, train, args, "eager")
    ours = next(line for line in table.splitlines() if line.startswith("| hlat"))
    assert "| 20.0% | 40.0% | 25.0% |" in ours  # median, fastest; median vs the matmul rate
    assert "Ours / HF tokens/s: 2.000x median, 4.000x fastest" in table
