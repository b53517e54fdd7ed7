"""Benchmark (3): loader tokens/s on ONE core vs the tokens/s the trainer consumes.

Why: the paper's claim for online packing (section 3.3) is that tokenizing during training
costs no throughput, which holds while one CPU core tokenizes faster than the accelerator
trains. This prints both rates, measured in the same run, and their ratio (> 1 means the loader
keeps up; the trainer needs ratio x fewer cores than one for its data).

- Consumer: the trainer's tiny model (`hlat_trainer.model`, preset `tiny`, fp32, AdamW) training
  on real batches at the usual thread count; or `--consumer-tokens-per-s N` for another figure
  (e.g. a 7B model's tokens/s per data-parallel rank on the real hardware).
- Loader: `PackedLoader` with the sample BPE tokenizer, consumed as fast as possible, with the
  process pinned to one core (sched_setaffinity), one torch thread and one Rayon thread.
- Also: the data-wait fraction of the tiny training loop fed by the loader (loader thread and
  training sharing the machine), which is what the trainer's "data wait" metric shows.

Run: `python bench/bench_loader.py [--data DIR] [--seq-len 128] [--micro-batch 4]`
(without --data it writes a sample dataset to a temporary directory first).
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # before `tokenizers` starts its thread pool

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch

from hlat_trainer.data import PackedLoader, load_tokenizer
from hlat_trainer.data.sample import write_sample


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="dir with train.arrow + tokenizer.json (sample)")
    p.add_argument("--seq-len", type=int, default=128, help="as examples/pretrainjob-tiny.yaml")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0, help="time per measurement")
    p.add_argument(
        "--train-threads", type=int, help="torch threads for the consumer (default: all)"
    )
    p.add_argument("--consumer-tokens-per-s", type=float, help="skip measuring the consumer")
    return p.parse_args()


def make_loader(data: Path, tokenizer: str, args: argparse.Namespace) -> PackedLoader:
    return PackedLoader(
        str(data / "train.arrow"),
        load_tokenizer(tokenizer),
        text_column="text",
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        dp_rank=0,
        dp_size=1,
        seed=0,
        prefetch=8,
    )


def loader_tokens_per_s(loader: PackedLoader, seconds: float) -> float:
    """Tokens/s the loader delivers to a consumer that does nothing else."""
    next(loader)  # thread start, first permutation
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(loader)
        n += 1
    return n * loader.tokens_per_batch / (time.perf_counter() - t0)


def train_tokens_per_s(loader: PackedLoader, seconds: float) -> tuple[float, float]:
    """Tokens/s of the tiny model training on the loader's batches, and the data-wait share."""
    from hlat_api.presets import MODEL_PRESETS
    from hlat_trainer.model import build_model

    model = build_model(MODEL_PRESETS["tiny"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        x, y = next(loader)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()  # warm-up
    n, wait0, t0 = 0, loader.wait_seconds, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    elapsed = time.perf_counter() - t0
    return n * loader.tokens_per_batch / elapsed, (loader.wait_seconds - wait0) / elapsed


def main() -> None:
    args = parse_args()
    tmp = None
    if args.data is None:
        tmp = tempfile.TemporaryDirectory(prefix="hlat-bench-")
        args.data = Path(tmp.name)
        write_sample(args.data)
    bpe = str(args.data / "tokenizer.json")
    if args.train_threads:
        torch.set_num_threads(args.train_threads)
    threads = torch.get_num_threads()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, seq_len {args.seq_len}, micro_batch {args.micro_batch}"
    )

    if args.consumer_tokens_per_s is None:
        with make_loader(args.data, bpe, args) as loader:
            consumer, wait = train_tokens_per_s(loader, args.seconds)
        source = f"tiny model training, {threads} torch threads, loader alongside"
        print(f"data wait while training: {100 * wait:.2f}% of the time")
    else:
        consumer, source = args.consumer_tokens_per_s, "given on the command line"

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    rates = {}
    for name, spec in (("BPE 4096 (sample)", bpe), ("bytes", "bytes")):
        with make_loader(args.data, spec, args) as loader:
            rates[name] = loader_tokens_per_s(loader, args.seconds)

    print(f"consumer: {source}")
    print(f"{'':34} {'tokens/s':>12} {'loader/consumer':>16}")
    print(f"{'trainer consumes':34} {consumer:12,.0f}")
    for name, rate in rates.items():
        print(f"{'loader, 1 core, ' + name:34} {rate:12,.0f} {rate / consumer:16.1f}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
