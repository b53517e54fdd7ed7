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
- Tensor-parallel peers: in the trainer every rank of a tensor-parallel group builds its own
  PackedLoader with the group's dp_rank, so the TP peers tokenize the same stream. Measured:
  `--peers` loader processes on the same stream (same dp_rank) pinned to one core, side by side,
  against one alone (alternating rounds): how the rate per loader divides. Computed: the
  tokenization per node of the paper's layouts on trn1.32xlarge (TP degree x the node's
  consumption), in cores at this run's one-core rate, against the node's vCPUs.

Run: `python bench/bench_loader.py [--data DIR] [--seq-len 128] [--micro-batch 4] [--peers 2]`
(without --data it writes a sample dataset to a temporary directory first).
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # before `tokenizers` starts its thread pool

import argparse
import hashlib
import multiprocessing
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import report
from hlat_api.presets import INSTANCE_TYPES, MODEL_PRESETS, PAPER_TENSOR_PARALLEL
from hlat_trainer.data import PackedLoader, load_tokenizer
from hlat_trainer.data.sample import write_sample

NODE = "trn1.32xlarge"
NODE_VCPUS = 128  # trn1.32xlarge (hlat_api.presets: 128 vCPU, 512 GiB)
NODE_TOKENS_PER_S_7B = 26_000.0
"""What one trn1.32xlarge consumes training a 7B model (TP 8): NxD's Llama2-7B benchmark,
93-101 sequences/s of 4,096 tokens on 16 nodes, about 24-26k tokens/s per node
(../shared/reference/performance-anchors.md, derived from aws-neuron-sdk's trn1 table)."""
PAPER_SEQ_LEN = 4096


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
    p.add_argument("--peers", type=int, default=2,
                   help="loaders on the same stream side by side on one core (0: skip)")
    p.add_argument("--peer-rounds", type=int, default=2,
                   help="rounds of (one loader alone, --peers side by side), alternating")
    return p.parse_args()


def make_loader(data: Path, tokenizer: str, args: argparse.Namespace) -> PackedLoader:
    return PackedLoader(
        str(data / "train.arrow"),
        load_tokenizer(tokenizer),
        text_column="text",
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        dp_rank=0,  # every loader of this bench reads the same stream, as TP peers do
        dp_size=1,
        seed=0,
        prefetch=8,
        # one lane per sequence, as the trainer reads (a rank of dp=1, globalBatch=microBatch)
        global_batch=args.micro_batch,
        lanes=args.micro_batch,
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


def peer(index: int, core: int, data: Path, tokenizer: str, args: argparse.Namespace,
         plan: list[list[int]], barrier: Any, out: Any) -> None:
    """One loader process, as one rank of a TP group: pinned to `core`, one torch thread.
    `plan`: per measurement, the peers that measure (the others wait at the barrier)."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    with make_loader(data, tokenizer, args) as loader:
        x, _ = next(loader)
        out.put(("first", index, hashlib.sha256(x.numpy().tobytes()).hexdigest()))
        for m, who in enumerate(plan):
            barrier.wait()
            if index in who:
                out.put(("rate", (m, index), loader_tokens_per_s(loader, args.seconds)))
            barrier.wait()


@dataclass
class Peers:
    count: int
    alone: list[float]  # one loader alone, tokens/s per round
    each: list[list[float]]  # per round, each side-by-side loader's tokens/s
    same_stream: bool  # the loaders' first batches were identical


def measure_peers(data: Path, tokenizer: str, args: argparse.Namespace, core: int) -> Peers:
    """`args.peers` loader processes on one core and one stream, alone vs side by side."""
    plan: list[list[int]] = []
    for r in range(args.peer_rounds):  # alternate, the order swapped each round
        pair = [[0], list(range(args.peers))]
        plan += pair if r % 2 == 0 else pair[::-1]
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(args.peers), ctx.Queue()
    procs = [ctx.Process(target=peer, args=(i, core, data, tokenizer, args, plan, barrier, out),
                         daemon=True)  # a peer left waiting at the barrier dies with us
             for i in range(args.peers)]
    for proc in procs:
        proc.start()
    first: dict[int, str] = {}
    rates: dict[tuple[int, int], float] = {}
    expected = args.peers + sum(len(who) for who in plan)
    for _ in range(expected):
        kind, key, value = out.get(timeout=300 + 4 * len(plan) * args.seconds)
        if kind == "first":
            first[key] = value
        else:
            rates[key] = value
    for proc in procs:
        proc.join(timeout=30)
    alone = [rates[m, 0] for m, who in enumerate(plan) if len(who) == 1]
    each = [[rates[m, i] for i in who] for m, who in enumerate(plan) if len(who) > 1]
    return Peers(args.peers, alone, each, len(set(first.values())) == 1)


def node_load(one_core: float) -> list[list[str]]:
    """The paper's layouts on trn1.32xlarge: tokenization per node with TP peers reading the
    same stream (as the trainer does) and with one loader per data-parallel replica."""
    ranks = INSTANCE_TYPES[NODE].ranks_per_node
    fpt = {k: MODEL_PRESETS[k].flops_per_token(PAPER_SEQ_LEN) for k in ("7b", "70b")}
    consumes = {"7b": NODE_TOKENS_PER_S_7B,
                "70b": NODE_TOKENS_PER_S_7B * fpt["7b"] / fpt["70b"]}
    rows = []
    for preset in ("7b", "70b"):
        tp = PAPER_TENSOR_PARALLEL[preset]
        per_node = tp * consumes[preset]  # ranks x (consumption / replicas), replicas = ranks/tp
        for label, work in (("TP peers each tokenize (the trainer)", per_node),
                            ("one loader per DP replica", consumes[preset])):
            cores = work / one_core
            rows.append([f"{preset.upper()}, TP {tp}", f"{ranks} ranks, {ranks // tp} replica(s)",
                         f"{consumes[preset]:,.0f}" + (" (derived)" if preset == "70b" else ""),
                         label, f"{work:,.0f}", f"{cores:.2f}",
                         report.pct(cores / NODE_VCPUS, 2)])
    return rows


def section(args: argparse.Namespace, when: str, threads: int, consumer: float,
            source: str, wait: float | None, rates: dict[str, float],
            peers: Peers | None) -> report.Section:
    bpe = rates["BPE 4096 (sample)"]
    consumer_table = report.table(
        ["consumer", "trainer tokens/s", "loader tokens/s, 1 core (BPE 4096)", "ratio",
         "loader tokens/s, 1 core (bytes)", "ratio", "data wait while training"],
        [[source, f"{consumer:,.0f}", f"{bpe:,.0f}", f"{bpe / consumer:,.0f}x",
          f"{rates['bytes']:,.0f}", f"{rates['bytes'] / consumer:,.0f}x",
          "-" if wait is None else report.pct(wait, 2)]])
    parts = [f"""Run {when}: the sample dataset (`{args.data}`), seq {args.seq_len}, micro-batch
{args.micro_batch}, {args.seconds:g} s per measurement. The consumer trains with {threads} torch
thread(s), its loader's thread alongside; the loader alone is pinned to one core with one torch
thread and one tokenizer (Rayon) thread and consumed as fast as possible. A ratio above 1 means
one core of tokenization keeps up with the consumer.""", consumer_table]
    if peers is not None:
        alone = statistics.median(peers.alone)
        each = [statistics.median(r[i] for r in peers.each) for i in range(peers.count)]
        total = statistics.median(sum(r) for r in peers.each)
        parts.append(f"""**Tensor-parallel peers.** In the trainer (`hlat_trainer/train.py`;
`backends/neuron_xla.py` takes dp_rank from NxD's parallel state) every rank of a
tensor-parallel group builds its own `PackedLoader` with the group's dp_rank: the TP peers
tokenize the same stream, each for itself. Measured here: {peers.count} loader processes with
the same dp_rank pinned to one core, side by side, against one alone, {args.peer_rounds}
round(s) each, alternating (medians over the rounds); their first batches were
{'identical' if peers.same_stream else 'NOT identical'}.""")
        parts.append(report.table(
            ["loaders on one core, same stream", "tokens/s per loader", "x one alone",
             "tokens/s, all together"],
            [["1 alone", f"{alone:,.0f}", "1.00", f"{alone:,.0f}"],
             *[[f"{peers.count} side by side, loader {i}", f"{r:,.0f}", f"{r / alone:.2f}",
                f"{total:,.0f}" if i == 0 else ""] for i, r in enumerate(each)]]))
        share = statistics.fmean(each) / alone
        parts.append(f"Side by side each loader ran at {share:.2f}x the rate of one alone "
                     f"(an even split of the core would give {1 / peers.count:.2f}x): the "
                     f"peers do the same tokenization {peers.count} times over, none of it "
                     "shared, so a TP group of t ranks costs t times one loader's CPU.")
    ranks = INSTANCE_TYPES[NODE].ranks_per_node
    parts.append(f"""**Per node, the paper's layouts on {NODE}** ({ranks} NeuronCores = ranks
per node, {NODE_VCPUS} vCPUs; TP degrees from
`hlat_api.presets.PAPER_TENSOR_PARALLEL`). With TP peers tokenizing the same stream, a node
tokenizes (ranks per node) x (tokens per data-parallel replica) = TP degree x what the node
consumes. Cores are at this run's one-core BPE rate ({bpe:,.0f} tokens/s, the sample's
4,096-token vocabulary on the sample corpus; the paper's tokenizer and text differ).""")
    parts.append(report.table(
        ["model, layout", "per node", "node consumes tokens/s", "who tokenizes",
         "tokenized per node, tokens/s", "cores at this run's rate",
         f"share of the node's {NODE_VCPUS} vCPUs"], node_load(bpe)))
    parts.append(f"""What a node consumes: 7B, {NODE_TOKENS_PER_S_7B:,.0f} tokens/s (NxD's
Llama2-7B benchmark on trn1.32xlarge at TP 8, performance-anchors.md); 70B has no published
figure on trn1, so it is derived: 7B's rate x the ratio of their training FLOPs per token at
seq {PAPER_SEQ_LEN} (`ModelDims.flops_per_token`), i.e. the same MFU assumed. "One loader per
DP replica" is what a node would tokenize if one rank of each TP group fed its peers.""")
    return report.Section("loader", "Data loader tokens/s on one core vs what the trainer "
                          "consumes", report.command(), "\n\n".join(parts))


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
    when = report.now()
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
        consumer, source, wait = args.consumer_tokens_per_s, "given on the command line", None

    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
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
    peers = None
    if args.peers > 1:
        peers = measure_peers(args.data, bpe, args, core)
        print(f"{args.peers} loaders, same stream, one core ("
              f"{'identical' if peers.same_stream else 'DIFFERENT'} first batches): alone "
              f"{statistics.median(peers.alone):,.0f} tokens/s; side by side, each "
              + ", ".join(f"{statistics.median(r[i] for r in peers.each):,.0f}"
                          for i in range(args.peers)))
    sec = section(args, when, threads, consumer, source, wait, rates, peers)
    for row in node_load(rates["BPE 4096 (sample)"]):
        print("  " + " | ".join(row))
    report.emit(sec)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
