"""Every call the neuron-xla backend makes into neuronx-distributed, bound against NxD's
recorded signatures (nxd_release.py: the release, commit and file of each) and run against
fakes with those exact signatures and NxD's documented behaviour (nxd_fakes.py).

NxD cannot be installed here; this is what stands between a wrong call and a job failing on
Trainium before its first step."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import nxd_release as rel
import pytest
import torch
from nxd_fakes import Calls, fake_modules

import hlat_trainer.backends.neuron_xla as nx
import hlat_trainer.backends.nxd_model as nm
from hlat_api import PretrainJobSpec, parse_spec
from hlat_trainer.backends.neuron_xla import NeuronXlaBackend


def make_spec(**over: Any) -> PretrainJobSpec:
    raw: dict[str, Any] = {
        "instanceType": "trn1.32xlarge", "nodes": 1,
        "model": {"preset": "tiny", "vocabSize": 256},
        "data": {"path": "/fsx/data", "tokenizer": "bytes", "seqLen": 16},
        "train": {"globalBatch": 64, "microBatch": 1, "steps": 4},
        "optimizer": {"warmupSteps": 1},
    }
    for key, value in over.items():
        node = raw
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return parse_spec(raw)


def use_fakes(monkeypatch: pytest.MonkeyPatch, tp: int = 1) -> Calls:
    calls = Calls()
    modules = fake_modules(calls, tp=tp)
    for mod in (nx, nm):
        monkeypatch.setattr(mod, "require_neuron", modules.__getitem__)
    return calls


def build(spec: PretrainJobSpec, monkeypatch: pytest.MonkeyPatch,
          tp: int = 1) -> tuple[NeuronXlaBackend, Calls, torch.nn.Module, torch.optim.Optimizer]:
    calls = use_fakes(monkeypatch, tp)
    backend = NeuronXlaBackend(spec)
    model = backend.build_model(torch.device("cpu"))
    optimizer = backend.build_optimizer(model.parameters())
    return backend, calls, model, optimizer


def test_the_fakes_have_exactly_the_recorded_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = fake_modules(Calls())
    for path, fake in modules.items():
        recorded = rel.MODULES[path]
        for name in dir(fake):
            if name.startswith("_"):
                continue
            ours, theirs = getattr(fake, name), getattr(recorded, name)
            if inspect.isclass(theirs):
                ours, theirs = ours.__init__, theirs.__init__
            assert inspect.signature(ours) == inspect.signature(theirs), f"{path}.{name}"


def test_every_call_of_a_run_binds_to_nxd_s_signatures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Model, optimizer, loss, a save, a load and the final wait, as the engine drives them."""
    spec = make_spec(parallelism={"zero1": True, "tensor": 1})
    backend, calls, model, optimizer = build(spec, monkeypatch)
    monkeypatch.setattr(backend, "step_end", lambda: None)  # torch_xla.sync: not NxD's
    logits = model(torch.randint(0, 256, (1, 16)))
    backend.loss(logits, torch.randint(0, 256, (1, 16))).backward()
    optimizer.step()
    backend.save_checkpoint(str(tmp_path), 4, model, optimizer, {"step": 4})
    backend.load_checkpoint(str(tmp_path), 4, model, optimizer)
    backend.finalize_checkpoint()
    assert {"neuronx_distributed_config", "initialize_parallel_model",
            "initialize_parallel_optimizer", "NeuronZero1Optimizer", "ColumnParallelLinear",
            "RowParallelLinear", "ParallelEmbedding", "parallel_cross_entropy",
            "save_checkpoint", "load_checkpoint", "finalize_checkpoint"} <= calls.names()


def test_the_model_function_gets_its_arguments_after_include_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, calls, model, _ = build(make_spec(), monkeypatch)
    (call,) = calls.named("initialize_parallel_model")
    assert call["include_buffers"] is False
    assert isinstance(model, nm.NxDTransformer)


@pytest.mark.parametrize(("precision", "dtype"), [
    ("bf16-sr", torch.bfloat16), ("bf16", torch.bfloat16),
    ("mixed", torch.bfloat16),  # with ZeRO-1 (the default): fp32 lives in the master weights
    ("fp32", torch.float32),
])
def test_every_parallel_layer_is_built_in_the_parameter_dtype(
    monkeypatch: pytest.MonkeyPatch, precision: str, dtype: torch.dtype,
) -> None:
    """NxD's ParallelEmbedding picks its output dtype from this argument (fp32 residual
    stream under tensor parallelism otherwise), as its LLaMA passes config.torch_dtype."""
    _, calls, model, _ = build(make_spec(precision=precision), monkeypatch)
    layers = [c for c in calls.seen if c.name.endswith(("ParallelLinear", "ParallelEmbedding"))]
    assert len(layers) == 2 + 4 * model.dims.layers  # embedding, head, 4 per layer
    assert {c.arguments.get("dtype") for c in layers} == {dtype}
    assert {p.dtype for p in model.parameters()} == {dtype}


def test_tensor_parallel_beyond_the_kv_heads_replicates_them_with_nxd_s_gqa_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8 heads, 2 kv heads, tp 4 (70B's 64/8 at tp 32 in small): each kv head on 2 ranks;
    each rank holds 2 query heads and 1 kv head, and the attention runs on those shapes."""
    spec = make_spec(model={"preset": "tiny", "vocabSize": 256, "heads": 8, "kvHeads": 2},
                     precision="fp32")  # the fakes' parallel_state says tp 4
    _, calls, model, _ = build(spec, monkeypatch, tp=4)
    gqa = calls.named("GQAQKVColumnParallelLinear")
    assert len(gqa) == model.dims.layers
    assert {c["kv_size_multiplier"] for c in gqa} == {2}
    head_dim = model.dims.head_dim
    assert gqa[0]["output_sizes"] == [8 * head_dim, 2 * head_dim]
    attention = model.layers[0].attention
    assert attention.q_per_kv == 2
    x = torch.randn(1, 16, model.dims.hidden_size)
    q, k, v = attention._heads(x)
    assert q.shape == (1, 2, 16, head_dim) and k.shape == v.shape == (1, 1, 16, head_dim)
    assert attention.core_attention(q, k, v).shape == (1, 2, 16, head_dim)


@pytest.mark.parametrize(("clip", "max_norm"), [(1.0, 1.0), (0.5, 0.5), (0.0, nx._NO_CLIP)])
def test_zero1_gets_the_spec_s_clip_and_an_fp32_optimizer_under_bf16_sr(
    monkeypatch: pytest.MonkeyPatch, clip: float, max_norm: float,
) -> None:
    spec = make_spec(optimizer={"warmupSteps": 1, "gradClip": clip},
                     parallelism={"zero1": True}, precision="bf16-sr")
    _, calls, _, optimizer = build(spec, monkeypatch)
    (zero1,) = calls.named("NeuronZero1Optimizer")
    assert zero1["max_norm"] == max_norm  # torch-xla clips at 1.0 when it gets none
    # the norm is accumulated and all-reduced in this dtype (grads.py get_grad_norm)
    assert zero1["optimizer_dtype"] == torch.float32
    assert optimizer.max_norm == max_norm  # type: ignore[attr-defined]


# precision, zero1 -> parameters, optimizer_dtype, (master weights, fp32 grad acc, master in ckpt)
RECIPES = [
    ("bf16-sr", True, torch.bfloat16, torch.float32, (True, False, True)),
    ("bf16", True, torch.bfloat16, torch.float32, (True, False, True)),
    ("mixed", True, torch.bfloat16, torch.float32, (True, True, True)),  # the paper's 70B
    ("fp32", True, torch.float32, torch.float32, (True, False, False)),
    ("bf16-sr", False, torch.bfloat16, None, (False, False, False)),  # the paper's 7B
    ("mixed", False, torch.float32, None, (False, False, False)),
    ("fp32", False, torch.float32, None, (False, False, False)),
]


@pytest.mark.parametrize(("precision", "zero1", "params", "opt_dtype", "flags"), RECIPES)
def test_each_precision_maps_to_the_paper_s_nxd_recipe(
    monkeypatch: pytest.MonkeyPatch, precision: str, zero1: bool, params: torch.dtype,
    opt_dtype: torch.dtype | None, flags: tuple[bool, bool, bool],
) -> None:
    spec = make_spec(parallelism={"zero1": zero1}, precision=precision)
    _, calls, model, _ = build(spec, monkeypatch)
    assert {p.dtype for p in model.parameters()} == {params}
    (config,) = calls.named("neuronx_distributed_config")
    mp = config["mixed_precision_config"]
    assert (mp["use_master_weights"], mp["use_fp32_grad_acc"],
            mp["use_master_weights_in_ckpt"]) == flags
    zero1_calls = calls.named("NeuronZero1Optimizer")
    assert [c["optimizer_dtype"] for c in zero1_calls] == ([opt_dtype] if zero1 else [])


def test_a_resume_loads_the_model_before_the_optimizer_in_separate_calls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """One call would load the optimizer first (checkpoint.py 894-951), and ZeRO-1 would
    re-shard the unloaded parameters (tests/xla/test_xla_zero1_resume.py runs it for real)."""
    backend, calls, model, optimizer = build(make_spec(parallelism={"zero1": True}), monkeypatch)
    monkeypatch.setattr(backend, "step_end", lambda: None)
    backend.load_checkpoint(str(tmp_path), 4, model, optimizer)
    loads = calls.named("load_checkpoint")
    assert [(c.get("model") is model, c.get("optimizer") is optimizer) for c in loads] == [
        (True, False), (False, True)]


def test_the_model_is_built_on_the_meta_device_with_nxd_s_param_init_fn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, calls, _, _ = build(make_spec(), monkeypatch)
    (config,) = calls.named("neuronx_distributed_config")
    init = config["model_init_config"]
    assert init["meta_device_init"] is True and init["param_init_fn"] is nm.init_module


def test_without_zero1_nothing_reaches_adamw_that_it_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_spec(parallelism={"zero1": False}, optimizer={"warmupSteps": 1, "gradClip": 0.3})
    _, calls, _, optimizer = build(spec, monkeypatch)
    assert not calls.named("NeuronZero1Optimizer")
    assert optimizer.max_norm == 0.3  # type: ignore[attr-defined]
    (config,) = calls.named("neuronx_distributed_config")
    assert config["optimizer_config"]["max_grad_norm"] == 0.3  # NxDOptimizer clips with it


@pytest.mark.parametrize(("instance", "lnc"), [("trn1.32xlarge", 1), ("trn2.48xlarge", 2)])
def test_trn2_tells_nxd_its_logical_core_size(
    monkeypatch: pytest.MonkeyPatch, instance: str, lnc: int,
) -> None:
    calls = use_fakes(monkeypatch)
    NeuronXlaBackend(make_spec(instanceType=instance)).nxd_config()
    (config,) = calls.named("neuronx_distributed_config")
    assert config["lnc_size"] == lnc
