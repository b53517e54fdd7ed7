"""Run the NxD model's forward and backward on the XLA device, beside model.Transformer on the
CPU with the same weights, and save both for test_xla_nxd_model.py to compare.

A script, not a test: XLA_DISABLE_FUNCTIONALIZATION is read once, when torch_xla's runtime
starts, so each setting needs a fresh process whose environment the caller chose (the
launcher's, for the real check). Usage:

    python nxd_model_on_xla.py OUT fp32:0 fp32:1 bf16:1 [--transformer-on-xla]

(each PRECISION:SP a configuration: the spec's precision, sequence parallel off or on). OUT, a
torch.save'd dict, gets what the process saw of the functionalization setting (the variable;
whether an XLA tensor is a FunctionalTensorWrapper, which is how torch-xla 2.9 applies it;
whether pytorch/xla#8640's split reads right), then per configuration the CPU reference's
logits and parameter gradients and the NxD model's from XLA (and model.Transformer's from
XLA with --transformer-on-xla: its attention separates Q/K/V with torch.split).

The NxD model is built as the neuron-xla backend builds it (`NeuronXlaBackend.build_model`:
`initialize_parallel_model` -> `build_nxd_model` in the parameter dtype, then the precision
policy's cast), with NxD's parallel layers replaced by the tp-1 fakes of nxd_fakes.py, which
bind NxD's recorded signatures.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "trainer"))  # nxd_fakes, nxd_release

BATCH, SEQ = 2, 32


def make_spec(precision: str = "bf16-sr", sequence_parallel: bool = False) -> Any:
    """A trn1 job with a 2-layer GQA decoder (4 heads, 2 kv heads: 2 queries per kv head)."""
    from hlat_api import parse_spec

    return parse_spec({
        "instanceType": "trn1.32xlarge", "nodes": 1, "precision": precision,
        "model": {"preset": "tiny", "layers": 2, "vocabSize": 256, "maxSeqLen": 64},
        "data": {"path": "/fsx/data", "tokenizer": "bytes", "seqLen": SEQ},
        "train": {"globalBatch": 64, "microBatch": 1, "steps": 4, "seed": 7},
        "optimizer": {"warmupSteps": 1},
        "parallelism": {"tensor": 1, "sequenceParallel": sequence_parallel},
    })


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits of `tokens` and every parameter's gradient of the mean cross-entropy (taken in
    fp32, as the backends take it), on the host in fp32."""
    logits = model(tokens)
    F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    if logits.device.type == "xla":
        # the logits and every gradient in one graph, as a training step runs them; else each
        # .cpu() below compiles and runs its own graph of the forward and backward (34 of them:
        # 19 of a configuration's 25 s here)
        import torch_xla

        torch_xla.sync()
    grads = {n: p.grad.detach().cpu().float() for n, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach().cpu().float(), grads


def split_probe(device: torch.device) -> bool:
    """pytorch/xla#8640's case: torch.split along the last dim of a 2-D tensor; True when XLA
    gives what the CPU gives (under XLA_DISABLE_FUNCTIONALIZATION=1 torch-xla 2.9 does not)."""
    a = torch.arange(12.0).reshape(3, 4)
    on_xla = a.to(device).split([3, 1], dim=-1)
    return all(torch.equal(x.cpu(), y) for x, y in zip(on_xla, a.split([3, 1], dim=-1), strict=True))


def compare(precision: str, sp: bool, device: torch.device,
            transformer_on_xla: bool) -> dict[str, Any]:
    from hlat_trainer.backends.neuron_xla import NeuronXlaBackend
    from hlat_trainer.model import build_model

    spec = make_spec(precision, sp)
    backend = NeuronXlaBackend(spec)
    nxd = backend.build_model(torch.device("cpu"))
    dims, dtype = spec.model.dims(), backend.param_dtype()
    reference = build_model(dims, seed=spec.train.seed)
    nxd.load_state_dict(reference.state_dict(), strict=True)  # the same names, one to one
    reference.to(dtype)
    gen = torch.Generator().manual_seed(spec.train.seed)
    tokens = torch.randint(0, dims.vocab_size, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, dims.vocab_size, (BATCH, SEQ), generator=gen)
    out: dict[str, Any] = {"param_names": sorted(n for n, _ in nxd.named_parameters())}
    out["ref_logits"], out["ref_grads"] = loss_and_grads(reference, tokens, targets)
    if dtype != torch.float32:  # what bf16 costs the reference itself: its distance from fp32
        fp32 = build_model(dims, seed=spec.train.seed)
        out["fp32_logits"], out["fp32_grads"] = loss_and_grads(fp32, tokens, targets)
    on_xla: list[tuple[str, torch.nn.Module]] = [("nxd", nxd)]
    if transformer_on_xla:
        on_xla.append(("transformer", build_model(dims, seed=spec.train.seed).to(dtype)))
    for key, model in on_xla:
        model.to(device)
        logits, grads = loss_and_grads(model, tokens.to(device), targets.to(device))
        out[f"{key}_logits"], out[f"{key}_grads"] = logits, grads
        out[f"{key}_param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def main(out: Path, configs: list[tuple[str, bool]], transformer_on_xla: bool) -> None:
    seen = os.environ.get("XLA_DISABLE_FUNCTIONALIZATION")
    assert "torch_xla" not in sys.modules, "the setting must be in place before torch_xla loads"
    import torch_xla
    from nxd_fakes import Calls, fake_modules

    import hlat_trainer.backends.neuron_xla as nx
    import hlat_trainer.backends.nxd_model as nm

    device = torch_xla.device()
    result: dict[str, Any] = {
        "env": seen, "split_ok": split_probe(device),
        "functional": torch._is_functional_tensor(torch.zeros(1, device=device))}
    fakes = fake_modules(Calls(), tp=1)
    for mod in (nx, nm):  # as test_nxd_calls installs them
        mod.require_neuron = fakes.__getitem__  # type: ignore[attr-defined]
    for precision, sp in configs:
        result[f"{precision}:{int(sp)}"] = compare(precision, sp, device, transformer_on_xla)
    torch.save(result, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("configs", nargs="*", help="PRECISION:SP, e.g. fp32:0 bf16:1")
    parser.add_argument("--transformer-on-xla", action="store_true")
    args = parser.parse_args()
    main(args.out, [(c.split(":")[0], c.split(":")[1] == "1") for c in args.configs],
         args.transformer_on_xla)
