"""Training time lost to checkpoints: the trainer's own loop saving every N steps vs never,
synchronous vs asynchronous, side by side in one run.

Each round runs the real `hlat_trainer.train.Trainer` (model, AdamW state, packing loader, its
one Checkpointer for the run) on the sample corpus once per mode, the modes in rotated order:

- `none`: no checkpoint inside the timed window (the baseline);
- `sync`: DCP `save` every N steps;
- `async`: DCP `async_save` every N steps with the run's one stager (buffers reused);
- `async-fresh`: the same with new staging buffers at every save (DCP's default without a
  stager: what the trainer did before), to show what the reused buffers save.

Measured per mode: the wall time of the timed window of steps (after warm-up, before the final
save), so the time lost includes what the background write takes from training on a shared
machine, not only the blocking; the blocking per save (the trainer's goodput ledger: all that
the save held the loop); and, once, the time to resume from the newest checkpoint. The median
and the fastest round are reported, with the spread; a ratio is called met only when it holds
on both. "At the paper's cadence" extrapolates the lost seconds per save to one save every
1000 steps (the NxD examples' interval) at this loop's step time.

    .venv/bin/python bench/bench_checkpoint.py [--data DIR] [--rounds 3] [--steps 32] [--every 8]
"""

from __future__ import annotations

import argparse
import logging
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from hlat_api.manifest import load_job
from hlat_trainer.data.sample import write_sample
from hlat_trainer.train import Trainer

MODES = ("none", "sync", "async", "async-fresh")
PAPER_CADENCE = 1000


def spec(data: Path, ckpt: Path, steps: int, every: int, mode: str) -> dict[str, Any]:
    """A ~30M-parameter LLaMA (fp32 weights + AdamW moments: ~0.35 GiB of state)."""
    return {
        "instanceType": "cpu",
        "model": {"preset": "tiny", "hiddenSize": 512, "layers": 8, "heads": 8, "kvHeads": 8,
                  "intermediateSize": 1408, "vocabSize": 4096, "maxSeqLen": 256},
        "precision": "fp32",
        "optimizer": {"lr": 3e-4, "minLr": 3e-5, "warmupSteps": 2},
        "data": {"path": str(data / "train.arrow"), "tokenizer": str(data / "tokenizer.json"),
                 "seqLen": 128},
        "train": {"globalBatch": 2, "microBatch": 2, "steps": steps, "seed": 7,
                  "logInterval": 1},
        "checkpoint": {"dir": str(ckpt), "interval": steps if mode == "none" else every,
                       "keep": 2, "async": mode.startswith("async")},
    }


def run_once(data: Path, root: Path, a: argparse.Namespace, mode: str) -> dict[str, float]:
    ckpt = root / mode
    shutil.rmtree(ckpt, ignore_errors=True)
    path = root / f"{mode}.yaml"
    path.write_text(yaml.safe_dump({"kind": "PretrainJob", "metadata": {"name": "bench"},
                                    "spec": spec(data, ckpt, a.steps, a.every, mode)}))
    stamps: dict[int, float] = {}
    trainer = Trainer(load_job(path), sinks=[lambda s: stamps.__setitem__(
        int(s["step"]), time.perf_counter())])
    if mode == "async-fresh":
        trainer.engine.checkpointer.stager = None  # type: ignore[attr-defined]
    trainer.run()
    every = a.steps if mode == "none" else a.every
    # the ledger's checkpoint time covers every save, the final one at the last step included
    saved = [s for s in range(1, a.steps + 1) if s % every == 0 or s == a.steps]
    window = stamps[a.steps - 1] - stamps[a.warmup]
    out = {"window": window, "blocked": trainer.ledger.seconds["checkpoint"] / len(saved),
           "saves": float(sum(a.warmup < s < a.steps for s in saved))}
    if mode == "async":  # resume from its newest checkpoint: a new trainer's maybe_resume
        again = Trainer(load_job(path))
        start = time.perf_counter()
        out["resumed_at"] = float(again.maybe_resume())
        out["resume"] = time.perf_counter() - start
        again.loader.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="dir with train.arrow + tokenizer.json (sample)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed window")
    p.add_argument("--dir", type=Path, help="where checkpoints go (default: a temp dir)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.data is None:
        a.data = Path(tempfile.mkdtemp(prefix="hlat-bench-data-"))
        write_sample(a.data)
    root = Path(tempfile.mkdtemp(dir=a.dir, prefix="hlat-bench-ckpt-"))
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            rows[mode].append(run_once(a.data, root, a, mode))
    shutil.rmtree(root, ignore_errors=True)

    steps = a.steps - 1 - a.warmup
    base = [row["window"] for row in rows["none"]]
    step_time = statistics.median(base) / steps
    print(f"state: ~30M-param model, fp32 + AdamW (~0.35 GiB); {a.rounds} rounds of {steps} "
          f"timed steps, a save every {a.every} steps; {platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; step "
          f"{step_time:.3f} s without saves")
    print(f"{'mode':<13}{'blocks/save s':>14}{'lost/save s':>13}{'time lost':>11}"
          f"{'fastest':>9}{'spread':>8}{f'at 1/{PAPER_CADENCE}':>10}")
    lost: dict[str, tuple[float, float]] = {}
    for mode in MODES[1:]:
        saves = rows[mode][0]["saves"]
        # per round: this mode's window against the baseline's window of the same round
        fractions = [row["window"] / b - 1 for row, b in zip(rows[mode], base, strict=True)]
        med, best = statistics.median(fractions), min(fractions)
        spread = (max(fractions) - min(fractions))
        per_save = med * statistics.median(base) / saves
        cadence = per_save / (PAPER_CADENCE * step_time)
        blocked = statistics.median(row["blocked"] for row in rows[mode])
        lost[mode] = (blocked, min(row["blocked"] for row in rows[mode]))
        print(f"{mode:<13}{blocked:>14.3f}{per_save:>13.3f}{med:>10.1%}{best:>9.1%}"
              f"{spread:>8.1%}{cadence:>10.2%}")
    sync_med, sync_best = lost["sync"]
    async_med, async_best = lost["async"]
    ratio_med = async_med / sync_med
    ratio_best = async_best / sync_best
    met = ratio_med <= 1 / 20 and ratio_best <= 1 / 20
    print(f"async / sync blocking: {ratio_med:.3f} median, {ratio_best:.3f} fastest "
          f"(goal <= 0.050): {'met' if met else 'NOT met'}; reused vs fresh staging "
          f"buffers: {lost['async'][0] / lost['async-fresh'][0]:.2f}x the blocking")
    resume = statistics.median(row["resume"] for row in rows["async"])
    print(f"resume (a new trainer loading step {int(rows['async'][0]['resumed_at'])}): "
          f"{resume:.2f} s median")


if __name__ == "__main__":
    main()
