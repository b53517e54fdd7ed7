"""On a GPU: the activation estimate of hlat_api.memory against what CUDA's allocator measures.

Why: the spec's memory check refuses a layout by its predicted peak per rank (state +
activations + reserve), and the activation term is derived on paper (Korthikanti et al. 2022,
re-derived for our decoder; hlat_api.memory's docstring). On Trainium the compiler decides what
stays live, and no Trainium is reachable here; but the torch-native rows of the same model are
what eager autograd keeps, and CUDA's caching allocator counts exactly that. This runs our
decoder (`hlat_trainer.model`, the trainer's `apply_ac` for the checkpointing modes, SDPA
attention as the torch-native path runs it, or the NxD model's eager `CoreAttention`) in
bf16 at tp 1 and compares, per case:

- layers: bytes allocated after the forward, less the logits, minus before it (what the decoder
  layers keep for backward: `Activations.per_layer * layers`);
- kept: the same after the loss is formed, logits included (`+ Activations.head`);
- peak: the allocator's peak over a second micro-batch's forward + backward, the first one's
  gradients accumulated (as the trainer does when it accumulates), minus the weights:
  `Activations.total` + the gradients' bytes.

Nothing is tuned to agree: the script prints the ratios measured / predicted, and a ratio far
from 1 is a finding about the model, recorded in docs/neuron.md.

    python bench/check_memory_gpu.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "api"), str(ROOT / "trainer")]

from hlat_api.memory import Layout, activation_bytes  # noqa: E402
from hlat_api.presets import MODEL_PRESETS  # noqa: E402
from hlat_trainer.backends.nxd_model import CoreAttention  # noqa: E402
from hlat_trainer.model import build_model  # noqa: E402
from hlat_trainer.parallel import apply_ac  # noqa: E402

GIB = 2**30
CASES = [  # preset, seq, micro-batch, checkpointing, eager attention (NxD's CoreAttention)
    ("1b", 4096, 1, "none", False),
    ("1b", 4096, 1, "selective", False),
    ("1b", 4096, 1, "full", False),
    ("1b", 2048, 4, "none", False),
    ("1b", 4096, 1, "none", True),
    ("1b", 4096, 1, "selective", True),
    ("7b", 4096, 1, "none", False),
    ("7b", 4096, 1, "selective", False),
    ("7b", 4096, 1, "full", False),
    ("7b", 4096, 1, "selective", True),
]


def measure(preset: str, seq: int, mb: int, mode: str, eager: bool) -> dict[str, object]:
    dims = MODEL_PRESETS[preset]
    torch.cuda.empty_cache()
    model = build_model(dims, "cuda", seed=1).to(torch.bfloat16)
    if eager:  # the NxD model's attention core: s x s scores, fp32 softmax, its bf16 cast
        for layer in model.layers:
            core = CoreAttention(dims.heads // dims.kv_heads)
            layer.attention.core_attention = core.forward  # type: ignore[union-attr,method-assign]
    apply_ac(model, mode)
    weights = torch.cuda.memory_allocated()
    tokens = torch.randint(0, dims.vocab_size, (mb, seq + 1), device="cuda")
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    logits = model(inputs)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated() - before - logits.numel() * logits.element_size()
    # the trainer's loss (backends/base.py Backend.loss): fp32 cross entropy over the logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    loss.backward()
    del logits, loss
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                if p.grad is not None)
    # a second micro-batch, as the trainer accumulates them: the first one's gradients stay
    # allocated through its forward and backward, as they do on every accelerator
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - weights
    lay = Layout(seq, mb, 1, False, mode, "bf16", managed=False, zero1=False,
                 eager_attention=eager)
    act = activation_bytes(dims, lay)
    predicted_kept = act.per_layer * act.layers + act.head
    predicted_peak = act.total + grads
    del model, loss
    return {"preset": preset, "attention": "eager" if eager else "sdpa", "layers": dims.layers,
            "seq": seq, "micro_batch": mb,
            "checkpointing": mode, "layers_kept_gib": after_forward / GIB,
            "predicted_layers_kept_gib": act.per_layer * act.layers / GIB,
            "head_kept_gib": (kept - after_forward) / GIB, "predicted_head_gib": act.head / GIB,
            "kept_gib": kept / GIB,
            "predicted_kept_gib": predicted_kept / GIB, "kept_ratio": kept / predicted_kept,
            "peak_gib": peak / GIB, "predicted_peak_gib": predicted_peak / GIB,
            "peak_ratio": peak / predicted_peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.total_memory / GIB:.0f} GiB, torch {torch.__version__}")
    rows = []
    print("| preset | attention | seq x mb | checkpointing | layers: measured / predicted GiB | "
          "head: measured / predicted GiB | kept: measured / predicted GiB (ratio) "
          "| peak less weights: measured / predicted GiB (ratio) |")
    print("|---|---|---|---|---|---|---|---|")
    for case in CASES:
        r = measure(*case)
        rows.append(r)
        print(f"| {r['preset']} | {r['attention']} | {r['seq']} x {r['micro_batch']} | {r['checkpointing']} | "
              f"{r['layers_kept_gib']:.2f} / {r['predicted_layers_kept_gib']:.2f} | "
              f"{r['head_kept_gib']:.2f} / {r['predicted_head_gib']:.2f} | "
              f"{r['kept_gib']:.2f} / {r['predicted_kept_gib']:.2f} ({r['kept_ratio']:.3f}) | "
              f"{r['peak_gib']:.2f} / {r['predicted_peak_gib']:.2f} ({r['peak_ratio']:.3f}) |",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": props.name, "torch": torch.__version__,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
