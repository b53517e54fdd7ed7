"""Benchmark (2): AdamWSR on bf16 weights vs torch.optim.AdamW(foreach) on fp32 master weights.

Why: the paper's case for BF16 + stochastic rounding is "same convergence, less memory, more
throughput". This measures the optimizer's share of that claim side by side in one process:
the step time and the bytes of parameters + gradients + optimizer state, for the parameter
shapes of a LLaMA preset (default 125m: untied embedding and head, fused QKV and gate/up).

Variants (the baseline is "mixed", fp32 master weights as bf16 autocast training keeps them):
- mixed:        torch.optim.AdamW(foreach=True), fp32 params and grads, fp32 moments.
- bf16:         torch.optim.AdamW(foreach=True) on bf16 params (round to nearest), bf16 moments.
- bf16-sr:      AdamWSR, bf16 params and grads, fp32 moments (the default state_dtype).
- bf16-sr/bf16: AdamWSR with state_dtype=bfloat16 (the paper's all-bf16 footprint).

Steps run round-robin (one step of each variant per round) so drifting machine load hits all
alike; the time is the median over rounds after warm-up. Gradients are fixed random tensors:
the update's cost does not depend on their values. Memory is counted from the tensors
themselves (steady state); transient working buffers are not included (AdamWSR bounds its
own to a few buffers of at most 2^25 elements, torch's foreach AdamW allocates one fp32
buffer the size of the model for sqrt(v)).

Run: .venv/bin/python bench/bench_optimizer.py [--preset 125m] [--rounds 5] [--device cpu]
"""

from __future__ import annotations

import argparse
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


def report(variants: list[Variant], n_params: int) -> None:
    base = variants[0]
    base_time, base_bytes = statistics.median(base.times), base.state_bytes()
    base_min = min(base.times)
    print(f"{'variant':<22} {'ms/step':>9} {'x mixed':>8} {'min ms':>8} {'x mixed':>8} "
          f"{'GiB p+g+state':>14} {'B/param':>8} {'x mixed':>8}")
    for v in variants:
        t, fastest, b = statistics.median(v.times), min(v.times), v.state_bytes()
        print(f"{v.name:<22} {1e3 * t:>9.1f} {t / base_time:>8.2f} {1e3 * fastest:>8.1f} "
              f"{fastest / base_min:>8.2f} {b / 2**30:>14.3f} {b / n_params:>8.1f} "
              f"{b / base_bytes:>8.2f}")
    print("ms/step: median over rounds; min ms: the fastest round (steadier on a shared machine)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="125m", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after 1 warm-up")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    shapes = parameter_shapes(MODEL_PRESETS[args.preset])
    n_params = sum(torch.Size(s).numel() for s in shapes)
    print(f"preset {args.preset}: {n_params / 1e6:.1f}M parameters in {len(shapes)} tensors; "
          f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    variants = build_variants(shapes, args.device)
    for round_ in range(args.rounds + 1):
        for v in variants:
            elapsed = timed_step(v, args.device)
            if round_ > 0:  # round 0 warms up (lazy state allocation)
                v.times.append(elapsed)
    report(variants, n_params)


if __name__ == "__main__":
    main()
