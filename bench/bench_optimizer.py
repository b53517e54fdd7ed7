"""Benchmark (2): AdamWSR on bf16 weights vs torch.optim.AdamW(foreach) on fp32 master weights.

Why: the paper's case for BF16 + stochastic rounding is "same convergence, less memory, more
throughput". This measures the optimizer's share of that claim side by side in one process:
the step time and the bytes of parameters + gradients + optimizer state, for the parameter
shapes of a LLaMA preset (default 125m: untied embedding and head, fused QKV and gate/up).
The goal (issue 16): bf16-sr at <= 1.05x the baseline's step time and <= 0.75x its memory.

Variants (the baseline is "mixed", fp32 master weights as bf16 autocast training keeps them):
- mixed:        torch.optim.AdamW(foreach=True), fp32 params and grads, fp32 moments.
- bf16:         torch.optim.AdamW(foreach=True) on bf16 params (round to nearest), bf16 moments.
- bf16-sr:      AdamWSR, bf16 params and grads, fp32 moments (the default state_dtype).
- bf16-sr/bf16: AdamWSR with state_dtype=bfloat16 (the paper's all-bf16 footprint).

Made to decide the goal on a shared machine: steps run round-robin (one step of each variant
per round, the order rotated each round) so drifting load hits all alike; after warm-up rounds
each variant's median and fastest round are reported with the spread (the interquartile range
as a fraction of the median, and the slowest round), and a time ratio is called met only when
it holds for both the medians and the fastest rounds. One thread by default (--threads).
Gradients are fixed random tensors: the update's cost does not depend on their values. Memory
is counted from the tensors themselves (steady state); transient buffers are not included
(torch's foreach AdamW allocates one fp32 buffer the size of the model for sqrt(v) each step;
AdamWSR allocates none).

Run: .venv/bin/python bench/bench_optimizer.py [--preset 125m] [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import report
from hlat_api import MODEL_PRESETS, ModelDims
from hlat_trainer.optim import AdamWSR


def parameter_shapes(dims: ModelDims) -> list[tuple[int, ...]]:
    """The shapes of hlat_trainer.model's parameters for these dimensions, in model order."""
    h, kv_dim = dims.hidden_size, dims.kv_heads * dims.head_dim
    layer: list[tuple[int, ...]] = [
        (h,), (h + 2 * kv_dim, h), (h, h),  # attention norm, fused QKV, output projection
        (h,), (2 * dims.intermediate_size, h), (h, dims.intermediate_size),  # ffn
    ]
    return [(dims.vocab_size, h), *layer * dims.layers, (h,), (dims.vocab_size, h)]


@dataclass
class Variant:
    name: str
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    times: list[float]

    def state_bytes(self) -> int:
        tensors = [*self.params, *(p.grad for p in self.params if p.grad is not None)]
        tensors += [v for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def make_variant(name: str, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str,
                 build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> Variant:
    # values do not change the cost; slices of one random pool keep the set-up quick
    pool = torch.randn(max(torch.Size(s).numel() for s in shapes) + 1,
                       generator=torch.Generator().manual_seed(0))
    params = []
    for i, shape in enumerate(shapes):
        n = torch.Size(shape).numel()
        p = torch.nn.Parameter((0.02 * pool[:n]).view(shape).to(device, dtype))
        p.grad = (1e-3 * pool[1:n + 1]).view(shape).to(device, dtype) * (1 + i % 3)
        params.append(p)
    return Variant(name, params, build(params), [])


def build_variants(shapes: list[tuple[int, ...]], device: str) -> list[Variant]:
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

    def adamw(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, foreach=True, **hyper)  # type: ignore[arg-type]

    def sr(state_dtype: torch.dtype) -> Callable[[list[torch.nn.Parameter]], AdamWSR]:
        return lambda ps: AdamWSR(ps, seed=0, state_dtype=state_dtype, **hyper)  # type: ignore[arg-type]

    return [
        make_variant("mixed (fp32 AdamW)", shapes, torch.float32, device, adamw),
        make_variant("bf16 (nearest)", shapes, torch.bfloat16, device, adamw),
        make_variant("bf16-sr", shapes, torch.bfloat16, device, sr(torch.float32)),
        make_variant("bf16-sr, bf16 state", shapes, torch.bfloat16, device, sr(torch.bfloat16)),
    ]


def timed_step(variant: Variant, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    variant.optimizer.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def summarise(variants: list[Variant], n_params: int, args: argparse.Namespace,
              header: str) -> report.Section:
    """Print the table and the goals; the same figures as the report's section."""
    base = variants[0]
    base_median, base_min, base_bytes = (statistics.median(base.times), min(base.times),
                                         base.state_bytes())
    print(f"{'variant':<22} {'median ms':>10} {'x mixed':>8} {'min ms':>8} {'x mixed':>8} "
          f"{'IQR/med':>8} {'max ms':>8} {'GiB p+g+state':>14} {'B/param':>8} {'x mixed':>8}")
    rows = []
    for v in variants:
        median, fastest, b = statistics.median(v.times), min(v.times), v.state_bytes()
        print(f"{v.name:<22} {1e3 * median:>10.1f} {median / base_median:>8.2f} "
              f"{1e3 * fastest:>8.1f} {fastest / base_min:>8.2f} "
              f"{report.spread(v.times):>8.1%} {1e3 * max(v.times):>8.1f} "
              f"{b / 2**30:>14.3f} {b / n_params:>8.1f} {b / base_bytes:>8.2f}")
        rows.append([LABELS.get(v.name, v.name), f"{1e3 * median:.1f}",
                     f"{median / base_median:.3f}", f"{1e3 * fastest:.1f}",
                     f"{fastest / base_min:.3f}", report.pct(report.spread(v.times), 0),
                     f"{1e3 * max(v.times):.1f}", f"{b / n_params:.1f}",
                     f"{b / base_bytes:.3f}"])
    print(f"{len(base.times)} rounds; median: over rounds; min: the fastest round")
    sr = next(v for v in variants if v.name == "bf16-sr")
    ratios = {"median": statistics.median(sr.times) / base_median,
              "fastest round": min(sr.times) / base_min}
    memory = sr.state_bytes() / base_bytes  # 12/16, plus both sides' 4-byte step counters:
    memory = round(memory, 4)  # 0.75 + 1e-7 from those counters is 0.75
    goals = [
        report.verdict(f"SR AdamW (`AdamWSR`, fp32 moments) step time <= {TIME_GOAL}x torch "
                       "AdamW (foreach, fp32 master)", ratios, lambda r: r <= TIME_GOAL,
                       "{:.3f}x"),
        report.verdict(f"SR AdamW memory (weights + grads + state) <= {MEMORY_GOAL}x torch "
                       "AdamW's", {"steady-state tensors": memory},
                       lambda r: r <= MEMORY_GOAL, "{:.3f}x"),
    ]
    for g in goals:
        print(f"goal {g.line().replace('**', '')}")
    body = f"""{header}

Steps alternate between the variants round by round (the order rotated each round), so
drifting load hits all alike: {args.warmup} warm-up round(s), then {args.rounds} timed. The
fastest round and the spread (interquartile range over the median) stand beside the median;
a time ratio is called met only when it holds for both the median and the fastest round.
Gradients are fixed random tensors (the update's cost does not depend on their values).

{report.table(["variant", "median ms/step", "x mixed", "fastest ms", "x mixed",
               "IQR / median", "slowest ms", "bytes/param (weights+grads+state)", "x mixed"],
              rows)}

Memory is counted from the tensors themselves (steady state). Transient buffers are not
included: torch's foreach AdamW allocates a temporary fp32 buffer the size of the model for
sqrt(v) each step, `AdamWSR` allocates nothing per step. `AdamWSR` makes one pass per tensor
(`hlat_trainer/sr_kernel.py`, the C++ loop in `csrc/sr_adamw.cpp`, built with g++ at first
use): it reads the bf16 weight and gradient and the fp32 moments once, updates in fp32
registers and writes back 2 + 4 + 4 bytes per parameter, where torch's foreach AdamW makes
several elementwise passes over fp32 tensors. The rounding noise is a hash of (step key,
tensor, element) computed in registers, not a generator's serial output. Without a C++
compiler `AdamWSR` warns once and runs a pure-torch path with bit-identical results, much
slower; that path is not measured here."""
    return report.Section("optimizer", "Stochastic-rounding AdamW vs torch AdamW with fp32 "
                          "master weights", report.command(), body, goals)


LABELS = {
    "mixed (fp32 AdamW)": "mixed: torch AdamW (foreach), fp32 master",
    "bf16 (nearest)": "bf16 round-to-nearest, torch AdamW",
    "bf16-sr": "bf16-sr, `AdamWSR` (fp32 moments, default)",
    "bf16-sr, bf16 state": "bf16-sr, `AdamWSR` (bf16 moments)",
}


TIME_GOAL, MEMORY_GOAL = 1.05, 0.75


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="125m", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds after warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error("--rounds must be at least 4 (quartiles for the spread)")

    torch.set_num_threads(args.threads)
    shapes = parameter_shapes(MODEL_PRESETS[args.preset])
    n_params = sum(torch.Size(s).numel() for s in shapes)
    header = (f"Run {report.now()}: preset {args.preset}'s parameter shapes, "
              f"{n_params / 1e6:.1f}M parameters in {len(shapes)} tensors; device "
              f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} "
              f"thread(s), {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f} at the start")
    print(header)
    variants = build_variants(shapes, args.device)
    for round_ in range(args.warmup + args.rounds):
        shift = round_ % len(variants)  # rotate: no variant always runs after the same one
        for v in variants[shift:] + variants[:shift]:
            elapsed = timed_step(v, args.device)
            if round_ >= args.warmup:  # warm-up: lazy state, the kernel's build, page faults
                v.times.append(elapsed)
    report.emit(summarise(variants, n_params, args, header))


if __name__ == "__main__":
    main()
