"""Training tokens/s of our decoder vs Hugging Face's LlamaForCausalLM, same config, same process.

Both models get identical dimensions, the same batches, SDPA attention, fp32 on CPU, and a full
training step (forward, loss, backward, AdamW). Runs alternate between the two models so that
background load hits both alike (the order rotated each round); the median and the fastest
round of the timed steps are reported, with the spread and the ratio on both.

    .venv/bin/python bench/bench_model.py [--size tiny [small]] [--seq-len 256] [--batch N]
        [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import report
from hlat_api import MODEL_PRESETS, ModelDims
from hlat_trainer.model import build_model

SIZES = {
    "tiny": MODEL_PRESETS["tiny"],
    "small": ModelDims(512, 8, 8, 8, 1408, 32000, 2048),  # ~60M params
}


def hf_model(d: ModelDims) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=d.vocab_size, hidden_size=d.hidden_size,
                      intermediate_size=d.intermediate_size, num_hidden_layers=d.layers,
                      num_attention_heads=d.heads, num_key_value_heads=d.kv_heads,
                      max_position_embeddings=d.max_seq_len, rope_theta=d.rope_theta,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def step_fn(model: torch.nn.Module, hf: bool,
            optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
            ) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step of `model` (fp32 loss); `optimizer` builds the optimizer from the
    parameters (default: torch's foreach AdamW)."""
    opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)))(
        model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        logits = model(x).logits if hf else model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


DEFAULTS = {"tiny": (4, 20), "small": (2, 8)}
"""Per size: micro-batch and timed rounds (one small step takes seconds on a 2-core machine)."""


@dataclass
class Measured:
    size: str
    params: float
    batch: int
    seq_len: int
    times: dict[str, list[float]]  # model -> step seconds per timed round

    def tokens_per_s(self, name: str, pick: Callable[[list[float]], float]) -> float:
        return self.batch * self.seq_len / pick(self.times[name])

    def ratio(self, pick: Callable[[list[float]], float]) -> float:
        """hlat / HF tokens/s (> 1: ours faster), on the median or the fastest rounds."""
        return self.tokens_per_s("hlat", pick) / self.tokens_per_s("hf", pick)


def measure(size: str, batch: int, seq_len: int, steps: int) -> Measured:
    d = SIZES[size]
    torch.manual_seed(0)
    runs = {"hlat": step_fn(build_model(d).train(), False),
            "hf": step_fn(hf_model(d).train(), True)}
    x = torch.randint(0, d.vocab_size, (batch, seq_len + 1))
    inputs, targets = x[:, :-1], x[:, 1:]
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for i in range(steps + 1):
        shift = i % len(names)  # the order rotates: neither model always runs first
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            runs[name](inputs, targets)
            if i:  # the first round is warm-up
                times[name].append(time.perf_counter() - t0)
    return Measured(size, d.param_count() / 1e6, batch, seq_len, times)


def verdict_of(m: Measured) -> str:
    """Which model is faster, if the run tells: on both the median and the fastest round, and
    by more than the spread of either model's rounds."""
    med, best = m.ratio(statistics.median), m.ratio(min)
    if (med > 1) != (best > 1):
        return "not separated: the median and the fastest round disagree"
    who = "ours" if med > 1 else "HF"
    noise = max(report.spread(m.times["hlat"]), report.spread(m.times["hf"]))
    if min(abs(med - 1), abs(best - 1)) <= noise:
        return f"{who} faster on both, but by less than the spread of the rounds"
    return f"{who} faster on both the median and the fastest round, by more than the spread"


def section(results: list[Measured], threads: int, when: str) -> report.Section:
    rows = []
    for m in results:
        tps = {(k, p): m.tokens_per_s(k, f) for k in ("hlat", "hf")
               for p, f in (("med", statistics.median), ("min", min))}
        rows.append([
            f"{m.size} ({m.params:.1f}M params)", f"{m.batch} x {m.seq_len}",
            len(m.times["hlat"]),
            f"{tps['hlat', 'med']:,.0f} / {tps['hlat', 'min']:,.0f}",
            f"{tps['hf', 'med']:,.0f} / {tps['hf', 'min']:,.0f}",
            f"{m.ratio(statistics.median):.2f}x", f"{m.ratio(min):.2f}x",
            f"{report.pct(report.spread(m.times['hlat']), 0)} / "
            f"{report.pct(report.spread(m.times['hf']), 0)}",
            verdict_of(m),
        ])
    body = f"""Run {when}: fp32 on CPU, {threads} torch threads; sizes {', '.join(
        m.size for m in results)}. Same dimensions, the same batch in both, SDPA attention in
both, a full training step (forward, loss, backward, AdamW). The two models alternate round by
round, the order swapped each round, so that background load hits both alike; one warm-up
round, then the timed rounds. Tokens/s are given at the median step time and at the fastest
round; the spread is the interquartile range of the step times over their median.

{report.table(["model", "batch x seq", "timed rounds", "hlat tokens/s median / fastest",
               "HF tokens/s median / fastest", "hlat / HF median", "hlat / HF fastest",
               "spread hlat / HF", "reading"], rows)}

Our decoder fuses the Q, K and V projections into one matmul and the gate and up projections
into another (fewer, larger matmuls: meant to pay off as the model grows; at a tiny size per-op
overhead weighs more). The fused gate/up weight interleaves rows (gate_i, up_i) so that
tensor parallelism can split it contiguously; its strided halves cost an extra copy in the
SwiGLU. No numeric goal: the comparison says whether our model costs training throughput
against the reference implementation."""
    return report.Section("model", "Our decoder vs HF `transformers` LlamaForCausalLM "
                          "(training tokens/s, CPU, fp32)", report.command(), body)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=sorted(SIZES), nargs="+", default=["tiny"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, help="default per size: tiny 4, small 2")
    p.add_argument("--steps", type=int, help="timed rounds; default per size: tiny 20, small 8")
    a = p.parse_args()
    if a.steps is not None and a.steps < 2:
        p.error("--steps must be at least 2 (the spread needs two rounds)")
    when = report.now()
    results = []
    for size in a.size:
        batch, steps = DEFAULTS[size]
        m = measure(size, a.batch or batch, a.seq_len, a.steps or steps)
        results.append(m)
        print(f"model {size} ({m.params:.1f}M params), batch {m.batch} x seq {m.seq_len}, fp32, "
              f"{torch.get_num_threads()} threads, {len(m.times['hlat'])} timed rounds each "
              f"(alternating, order rotated)")
        print(f"{'model':<28}{'tokens/s median':>16}{'fastest':>10}{'IQR/median':>12}")
        for name, label in (("hlat", "hlat Transformer"), ("hf", "HF LlamaForCausalLM (sdpa)")):
            print(f"{label:<28}{m.tokens_per_s(name, statistics.median):>16,.0f}"
                  f"{m.tokens_per_s(name, min):>10,.0f}{report.spread(m.times[name]):>12.1%}")
        print(f"ratio hlat / HF: {m.ratio(statistics.median):.2f}x median, "
              f"{m.ratio(min):.2f}x fastest round: {verdict_of(m)}")
    report.emit(section(results, torch.get_num_threads(), when))


if __name__ == "__main__":
    main()
