"""Training tokens/s of our decoder vs Hugging Face's LlamaForCausalLM, same config, same process.

Both models get identical dimensions, the same batches, SDPA attention, fp32 on CPU, and a full
training step (forward, loss, backward, AdamW). Runs alternate between the two models so that
background load hits both alike; the median of the timed steps is reported, with the ratio.

    .venv/bin/python bench/bench_model.py [--preset tiny] [--seq-len 256] [--batch 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

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


def step_fn(model: torch.nn.Module, hf: bool) -> Callable[[torch.Tensor, torch.Tensor], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        logits = model(x).logits if hf else model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    d = SIZES[a.size]
    torch.manual_seed(0)
    runs = {"hlat": step_fn(build_model(d).train(), False), "hf": step_fn(hf_model(d).train(), True)}
    x = torch.randint(0, d.vocab_size, (a.batch, a.seq_len + 1))
    inputs, targets = x[:, :-1], x[:, 1:]
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(a.steps + 1):
        for name, step in runs.items():
            t0 = time.perf_counter()
            step(inputs, targets)
            if i:  # the first round is warm-up
                times[name].append(time.perf_counter() - t0)
    tokens = a.batch * a.seq_len
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(f"model {a.size} ({d.param_count() / 1e6:.1f}M params), batch {a.batch} x seq "
          f"{a.seq_len}, fp32, {torch.get_num_threads()} threads, {a.steps} timed steps each")
    print(f"{'model':<28}{'tokens/s':>12}")
    print(f"{'hlat Transformer':<28}{tps['hlat']:>12,.0f}")
    print(f"{'HF LlamaForCausalLM (sdpa)':<28}{tps['hf']:>12,.0f}")
    print(f"ratio hlat / HF: {tps['hlat'] / tps['hf']:.2f}x")


if __name__ == "__main__":
    main()
