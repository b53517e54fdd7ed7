"""CPU fakes of the neuronx-distributed (NxD) calls our neuron-xla backend makes, each with the
exact signature NxD has (recorded in nxd_release.py) and NxD's documented behaviour at one rank.

Every fake binds its arguments against the recorded signature first (`inspect.Signature.bind`:
a wrong name, count or order fails like the real call would) and checks that parameters
annotated `bool` upstream get a bool, then records the call in `Calls`. Behaviour, where our
code depends on it, follows NxD's source: `initialize_parallel_model` calls
`model_fn(*model_args, **model_kwargs)` after `include_buffers`; `initialize_parallel_optimizer`
hands its `**defaults` to `NeuronZero1Optimizer` under ZeRO-1 (which must accept them: torch-xla's
ZeroRedundancyOptimizer signature) and to the optimizer class otherwise (AdamW refuses unknown
keywords); the parallel layers are plain torch layers of one rank (tp 1).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nxd_release as rel
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass
class Calls:
    seen: list[Call] = field(default_factory=list)

    def named(self, name: str) -> list[dict[str, Any]]:
        return [c.arguments for c in self.seen if c.name == name]

    def names(self) -> set[str]:
        return {c.name for c in self.seen}


def _bind(name: str, stub: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          calls: Calls) -> dict[str, Any]:
    sig = inspect.signature(stub)
    bound = sig.bind(*args, **kwargs)  # TypeError exactly where the real call would fail
    for pname, value in bound.arguments.items():
        if sig.parameters[pname].annotation in (bool, "bool") and not isinstance(value, bool):
            raise TypeError(f"{name}: {pname} must be a bool, got {value!r}")
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    calls.seen.append(Call(name, arguments))
    return arguments


def checked(name: str, stub: Callable[..., Any], impl: Callable[..., Any],
            calls: Calls) -> Callable[..., Any]:
    def fake(*args: Any, **kwargs: Any) -> Any:
        _bind(name, stub, args, kwargs, calls)
        return impl(*args, **kwargs)

    fake.__signature__ = inspect.signature(stub)  # type: ignore[attr-defined]
    fake.__name__ = name
    return fake


def _layer_class(name: str, stub: type, base: type[nn.Module], calls: Calls) -> type[nn.Module]:
    """A subclass of `base` (built from the bound arguments) whose __init__ has exactly
    `stub.__init__`'s signature; parameter names are the torch layer's, as NxD's are."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        arguments = _bind(name, stub.__init__, (self, *args), kwargs, calls)
        base.__init__(self, arguments)
        self.built_dtype = arguments.get("dtype")

    __init__.__signature__ = inspect.signature(stub.__init__)  # type: ignore[attr-defined]
    return type(name, (base,), {"__init__": __init__})


def _dtype(arguments: dict[str, Any]) -> torch.dtype:
    value = arguments.get("dtype", torch.float32)
    return torch.float32 if isinstance(value, rel.Expr) else value


class _Linear(nn.Linear):
    def __init__(self, arguments: dict[str, Any]) -> None:
        super().__init__(arguments["input_size"], arguments["output_size"],
                         bias=arguments.get("bias", True), dtype=_dtype(arguments))


class _Embedding(nn.Module):
    """ParallelEmbedding at tp 1: under SP it hands on [T, B, H] (layers.py transposes)."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(arguments["num_embeddings"],
                                               arguments["embedding_dim"], dtype=_dtype(arguments)))
        nn.init.normal_(self.weight, std=0.02)
        self.sp = arguments.get("sequence_parallel_enabled", False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = F.embedding(tokens, self.weight)
        return out.transpose(0, 1).contiguous() if self.sp else out


class _GQAQKV(nn.Module):
    """GQAQKVColumnParallelLinear of one rank: one fused weight (q/tp + 2 kv m/tp rows), (q, k,
    v) out. Only shapes: the replicas' gradient sum needs the other ranks."""

    def __init__(self, arguments: dict[str, Any], tp: int = 1) -> None:
        super().__init__()
        q, kv = arguments["output_sizes"]
        m = arguments.get("kv_size_multiplier", 1)
        if tp % m or (kv * m) % tp:
            raise ValueError("qkv_linear.py asserts tp % m == 0 and kv * m % tp == 0")
        self.sizes = (q // tp, kv * m // tp, kv * m // tp)
        # the attributes by which NxD marks the replication (qkv_linear.py l.443-455)
        self.kv_size_multiplier, self.fuse_qkv = m, True
        self.gather_output = arguments.get("gather_output", True)
        self.q_output_size_per_partition, self.kv_output_size_per_partition = self.sizes[:2]
        self.weight_qkv = nn.Parameter(torch.randn(sum(self.sizes), arguments["input_size"],
                                                   dtype=_dtype(arguments)) * 0.02)
        self.weight_qkv.tensor_model_parallel = True  # as NxD's _initialize_affine_weight sets

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, self.weight_qkv).split(self.sizes, dim=-1))


class FakeOptimizer(torch.optim.AdamW):
    """What initialize_parallel_optimizer returns, at one rank: clips and keeps grad_norm."""

    def __init__(self, params: Any, *, max_norm: float, optimizer_dtype: torch.dtype | None,
                 **defaults: Any) -> None:
        super().__init__(params, **defaults)
        self.max_norm, self.optimizer_dtype = max_norm, optimizer_dtype
        self.grad_norm: torch.Tensor | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        return super().step(closure)


def fake_modules(calls: Calls, *, tp: int = 1) -> dict[str, types.ModuleType]:
    """Module path -> fake module, for `require_neuron` (and sys.modules)."""
    mods = rel.MODULES

    def fn(module: str, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        return checked(name, getattr(mods[module], name), impl, calls)

    def nxd_config(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = inspect.signature(rel.neuronx_distributed_config).bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def init_model(nxd_config: Any, model_fn: Any, include_buffers: bool = False,
                   *model_args: Any, **model_kwargs: Any) -> nn.Module:
        model: nn.Module = model_fn(*model_args, **model_kwargs)
        return model

    def init_optimizer(nxd_config: dict[str, Any], optimizer_class: Any, parameters: Any,
                       **defaults: Any) -> torch.optim.Optimizer:
        opt, parameters = nxd_config["optimizer_config"], list(parameters)
        if not opt["zero_one_enabled"]:
            optimizer_class(parameters, **defaults)  # AdamW refuses what it does not know
            return FakeOptimizer(parameters, max_norm=opt["max_grad_norm"], optimizer_dtype=None,
                                 **defaults)
        zero1 = rel.ZeroRedundancyOptimizer.__init__
        clash = set(defaults) & set(rel.ZERO1_CONFIG_KEYS)
        if clash:
            raise TypeError(f"NeuronZero1Optimizer got multiple values for {sorted(clash)}")
        bound = _bind("NeuronZero1Optimizer", zero1, (None, parameters, optimizer_class),
                      defaults, calls)
        inner = bound.get("defaults", {})
        optimizer_class([torch.zeros(1)], **inner)  # what reaches AdamW itself
        return FakeOptimizer(parameters, max_norm=bound.get("max_norm") or 1.0,
                             optimizer_dtype=bound.get("optimizer_dtype") or torch.float32,
                             **inner)

    def cross_entropy(vocab_parallel_logits: Any, target: Any,
                      label_smoothing: Any = 0.0) -> torch.Tensor:
        return F.cross_entropy(vocab_parallel_logits, target, reduction="none")

    top = "neuronx_distributed"
    nxd = types.ModuleType(top)
    for name, impl in [("neuronx_distributed_config", nxd_config),
                       ("initialize_parallel_model", init_model),
                       ("initialize_parallel_optimizer", init_optimizer),
                       ("save_checkpoint", lambda *a, **k: None),
                       ("load_checkpoint", lambda *a, **k: None),
                       ("has_checkpoint", lambda *a, **k: False),
                       ("finalize_checkpoint", lambda: None)]:
        setattr(nxd, name, fn(top, name, impl))

    layers_mod = "neuronx_distributed.parallel_layers.layers"
    layers = types.ModuleType(layers_mod)
    for name, base in [("ColumnParallelLinear", _Linear), ("RowParallelLinear", _Linear),
                       ("ParallelEmbedding", _Embedding)]:
        setattr(layers, name, _layer_class(name, getattr(mods[layers_mod], name), base, calls))
    qkv_mod = "neuronx_distributed.modules.qkv_linear"
    qkv = types.ModuleType(qkv_mod)

    class _RankGQAQKV(_GQAQKV):
        def __init__(self, arguments: dict[str, Any]) -> None:
            super().__init__(arguments, tp)

    qkv.GQAQKVColumnParallelLinear = _layer_class(  # type: ignore[attr-defined]
        "GQAQKVColumnParallelLinear", mods[qkv_mod].GQAQKVColumnParallelLinear, _RankGQAQKV,
        calls)

    ps_mod = "neuronx_distributed.parallel_layers.parallel_state"
    ps = types.ModuleType(ps_mod)
    for name, value in [("get_tensor_model_parallel_size", tp),
                        ("get_tensor_model_parallel_rank", 0), ("get_data_parallel_size", 1),
                        ("get_data_parallel_rank", 0),
                        ("get_tensor_model_parallel_group", None),
                        ("get_data_parallel_group", None)]:
        setattr(ps, name, fn(ps_mod, name, lambda *a, _v=value, **k: _v))
    loss_mod = "neuronx_distributed.parallel_layers.loss_functions"
    loss = types.ModuleType(loss_mod)
    loss.parallel_cross_entropy = fn(  # type: ignore[attr-defined]
        loss_mod, "parallel_cross_entropy", cross_entropy)
    return {top: nxd, layers_mod: layers, qkv_mod: qkv, ps_mod: ps, loss_mod: loss}
