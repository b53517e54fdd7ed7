"""The NxD model built on the meta device and materialised by `nxd_model.init_module`, as the
neuron-xla backend asks NxD to (model_init_config meta_device_init + param_init_fn), gives the
weights a CPU build gives.

NxD cannot be installed here, so its initialisation is replayed (nxd_fakes.nxd_init_modules:
the model function under init_on_device(meta), then reinit_model calling the param_init_fn for
every module, root first; the parallel layers drawing the full weight in fp32 and keeping their
chunk; each step cited there to NxD's source). A wrong init here would not fail anything on
Trainium: the model would train from the wrong start (or from uninitialised memory)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from nxd_fakes import Calls, init_on_meta, nxd_init_modules, reinit_model
from torch import nn

import hlat_trainer.backends.neuron_xla as nx
import hlat_trainer.backends.nxd_model as nm
from hlat_api import PretrainJobSpec, parse_spec
from hlat_trainer.backends.neuron_xla import NeuronXlaBackend
from hlat_trainer.model import INIT_STD, RMSNorm, build_model


def make_spec(precision: str = "fp32", tp: int = 1, sp: bool = False) -> PretrainJobSpec:
    return parse_spec({
        "instanceType": "trn1.32xlarge", "nodes": 1, "precision": precision,
        "model": {"preset": "tiny", "vocabSize": 256},
        "data": {"path": "/fsx/data", "tokenizer": "bytes", "seqLen": 16},
        "train": {"globalBatch": 64, "microBatch": 1, "steps": 4, "seed": 11},
        "optimizer": {"warmupSteps": 1},
        "parallelism": {"tensor": tp, "sequenceParallel": sp},
    })


def build(monkeypatch: pytest.MonkeyPatch, spec: PretrainJobSpec, *, meta: bool = True,
          rank: int = 0) -> nn.Module:
    """The backend's model at one rank, on the meta device then init_module (its own config),
    or built on the CPU as NxD builds without model_init_config."""
    modules = nxd_init_modules(Calls(), tp=spec.parallelism.tensor, rank=rank)
    for mod in (nx, nm):
        monkeypatch.setattr(mod, "require_neuron", modules.__getitem__)
    if not meta:
        monkeypatch.setattr(NeuronXlaBackend, "_model_init_config",
                            lambda self: {"meta_device_init": False, "param_init_fn": None})
    model = NeuronXlaBackend(spec).build_model(torch.device("cpu"))
    monkeypatch.undo()
    return model


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"])
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
def test_a_meta_build_materialises_exactly_what_a_cpu_build_draws(
    monkeypatch: pytest.MonkeyPatch, precision: str, tp: int, rank: int,
) -> None:
    """Exact: NxD visits the modules in the order they were built and init_module restarts
    the generator from the seed at the root, so the draws are the CPU build's, in its order."""
    spec = make_spec(precision, tp)
    meta, cpu = build(monkeypatch, spec, rank=rank), build(monkeypatch, spec, meta=False, rank=rank)
    assert not [n for n, p in meta.named_parameters() if p.is_meta]
    want = cpu.state_dict()
    got = meta.state_dict()
    assert list(got) == list(want)
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype, name
        assert torch.equal(tensor, want[name]), name


def test_each_rank_holds_its_chunk_of_the_tp1_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxD draws every weight whole and keeps a chunk: the same model at every tp degree."""
    whole = build(monkeypatch, make_spec(tp=1)).state_dict()
    for rank in (0, 1):
        part = build(monkeypatch, make_spec(tp=2), rank=rank)
        for name, module in part.named_modules():
            weight = getattr(module, "weight", None)
            if weight is None or isinstance(module, RMSNorm):
                continue
            chunk = whole[f"{name}.weight"].chunk(2, dim=weight.partition_dim)[rank]
            assert torch.equal(weight, chunk), name


def expected_std(name: str) -> float:
    """model.py's init: std 0.02, the output projections of layer l (from 1) std/sqrt(2l)."""
    if name.endswith(("attention.wo.weight", "feed_forward.w_down.weight")):
        return INIT_STD / math.sqrt(2 * (int(name.split(".")[1]) + 1))
    return INIT_STD


def test_the_init_is_model_py_s_parameter_by_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the same draws as model.py (it draws gate/up before wo within a layer; NxD follows
    the modules' order, and draws in fp32 whatever the dtype), but the same distribution:
    each weight's std within 5% of model.py's (sample error ~0.8% for the smallest, 128x128),
    so a wrong per-layer scale (layer 1 vs 2: 15%) cannot pass; mean ~0; norms exactly 1."""
    spec = make_spec()
    nxd = dict(build(monkeypatch, spec).named_parameters())
    ref = dict(build_model(spec.model.dims(), seed=spec.train.seed).named_parameters())
    assert sorted(nxd) == sorted(ref)
    for name, param in nxd.items():
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        std, want = param.std().item(), ref[name].std().item()
        assert abs(std / want - 1) < 0.05, f"{name}: std {std:.5f}, model.py's {want:.5f}"
        assert abs(std / expected_std(name) - 1) < 0.05, name
        assert abs(param.mean().item()) < 0.1 * std, name


def test_parallel_attributes_survive_the_reinit(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxD all-reduces the gradients of weights marked sequence_parallel_enabled (the SP norms)
    and treats tensor_model_parallel ones as shards: reinit replaces every parameter, so the
    marks must come back (NxD's preserve_parallel_attributes)."""
    model = build(monkeypatch, make_spec(tp=2, sp=True))
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            assert getattr(module.weight, "sequence_parallel_enabled", None) is True, name
        elif hasattr(module, "weight"):
            assert getattr(module.weight, "tensor_model_parallel", None) is True, name


def test_the_stand_in_calls_param_init_fn_as_nxd_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """reinit_model: every module of model.modules(), the root first, with its own parameters
    already empty on the CPU (model_utils.py 220-229); before that everything is on meta."""
    seen: list[tuple[nn.Module, bool]] = []

    def recording(module: nn.Module, device: torch.device) -> Any:
        assert device == torch.device("cpu")
        own = list(module.parameters(recurse=False))
        seen.append((module, all(p.device.type == "cpu" for p in own)))
        if isinstance(module, nm.NxDTransformer):  # still on meta below the root
            assert all(p.is_meta for p in module.layers.parameters())
        nm.init_module(module, device)

    monkeypatch.setattr(NeuronXlaBackend, "_model_init_config",
                        lambda self: {"meta_device_init": True, "param_init_fn": recording})
    modules = nxd_init_modules(Calls())
    for mod in (nx, nm):
        monkeypatch.setattr(mod, "require_neuron", modules.__getitem__)
    model = NeuronXlaBackend(make_spec()).build_model(torch.device("cpu"))
    assert [m for m, _ in seen] == list(model.modules())
    assert all(on_cpu for _, on_cpu in seen)


def test_the_weights_depend_on_the_seed_only_not_on_draws_before_the_reinit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NxD's own flow draws nothing between the model function and reinit_model, but anything
    that did (a wrapper, a later NxD) must not shift the model's start: init_module reseeds."""
    spec = make_spec()
    cpu = build(monkeypatch, spec, meta=False).state_dict()
    modules = nxd_init_modules(Calls())
    monkeypatch.setattr(nm, "require_neuron", modules.__getitem__)
    dims = spec.model.dims()
    with init_on_meta():
        model = nm.build_nxd_model(dims, False, spec.train.seed, torch.float32)
    torch.rand(1000)
    reinit_model(model, nm.init_module)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, cpu[name]), name
