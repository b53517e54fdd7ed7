"""The neuronx-distributed (NxD) APIs our neuron-xla backend calls, with upstream's signatures.

What this is: stub functions and classes whose call signatures (parameter names, kinds, order and
defaults) are copied from NxD's public source, so that a test can check our call sites with
`inspect.signature(stub).bind(*args, **kwargs)` and fakes can be given exactly these signatures.
The stubs do nothing (`raise NotImplementedError`). `MODULES` maps each upstream module path to a
module object holding its stubs, shaped like the real package for `require_neuron` fakes.

Source read (nothing here ran against the real package; it is not installable here):

- aws-neuron/neuronx-distributed, commit fbac349b61a3adbb123c2983835af692840ff62f, "Release 2.29
  (#41)" (2026-04-09), head of `main`; there is no `v2.29*` tag or release branch in the stored
  repository (newest tag: v2.28.0 = 22cadad). Its src/neuronx_distributed/_version.py says
  0.18.0, i.e. the NxD of Neuron SDK 2.29 (the 2.29.x training DLC pins
  neuronx_distributed==0.18.27753+1cafd54f).
- Caveat: the SDK 2.30 training image (aws-neuron/deep-learning-containers tag 2.30.0,
  pytorch/training/2.9.0/Dockerfile.neuronx line 216) pins neuronx_distributed==0.19.28093,
  whose source is not in the stored repository. Between v2.28.0 and fbac349 none of the files
  below changed except parallel_layers/layers.py (RowParallelLinear's `tile_cc` path removed from
  forward; no signature changed), so these signatures held for two releases; 0.19 is unverified.
- NeuronZero1Optimizer takes `*args, **kwargs` and passes them to torch_xla's
  ZeroRedundancyOptimizer: its effective signature is copied from pytorch/xla tag v2.9.0
  (commit 5fab7053df86c8d503b98d9e7202ca8b8d4978c7),
  torch_xla/distributed/zero_redundancy_optimizer.py lines 68-85.

Upstream file of each item (paths under src/neuronx_distributed/ at fbac349):

- neuronx_distributed_config, initialize_parallel_model, initialize_parallel_optimizer:
  trainer/trainer.py lines 32-47, 147, 237 (re-exported by __init__.py and trainer/__init__.py).
- save_checkpoint, load_checkpoint, has_checkpoint, finalize_checkpoint: trainer/checkpoint.py
  lines 654-668, 838-847, 640, 970.
- NxDOptimizer (what initialize_parallel_optimizer returns): trainer/optimizer.py lines 10-147
  (not optimizer/neuron_optimizer.py, which does not exist).
- NeuronZero1Optimizer: optimizer/zero_redundancy_optimizer.py lines 30-57.
- ColumnParallelLinear, RowParallelLinear, ParallelEmbedding: parallel_layers/layers.py
  lines 587-607, 846-866, 204-225.
- GQAQKVColumnParallelLinear: modules/qkv_linear.py lines 420-434.
- parallel_cross_entropy: parallel_layers/loss_functions.py line 217.
- parallel_state functions: parallel_layers/parallel_state.py lines 391-399 (initialize),
  826, 839, 867, 895, 918, 1037, 1044 (getters).

Defaults that are expressions upstream (`torch.float32`, `init.normal_`) are `Expr` sentinels
holding the source text; every other default is the literal value.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Final

NXD_REPO: Final = "aws-neuron/neuronx-distributed"
NXD_COMMIT: Final = "fbac349b61a3adbb123c2983835af692840ff62f"
NXD_RELEASE: Final = "Release 2.29 (#41)"
NXD_VERSION: Final = "0.18.0"
SDK_230_NXD_VERSION: Final = "0.19.28093"  # what the 2.30 image installs; source not read
TORCH_XLA_TAG: Final = "v2.9.0"
TORCH_XLA_COMMIT: Final = "5fab7053df86c8d503b98d9e7202ca8b8d4978c7"


@dataclass(frozen=True)
class Expr:
    """An upstream default that is an expression, kept as its source text."""

    source: str

    def __repr__(self) -> str:
        return self.source


TORCH_FLOAT32: Final = Expr("torch.float32")
INIT_NORMAL: Final = Expr("torch.nn.init.normal_")


# --- neuronx_distributed (trainer/trainer.py, trainer/checkpoint.py) -----------------------------


def neuronx_distributed_config(
    tensor_parallel_size: Any = 1,
    pipeline_parallel_size: Any = 1,
    expert_parallel_size: Any = 1,
    context_parallel_size: Any = 1,
    pipeline_config: Any = None,
    optimizer_config: Any = None,
    activation_checkpoint_config: Any = None,
    pad_model: Any = False,
    sequence_parallel: Any = False,
    model_init_config: Any = None,
    lora_config: Any = None,
    mixed_precision_config: Any = None,
    sequential_move_factor: Any = 11,
    lnc_size: Any = 1,
) -> Any:
    """trainer.py 32-144. Calls parallel_state.initialize_model_parallel when torch.distributed
    is initialized. Default optimizer_config: {"zero_one_enabled": False, "grad_clipping": True,
    "max_grad_norm": 1.0}; default mixed_precision_config: use_master_weights and
    use_fp32_grad_acc = zero_one_enabled, use_master_weights_in_ckpt False."""
    raise NotImplementedError


def initialize_parallel_model(
    nxd_config: Any,
    model_fn: Any,
    include_buffers: bool = False,
    *model_args: Any,
    **model_kwargs: Any,
) -> Any:
    """trainer.py 147-234: the third positional argument is `include_buffers`; the model is
    built as `model_fn(*model_args, **model_kwargs)` (lines 166/168) and wrapped in NxDModel."""
    raise NotImplementedError


def initialize_parallel_optimizer(
    nxd_config: Any, optimizer_class: Any, parameters: Any, **defaults: Any
) -> Any:
    """trainer.py 237-240: NxDOptimizer(initialize_optimizer_from_class(...), nxd_config)."""
    raise NotImplementedError


def save_checkpoint(
    checkpoint_dir_str: Any,
    tag: Any,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    user_content: Any = None,
    num_workers: Any = 8,
    use_xser: Any = False,
    num_kept_ckpts: Any = None,
    async_save: Any = False,
    zero1_optimizer: Any = False,
    use_zero1_dcp: Any = False,
    avoid_saving_lower_precision_weights: Any = False,
) -> None:
    """checkpoint.py 654-824."""
    raise NotImplementedError


def load_checkpoint(
    path: Any,
    tag: Any = None,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    num_workers: Any = 8,
    strict: Any = True,
    use_zero1_dcp: Any = False,
) -> Any:
    """checkpoint.py 838-967; returns the saved user_content or None."""
    raise NotImplementedError


def has_checkpoint(checkpoint_dir_str: Any) -> bool:
    """checkpoint.py 640-642: any tag with a `done` file."""
    raise NotImplementedError


def finalize_checkpoint() -> None:
    """checkpoint.py 970-972: waits for a pending asynchronous save."""
    raise NotImplementedError


# --- neuronx_distributed.trainer.optimizer / neuronx_distributed.optimizer -----------------------


class NxDOptimizer:
    """trainer/optimizer.py 10-147 (subclasses torch.optim.Optimizer upstream)."""

    def __init__(self, optimizer: Any, nxd_config: Any) -> None:
        raise NotImplementedError

    @property
    def grad_norm(self) -> Any:
        """Set by step(): clip_grad_norm's result without ZeRO-1, optimizer.grad_norm with it."""
        raise NotImplementedError

    def step(self, closure: Any = None) -> Any:
        raise NotImplementedError

    def zero_grad(self, set_to_none: Any = False) -> None:
        raise NotImplementedError


class ZeroRedundancyOptimizer:
    """torch_xla/distributed/zero_redundancy_optimizer.py (pytorch/xla v2.9.0) lines 68-85:
    the signature NeuronZero1Optimizer's `*args, **kwargs` reach. `**defaults` go to
    `optimizer_class`."""

    def __init__(
        self,
        params: Any,
        optimizer_class: Any,
        optimizer_dtype: Any = None,
        grad_clipping: bool = True,
        max_norm: Any = None,
        pin_layout: bool = True,
        sharding_groups: Any = None,
        grad_norm_groups: Any = None,
        lazy_init: bool = False,
        bucket_cap_mb_all_gather: int = 0,
        bucket_cap_mb_reduce_scatter: int = 0,
        use_grad_acc_hook: bool = False,
        save_master_weights: bool = False,
        higher_cc_precision: bool = False,
        **defaults: Any,
    ) -> None:
        raise NotImplementedError

    @property
    def grad_norm(self) -> Any:
        raise NotImplementedError

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = False) -> None:
        raise NotImplementedError


class NeuronZero1Optimizer(ZeroRedundancyOptimizer):
    """optimizer/zero_redundancy_optimizer.py 30-57: upstream's own signature is
    `(self, *args, **kwargs)`; bind against ZeroRedundancyOptimizer.__init__ for its meaning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError


# keys initialize_optimizer_from_class (trainer.py 250-288) passes to NeuronZero1Optimizer
# itself; a caller's **defaults repeating one of them is a TypeError (duplicate keyword)
ZERO1_CONFIG_KEYS: Final = (
    "grad_clipping", "pin_layout", "sharding_groups", "grad_norm_groups", "coalesce_cc",
    "bucket_cap_mb_all_gather", "bucket_cap_mb_reduce_scatter", "use_grad_acc_hook",
    "higher_cc_precision", "save_master_weights",
)


# --- neuronx_distributed.parallel_layers.layers ---------------------------------------------------


class ColumnParallelLinear:
    """layers.py 587-607; weight [output_size / tp, input_size], partition dim 0."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        dtype: Any = TORCH_FLOAT32,
        device: Any = None,
        stride: int = 1,
        init_method: Any = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: Any = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        pad: bool = False,
        pad_alignment_size_per_rank: int = 1,
        keep_padded_output: bool = False,
        tensor_model_parallel_group: Any = None,
        reduce_dtype: Any = TORCH_FLOAT32,
        rank_ordering: Any = None,
    ) -> None:
        raise NotImplementedError


class RowParallelLinear:
    """layers.py 846-866; weight [output_size, input_size / tp], partition dim 1."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        dtype: Any = TORCH_FLOAT32,
        device: Any = None,
        stride: int = 1,
        init_method: Any = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: Any = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        pad: bool = False,
        reduce_output: bool = True,
        tensor_model_parallel_group: Any = None,
        reduce_dtype: Any = TORCH_FLOAT32,
        tile_cc: bool = False,
        rank_ordering: Any = None,
    ) -> None:
        raise NotImplementedError


class ParallelEmbedding:
    """layers.py 204-225; weight [num_embeddings / tp, embedding_dim] (vocab-sharded)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Any = None,
        max_norm: Any = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: Any = INIT_NORMAL,
        device: Any = None,
        dtype: Any = TORCH_FLOAT32,
        shard_across_embedding: bool = False,
        pad: bool = False,
        sequence_parallel_enabled: bool = False,
        tensor_model_parallel_group: Any = None,
        use_spmd_rank: bool = False,
        sequence_dimension: Any = None,
        tile_cc: bool = False,
        rank_ordering: Any = None,
        collect_output: bool = True,
    ) -> None:
        raise NotImplementedError


# --- neuronx_distributed.modules.qkv_linear -------------------------------------------------------


class GQAQKVColumnParallelLinear:
    """qkv_linear.py 420-434. output_sizes = [q_size, kv_size]. fuse_qkv=True (default) makes
    one `weight_qkv` [q/tp + 2*kv*m/tp, input_size], else weight_q/weight_k/weight_v; forward
    returns the tuple (q, k, v)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Any,
        bias: bool = True,
        gather_output: bool = True,
        dtype: Any = TORCH_FLOAT32,
        device: Any = None,
        init_method: Any = None,
        sequence_parallel_enabled: bool = False,
        keep_master_weight: bool = False,
        kv_size_multiplier: int = 1,
        fuse_qkv: bool = True,
        reduce_dtype: Any = TORCH_FLOAT32,
    ) -> None:
        raise NotImplementedError


# --- neuronx_distributed.parallel_layers.loss_functions ------------------------------------------


def parallel_cross_entropy(
    vocab_parallel_logits: Any, target: Any, label_smoothing: Any = 0.0
) -> Any:
    """loss_functions.py 217-219: per-token loss, no reduction and no ignore_index; subtracts
    the max from `vocab_parallel_logits` in place (line 23)."""
    raise NotImplementedError


# --- neuronx_distributed.parallel_layers.parallel_state -------------------------------------------


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    skip_collective_init: bool = False,
    lnc_size: int = 1,
    mesh_only: bool = False,
) -> Any:
    """parallel_state.py 391-399 (note: context_parallel_size comes before
    expert_model_parallel_size here, unlike neuronx_distributed_config)."""
    raise NotImplementedError


def model_parallel_is_initialized() -> bool:
    raise NotImplementedError


def get_tensor_model_parallel_group(as_list: bool = False) -> Any:
    raise NotImplementedError


def get_data_parallel_group(as_list: bool = False) -> Any:
    raise NotImplementedError


def get_tensor_model_parallel_size() -> int:
    raise NotImplementedError


def get_tensor_model_parallel_rank() -> int:
    raise NotImplementedError


def get_data_parallel_size() -> int:
    raise NotImplementedError


def get_data_parallel_rank() -> int:
    raise NotImplementedError


# --- module objects -------------------------------------------------------------------------------


def _module(name: str, doc: str, **members: Any) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    for key, value in members.items():
        setattr(module, key, value)
    return module


_CHECKPOINT_API = {
    "save_checkpoint": save_checkpoint,
    "load_checkpoint": load_checkpoint,
    "has_checkpoint": has_checkpoint,
    "finalize_checkpoint": finalize_checkpoint,
}
_TRAINER_API = {
    "neuronx_distributed_config": neuronx_distributed_config,
    "initialize_parallel_model": initialize_parallel_model,
    "initialize_parallel_optimizer": initialize_parallel_optimizer,
}

MODULES: dict[str, types.ModuleType] = {
    "neuronx_distributed": _module(
        "neuronx_distributed", "src/neuronx_distributed/__init__.py",
        **_TRAINER_API, **_CHECKPOINT_API),
    "neuronx_distributed.trainer": _module(
        "neuronx_distributed.trainer", "src/neuronx_distributed/trainer/__init__.py",
        load_checkpoint=load_checkpoint, save_checkpoint=save_checkpoint, **_TRAINER_API),
    "neuronx_distributed.trainer.checkpoint": _module(
        "neuronx_distributed.trainer.checkpoint",
        "src/neuronx_distributed/trainer/checkpoint.py", **_CHECKPOINT_API),
    "neuronx_distributed.trainer.optimizer": _module(
        "neuronx_distributed.trainer.optimizer", "src/neuronx_distributed/trainer/optimizer.py",
        NxDOptimizer=NxDOptimizer),
    "neuronx_distributed.optimizer": _module(
        "neuronx_distributed.optimizer", "src/neuronx_distributed/optimizer/__init__.py",
        NeuronZero1Optimizer=NeuronZero1Optimizer),
    "neuronx_distributed.optimizer.zero_redundancy_optimizer": _module(
        "neuronx_distributed.optimizer.zero_redundancy_optimizer",
        "src/neuronx_distributed/optimizer/zero_redundancy_optimizer.py",
        NeuronZero1Optimizer=NeuronZero1Optimizer),
    "neuronx_distributed.parallel_layers.layers": _module(
        "neuronx_distributed.parallel_layers.layers",
        "src/neuronx_distributed/parallel_layers/layers.py",
        ColumnParallelLinear=ColumnParallelLinear, RowParallelLinear=RowParallelLinear,
        ParallelEmbedding=ParallelEmbedding),
    "neuronx_distributed.parallel_layers.parallel_state": _module(
        "neuronx_distributed.parallel_layers.parallel_state",
        "src/neuronx_distributed/parallel_layers/parallel_state.py",
        initialize_model_parallel=initialize_model_parallel,
        model_parallel_is_initialized=model_parallel_is_initialized,
        get_tensor_model_parallel_group=get_tensor_model_parallel_group,
        get_data_parallel_group=get_data_parallel_group,
        get_tensor_model_parallel_size=get_tensor_model_parallel_size,
        get_tensor_model_parallel_rank=get_tensor_model_parallel_rank,
        get_data_parallel_size=get_data_parallel_size,
        get_data_parallel_rank=get_data_parallel_rank),
    "neuronx_distributed.parallel_layers.loss_functions": _module(
        "neuronx_distributed.parallel_layers.loss_functions",
        "src/neuronx_distributed/parallel_layers/loss_functions.py",
        parallel_cross_entropy=parallel_cross_entropy),
    "neuronx_distributed.modules.qkv_linear": _module(
        "neuronx_distributed.modules.qkv_linear", "src/neuronx_distributed/modules/qkv_linear.py",
        GQAQKVColumnParallelLinear=GQAQKVColumnParallelLinear),
    "torch_xla.distributed.zero_redundancy_optimizer": _module(
        "torch_xla.distributed.zero_redundancy_optimizer",
        "pytorch/xla v2.9.0 torch_xla/distributed/zero_redundancy_optimizer.py",
        ZeroRedundancyOptimizer=ZeroRedundancyOptimizer),
}
