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


def spread(times: list[float]) -> float:
    """Interquartile range over the median: how far rounds of one variant scatter."""
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


def report(variants: list[Variant], n_params: int) -> None:
    base = variants[0]
    base_median, base_min, base_bytes = (statistics.median(base.times), min(base.times),
                                         base.state_bytes())
    print(f"{'variant':<22} {'median ms':>10} {'x mixed':>8} {'min ms':>8} {'x mixed':>8} "
          f"{'IQR/med':>8} {'max ms':>8} {'GiB p+g+state':>14} {'B/param':>8} {'x mixed':>8}")
    for v in variants:
        median, fastest, b = statistics.median(v.times), min(v.times), v.state_bytes()
        print(f"{v.name:<22} {1e3 * median:>10.1f} {median / base_median:>8.2f} "
              f"{1e3 * fastest:>8.1f} {fastest / base_min:>8.2f} {spread(v.times):>8.1%} "
              f"{1e3 * max(v.times):>8.1f} {b / 2**30:>14.3f} {b / n_params:>8.1f} "
              f"{b / base_bytes:>8.2f}")
    print(f"{len(base.times)} rounds; median: over rounds; min: the fastest round")
    sr = next(v for v in variants if v.name == "bf16-sr")
    ratios = (statistics.median(sr.times) / base_median, min(sr.times) / base_min)
    memory = sr.state_bytes() / base_bytes  # 12/16, plus both sides' 4-byte step counters:
    memory = round(memory, 4)  # 0.75 + 1e-7 from those counters is 0.75
    time_met = all(r <= TIME_GOAL for r in ratios)
    print(f"goal bf16-sr time <= {TIME_GOAL}x mixed: {'met' if time_met else 'NOT met'} "
          f"(median {ratios[0]:.3f}x, fastest {ratios[1]:.3f}x); memory <= {MEMORY_GOAL}x: "
          f"{'met' if memory <= MEMORY_GOAL else 'NOT met'} ({memory:.3f}x)")


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
    print(f"preset {args.preset}: {n_params / 1e6:.1f}M parameters in {len(shapes)} tensors; "
          f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    variants = build_variants(shapes, args.device)
    for round_ in range(args.warmup + args.rounds):
        shift = round_ % len(variants)  # rotate: no variant always runs after the same one
        for v in variants[shift:] + variants[:shift]:
            elapsed = timed_step(v, args.device)
            if round_ >= args.warmup:  # warm-up: lazy state, the kernel's build, page faults
                v.times.append(elapsed)
    report(variants, n_params)


if __name__ == "__main__":
    main()
