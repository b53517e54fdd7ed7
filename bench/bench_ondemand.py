"""Checkpoints asked for at a stop: what the ranks' per-step agreement costs training.

A gang told to stop (a Kueue preemption, spec.suspend) is asked for a checkpoint through its
Leases; every rank then agrees on the step to save by an asynchronous MAX all-reduce on the
host's gloo group, once a step, for as long as the job runs (`hlat_trainer.ondemand`). This
benchmark measures what that costs a job that is never stopped: the trainer's own loop under
torchrun, 2 ranks on this machine, with the agreement on (the heartbeat Lease named in the
environment, as in an operator's pod; no API server, so nothing is ever asked) and off, the
two in alternating order each round. Figure: the mean step time of the timed window
(`stepSeconds` of every step after the warm-up), on against off in the same round.

The model is small on purpose (a step of a few tens of milliseconds): the agreement's cost is
per step, not per FLOP, so a small step shows it largest. A trn1 step of the paper's 7B takes
seconds.

    .venv/bin/python bench/bench_ondemand.py [--rounds 5] [--steps 300] [--warmup 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

import report
from hlat_api import Env
from hlat_trainer.data.sample import write_sample

ARMS = ("off", "on")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spec(data: Path, ckpt: Path, steps: int) -> dict[str, Any]:
    return {
        "instanceType": "cpu", "processesPerNode": 2,
        "model": {"preset": "tiny", "hiddenSize": 64, "layers": 2, "intermediateSize": 192,
                  "vocabSize": 4096, "maxSeqLen": 128},
        "precision": "fp32",
        "optimizer": {"lr": 3e-3, "minLr": 3e-4, "warmupSteps": 2},
        "data": {"path": str(data / "train.arrow"), "tokenizer": str(data / "tokenizer.json"),
                 "seqLen": 64},
        "train": {"globalBatch": 4, "microBatch": 2, "steps": steps, "seed": 7,
                  "logInterval": 1},
        "checkpoint": {"dir": str(ckpt), "interval": steps, "keep": 1, "async": False},
    }


def run_once(root: Path, config: Path, arm: str, warmup: int) -> float:
    """The mean step time (s) of the steps after `warmup`, from rank 0's JSON lines."""
    shutil.rmtree(root / arm, ignore_errors=True)  # a fresh run, not a resume of the last
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HLAT_COLLECTIVE_TIMEOUT_SECONDS": "120"}
    env.pop(Env.HEARTBEAT_LEASE, None)
    if arm == "on":
        env[Env.HEARTBEAT_LEASE] = "bench-0"  # requests on; no token: no heartbeat
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{_free_port()}", "-m", "hlat_trainer", "--config", str(config),
           "--set", f"checkpoint.dir={root / arm}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{arm}: the trainer failed:\n{done.stderr[-3000:]}")
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    times = [x["stepSeconds"] for x in lines if x["step"] > warmup]
    return statistics.fmean(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20, help="steps before the timed window")
    a = p.parse_args()
    when = report.now()
    root = Path(tempfile.mkdtemp(prefix="hlat-bench-ondemand-"))
    data = root / "data"
    write_sample(data)
    config = root / "job.yaml"
    config.write_text(yaml.safe_dump({"kind": "PretrainJob", "metadata": {"name": "bench"},
                                      "spec": spec(data, root / "ckpt", a.steps)}))
    rows: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(a.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            rows[arm].append(run_once(root, config, arm, a.warmup))
            print(f"round {r} {arm}: {rows[arm][-1] * 1e3:.2f} ms a step", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    report.emit(summarise(rows, a, when))


def summarise(rows: dict[str, list[float]], a: argparse.Namespace, when: str
              ) -> report.Section:
    ratios = [on / off for on, off in zip(rows["on"], rows["off"], strict=True)]
    med, best = statistics.median(ratios), min(ratios)  # best: the lowest round's
    off_ms = statistics.median(rows["off"]) * 1e3
    on_ms = statistics.median(rows["on"]) * 1e3
    head = (f"2 ranks (torchrun, gloo) of a 0.6M-parameter model, {a.rounds} round(s) of "
            f"{a.steps - a.warmup} timed steps; {platform.machine()}, "
            f"{os.cpu_count()} vCPUs, torch {torch.__version__}")
    print(f"state: {head}")
    cost_ms = statistics.median(on - off for on, off in zip(rows["on"], rows["off"],
                                                             strict=True)) * 1e3
    print(f"step {off_ms:.2f} ms off, {on_ms:.2f} ms on (medians); on/off {med:.4f} median, "
          f"{best:.4f} lowest round, spread {report.spread(ratios):.4f}; {cost_ms:+.3f} ms a "
          f"step (median of the rounds' differences)")
    mean = statistics.fmean(ratios)
    goals = [report.verdict("the per-step agreement costs <= 1% of the step time",
                            {"median": med - 1, "mean over rounds": mean - 1},
                            lambda f: f <= 0.01, "{:+.2%}")]
    for g in goals:
        print(f"goal {g.line().replace('**', '')}")
    table = report.table(
        ["round", "step off (ms)", "step on (ms)", "on / off"],
        [[str(i), f"{off * 1e3:.2f}", f"{on * 1e3:.2f}", f"{on / off:.4f}"]
         for i, (off, on) in enumerate(zip(rows["off"], rows["on"], strict=True))])
    body = f"""Run {when}: {head}. Each round runs the trainer twice under torchrun, the
agreement off and on (`HLAT_HEARTBEAT_LEASE` set, as in an operator's pod; no API server, so
no request ever comes and only the agreement runs), in alternating order. Figure: the mean
`stepSeconds` of rank 0's steps after the first {a.warmup}. Median step {off_ms:.2f} ms off,
{on_ms:.2f} ms on; the rounds' differences have a median of {cost_ms:+.3f} ms a step. The step
here is tens of milliseconds, so a per-step cost shows larger than on a trn1 step of
seconds.

{table}

What a preemption costs with the checkpoint asked for is measured end to end in
tests/operator/test_e2e_kueue.py (it prints the steps trained twice): see docs/operator.md,
"Checkpoints asked for"."""
    return report.Section("ondemand", "Checkpoints asked for at a stop: the per-step "
                          "agreement's cost", report.command(), body, goals)


if __name__ == "__main__":
    main()
