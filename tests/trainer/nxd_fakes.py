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

import contextlib
import inspect
import types
from collections.abc import Callable, Iterator
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


# --- NxD's meta-device initialisation, at one rank of a tp group ---------------------------
# The layers above initialise as torch does (nn.Linear's kaiming at construction) and the
# model function runs on the CPU, which is all the call checks need. What follows replays NxD's
# own initialisation, for checks of `nxd_model.init_module` under `meta_device_init`, each step
# from aws-neuron/neuronx-distributed at fbac349 ("Release 2.29"), src/neuronx_distributed/:
#
# - the layers (parallel_layers/layers.py): the weight is allocated as
#   `Parameter(torch.empty(shape, dtype=dtype))` on the default device; assigning it goes
#   through `nn.Module.register_parameter`. If it is then on the CPU the layer initialises it at
#   once (`init_weight_cpu`: ParallelEmbedding 289-298, ColumnParallelLinear 681-684,
#   RowParallelLinear 927-930); on meta it only gets its tensor-parallel attributes (685-690).
#   `init_weight_cpu` -> `_initialize_parameter_cpu` (111-170): a master of the FULL shape in
#   fp32, `init_method(master)`, cast to the layer's dtype, this rank's chunk along the
#   partition dim copied into the weight (`create_local_weight`, stride 1: a contiguous chunk).
# - `initialize_parallel_model` (trainer/trainer.py 159-183): with `meta_device_init` the model
#   function runs inside `init_on_device(meta, include_buffers, force_custom_init_on_device=
#   True)` (utils/model_utils.py 257-332): `register_parameter` is patched to move every new
#   parameter to meta (buffers too only when include_buffers). Then `get_model_sequential`
#   (335-356): when a `param_init_fn` is given (meta or not), `reinit_model(model, cpu, fn)`
#   (220-229): inside `preserve_parallel_attributes` (165-202: tensor_model_parallel and its
#   partition fields, sequence_parallel_enabled, shared are put back on the new parameters) and
#   `preserve_shared_weights`, for every module of `model.modules()` (the root first, then in
#   registration order) its own parameters become `empty_like` on the CPU
#   (`_set_module_param_to_empty`, 205-217) and `param_init_fn(module, cpu)` runs; then the
#   model moves to the device (the CPU here).
# Not replayed: weight tying (the HLAT model ties nothing), include_buffers=True (the backend
# passes False; NxD would also patch torch's tensor constructors), the GQA layer's init.

_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride",
                   "num_partitions", "sequence_parallel_enabled", "shared")


class _NxDInitLayer(nn.Module):
    """A parallel linear or embedding layer of rank `rank` out of `tp`, initialised as NxD's."""

    partition_dim: int

    def __init__(self, arguments: dict[str, Any], shape: tuple[int, int], tp: int,
                 rank: int) -> None:
        super().__init__()
        if arguments.get("bias") or arguments.get("device") is not None:
            raise NotImplementedError("the HLAT model passes bias=False and no device")
        self.tp, self.rank, self.dtype = tp, rank, _dtype(arguments)
        self.init_method = arguments.get("init_method")
        local = list(shape)
        local[self.partition_dim] //= tp
        self.weight = nn.Parameter(torch.empty(local, dtype=self.dtype))
        if self.weight.device.type == "cpu":
            self.init_weight_cpu()
        else:  # meta: only the attributes, the values come from param_init_fn
            self._set_parallel_attributes()

    def _set_parallel_attributes(self) -> None:
        for name, value in (("tensor_model_parallel", True),
                            ("partition_dim", self.partition_dim), ("partition_stride", 1),
                            ("num_partitions", self.tp)):
            setattr(self.weight, name, value)

    @torch.no_grad()
    def init_weight_cpu(self) -> None:
        self._set_parallel_attributes()
        full = list(self.weight.shape)
        full[self.partition_dim] *= self.tp
        master = torch.empty(full, dtype=torch.float32)
        if self.init_method is None:  # ColumnParallelLinear._init_weight's default (541-545)
            nn.init.kaiming_uniform_(master, a=5 ** 0.5)
        else:
            self.init_method(master)
        chunk = master.to(self.dtype).chunk(self.tp, dim=self.partition_dim)[self.rank]
        self.weight.copy_(chunk)


class _NxDInitColumn(_NxDInitLayer):
    partition_dim = 0

    def __init__(self, arguments: dict[str, Any], tp: int, rank: int) -> None:
        super().__init__(arguments, (arguments["output_size"], arguments["input_size"]), tp,
                         rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _NxDInitRow(_NxDInitColumn):
    partition_dim = 1


class _NxDInitEmbedding(_NxDInitLayer):
    partition_dim = 0

    def __init__(self, arguments: dict[str, Any], tp: int, rank: int) -> None:
        super().__init__(arguments, (arguments["num_embeddings"], arguments["embedding_dim"]),
                         tp, rank)
        self.sp = arguments.get("sequence_parallel_enabled", False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = F.embedding(tokens, self.weight)
        return out.transpose(0, 1).contiguous() if self.sp else out


@contextlib.contextmanager
def init_on_meta() -> Iterator[None]:
    """model_utils.py init_on_device(meta, include_buffers=False, force_custom=True)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def reinit_model(model: nn.Module, param_init_fn: Callable[[nn.Module, torch.device], Any]
                 ) -> None:
    """model_utils.py reinit_model(model, cpu, fn), with preserve_parallel_attributes."""
    kept = {name: {a: getattr(p, a) for a in _PARALLEL_ATTRS if hasattr(p, a)}
            for name, p in model.named_parameters()}
    cpu = torch.device("cpu")
    with torch.no_grad():
        for module in model.modules():
            for key, param in module._parameters.items():
                if param is not None:
                    module._parameters[key] = nn.Parameter(
                        torch.empty_like(param, device=cpu), param.requires_grad)
            param_init_fn(module, cpu)
    for name, p in model.named_parameters():
        for attr, value in kept.get(name, {}).items():
            if not hasattr(p, attr):
                setattr(p, attr, value)


def nxd_init_modules(calls: Calls, *, tp: int = 1, rank: int = 0) -> dict[str, types.ModuleType]:
    """`fake_modules` with NxD's initialisation: the parallel layers above and an
    `initialize_parallel_model` that honours `model_init_config` as NxD does."""
    modules = fake_modules(calls, tp=tp)
    mods = rel.MODULES

    def init_model(nxd_config: dict[str, Any], model_fn: Any, include_buffers: bool = False,
                   *model_args: Any, **model_kwargs: Any) -> nn.Module:
        init = nxd_config.get("model_init_config") or {}
        if include_buffers:
            raise NotImplementedError("include_buffers=True is not replayed (see above)")
        if init.get("meta_device_init"):
            with init_on_meta():
                model: nn.Module = model_fn(*model_args, **model_kwargs)
        else:
            model = model_fn(*model_args, **model_kwargs)
        if init.get("param_init_fn") is not None:  # get_model_sequential, meta or not
            reinit_model(model, init["param_init_fn"])
        return model

    top = "neuronx_distributed"
    modules[top].initialize_parallel_model = checked(  # type: ignore[attr-defined]
        "initialize_parallel_model", mods[top].initialize_parallel_model, init_model, calls)
    layers_mod = "neuronx_distributed.parallel_layers.layers"
    layers = modules[layers_mod]
    for name, base in [("ColumnParallelLinear", _NxDInitColumn),
                       ("RowParallelLinear", _NxDInitRow),
                       ("ParallelEmbedding", _NxDInitEmbedding)]:
        ranked = type(f"_{name}", (base,), {
            "__init__": lambda self, arguments, _b=base: _b.__init__(self, arguments, tp, rank)})
        setattr(layers, name, _layer_class(name, getattr(mods[layers_mod], name), ranked, calls))
    ps = modules["neuronx_distributed.parallel_layers.parallel_state"]
    ps.get_tensor_model_parallel_rank = checked(  # type: ignore[attr-defined]
        "get_tensor_model_parallel_rank",
        mods["neuronx_distributed.parallel_layers.parallel_state"].get_tensor_model_parallel_rank,
        lambda *a, **k: rank, calls)
    return modules
