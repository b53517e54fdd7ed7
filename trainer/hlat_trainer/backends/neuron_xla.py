"""Trainium through torch-xla and neuronx-distributed (NxD): the stack the HLAT paper ran.

What it does, each call from a documented API (sources: /shared/reference/neuron-eks.md, and
aws-neuron/neuronx-distributed at release 2.29, file named beside each call):

- Device and process group: `torch_xla.device()` (older: `xm.xla_device()`), and
  `dist.init_process_group("xla")` under torchrun after importing
  `torch_xla.distributed.xla_backend` (PyTorch Neuron programming guide).
- Step end: `torch_xla.sync()` (older: `xm.mark_step()`) once per optimizer step, so each step
  is one compiled graph; also before a checkpoint is saved ("xm.save moves to CPU; mark_step
  first").
- Model: `nxd.neuronx_distributed_config(tensor_parallel_size, optimizer_config={
  zero_one_enabled, grad_clipping, max_grad_norm}, sequence_parallel, activation_checkpoint_config,
  model_init_config, mixed_precision_config)` then `nxd.initialize_parallel_model(cfg, model_fn,
  ...)` (trainer/trainer.py); the model is `nxd_model.NxDTransformer` (NxD parallel layers),
  built on the meta device and materialised one module at a time by `nxd_model.init_module`
  (model_init_config `meta_device_init`, as NxD's LLaMA examples): built on the CPU, NxD's
  parallel layers make every full weight in every process (layers.py
  `_initialize_parameter_cpu`), 32 copies of the 70B per node at once.
- Precision, per `precision` (`nxd_precision`; the paper's scripts: awslabs/HLAT 7b/ and 70b/
  tp_zero1_llama2_*_hf_pretrain.sh): `bf16-sr` is the 7B's pure BF16 with the runtime's
  stochastic rounding (`NEURON_RT_STOCHASTIC_ROUNDING_EN=1`, neuron_env.py), parameters cast with
  `model.to(bfloat16)` as migration-from-xla-downcast-bf16.rst says (XLA_USE_BF16 is deprecated);
  `mixed` is the 70B's: bf16 parameters, fp32 master weights and moments in the ZeRO-1 shards,
  fp32 gradient accumulation (the scripts' USE_GRAD_ACC_HOOK=1), autocast on device type "xla",
  SR off; NxD calls this "Standard Mixed Precision" (standard_mixed_precision.rst). Under ZeRO-1
  the optimizer state is fp32 in every precision: NxD computes and all-reduces the gradient norm
  in the shards' dtype (parallel_layers/grads.py get_grad_norm, `dtype = params[0].dtype`), which
  in bf16 keeps 3 significant digits. Without ZeRO-1 NxD has no master weights (it refuses them:
  trainer/trainer.py 304-309) and its clip_grad_norm takes the parameters' dtype.
- Optimizer: `nxd.initialize_parallel_optimizer(cfg, torch.optim.AdamW, params, lr, betas, eps,
  weight_decay)`: NeuronZero1Optimizer when zero1 (shards over DP groups, grad norm over TP
  groups), which also clips to `max_grad_norm` and exposes `grad_norm`; the trainer must not
  clip again (`parallelizes_model`).
- Loss: `parallel_cross_entropy` over the vocab-parallel logits
  (parallel_layers/loss_functions.py, as the LLaMA example).
- Checkpoints: `nxd.save_checkpoint(dir, tag="step_<N>", model, optimizer, user_content,
  use_xser=True, num_kept_ckpts=None, async_save)` (retention is ManagedEngine's, which spares
  a checkpoint being read); `nxd.load_checkpoint(dir, tag, model=...)` then
  `nxd.load_checkpoint(dir, tag, optimizer=...)`: the model first, in a call of its own
  (`load_checkpoint`'s comment says why), `nxd.has_checkpoint(dir)`,
  `nxd.finalize_checkpoint()` (trainer/checkpoint.py).
  NxD writes `<tag>/done` last (rank 0, after a rendezvous) and deletes `done` first when
  purging: the same completeness rule as hlat_api's layout, with `<dir>` = `<root>/<job>`.
  NxD's checkpoint format is its own: a checkpoint from one backend kind does not load in the
  other.

Nothing here ran: torch-xla for Neuron, torch-neuronx and neuronx-distributed are not on PyPI.
The Neuron packages are imported inside methods only, so this module imports anywhere; using
the backend without them raises `UserError` naming the package and the image to use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from hlat_trainer.backends.base import Backend, BackendName
from hlat_trainer.backends.neuron_import import require_neuron
from hlat_trainer.neuron_env import logical_nc_size

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import Tensor, nn

    from hlat_trainer.devicetime import DeviceClock
    from hlat_trainer.distributed import World

_NO_CLIP = 1e30


@dataclass(frozen=True)
class NxDPrecision:
    """What a `precision` asks of NxD (see the module doc); dtypes as torch attribute names."""

    param_dtype: str
    """The parameters' dtype on the device (and of the gradients NxD reduces)."""
    optimizer_dtype: str | None
    """ZeRO-1's shards (master weights, moments, gradient shards, the norm); None without."""
    mixed_precision_config: dict[str, bool]


def nxd_precision(precision: str, zero1: bool) -> NxDPrecision:
    """The paper's recipes (awslabs/HLAT: 7b/ pure BF16 + SR; 70b/ ZeRO-1 with master weights,
    USE_GRAD_ACC_HOOK=1, AMP_ENABLED=1, SR off) in today's NxD terms (trainer/trainer.py
    243-315 at fbac349: `use_fp32_grad_acc` -> use_grad_acc_hook + higher_cc_precision,
    `use_master_weights_in_ckpt` -> save_master_weights; `use_master_weights` itself changes
    nothing unless XLA_DOWNCAST_BF16 is set: the master weights are ZeRO-1's shards in
    `optimizer_dtype`, torch-xla's default fp32, zero_redundancy_optimizer.py 101, 255-258)."""
    half = precision in ("bf16", "bf16-sr") or (precision == "mixed" and zero1)
    param = "bfloat16" if half else "float32"
    if not zero1:  # NxD refuses master weights and fp32 accumulation without ZeRO-1
        return NxDPrecision(param, None, {"use_master_weights": False, "use_fp32_grad_acc": False,
                                          "use_master_weights_in_ckpt": False})
    # fp32 master weights are wider than bf16 parameters: re-sharded from the loaded parameters
    # at a resume (torch-xla's load_state_dict -> init_zero) they would lose their low bits,
    # so the checkpoint carries them (NxD then skips the model's tensors: checkpoint.py 917-919)
    return NxDPrecision(param, "float32", {
        "use_master_weights": True, "use_fp32_grad_acc": precision == "mixed",
        "use_master_weights_in_ckpt": half})


class NeuronXlaBackend(Backend):
    name: BackendName = "neuron-xla"
    dist_backend = "xla"
    autocast_device_type = "xla"
    parallelizes_model: ClassVar[bool] = True
    compiles: ClassVar[bool] = True

    _nxd_config: dict[str, Any] | None = None

    # --- placement ------------------------------------------------------------------------

    def device(self, local_rank: int) -> torch.device:
        txla = require_neuron("torch_xla")
        # torchrun's LOCAL_RANK picks the NeuronCore; torch_xla.device() replaces xm.xla_device()
        if hasattr(txla, "device"):
            dev: torch.device = txla.device()
            return dev
        dev = require_neuron("torch_xla.core.xla_model").xla_device()
        return dev

    def init_world(self) -> World:
        """Join the "xla" process group, let NxD lay out the ranks and take its dp and tp groups
        and this rank's place in them (NxD's layout is [PP, DP, TP] with TP fastest, except
        where its replica groups interleave: trn2 at LNC=2, trn1 at tp 4)."""
        import torch.distributed as dist

        from hlat_trainer.distributed import World, join, local_rank

        require_neuron("torch_xla.distributed.xla_backend")  # registers the "xla" backend
        join(self.spec, "xla")
        self.nxd_config()  # initialize_model_parallel
        ps = require_neuron("neuronx_distributed.parallel_layers.parallel_state")
        tp, dp = ps.get_tensor_model_parallel_size(), ps.get_data_parallel_size()
        return World(dist.get_rank(), dp * tp, local_rank(), dp, tp,
                     dp_group=ps.get_data_parallel_group(),
                     tp_group=ps.get_tensor_model_parallel_group(),
                     dp_rank=ps.get_data_parallel_rank(),
                     tp_rank=ps.get_tensor_model_parallel_rank())

    def compile_seconds(self) -> float:
        """torch-xla's CompileTime metric: (samples, accumulated nanoseconds, recent samples);
        on Neuron it includes neuronx-cc or the compile cache's load."""
        data = require_neuron("torch_xla.debug.metrics").metric_data("CompileTime")
        return float(data[1]) / 1e9 if data else 0.0

    def device_clock(self) -> DeviceClock | None:
        """Graph end times from torch-xla's buffer-ready callback (`on_ready_callback`,
        torch_xla/experimental/callback.py in torch-xla 2.9: it calls back with the tensor once
        its buffer is ready); None on a torch-xla without it."""
        try:
            callback = importlib.import_module("torch_xla.experimental.callback")
        except ImportError:
            return None
        from hlat_trainer.devicetime import DeviceClock

        return DeviceClock(lambda tensor, ready: callback.on_ready_callback(
            tensor, lambda _tensor: ready()), compiled=self.compile_seconds)

    def step_end(self) -> None:
        txla = require_neuron("torch_xla")
        if hasattr(txla, "sync"):
            txla.sync()
        else:
            require_neuron("torch_xla.core.xla_model").mark_step()

    # to_device is the base one, `batch.to(device)`: an upload, not a graph. torch-xla's
    # MpDeviceLoader would overlap it with compute but prefetches (16 batches by default) from
    # the loader, whose saved position would then run ahead of what was trained: exact resume
    # needs the loader to yield only what a step takes.

    def to_host(self, tensors: list[Tensor]) -> list[float]:
        # each tensor is already device data (the step ended in a sync): copy them as they are.
        # Stacking first, as eager devices do, would trace a new graph for every list length.
        return [float(t.detach().cpu()) for t in tensors]

    def micro_batch_end(self) -> None:
        # a graph cut per micro-batch: without it every micro-batch of the step is traced into
        # one graph (64 unrolled forward/backward passes at the paper's 7B layout), which also
        # changes whenever the accumulation count (the node count) does
        self.step_end()

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        lf = require_neuron("neuronx_distributed.parallel_layers.loss_functions")
        per_token = lf.parallel_cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        out: Tensor = per_token.mean()
        return out

    # --- model and optimizer --------------------------------------------------------------

    def nxd(self) -> Any:
        """The `neuronx_distributed` package (the xla tier hands in its stand-in here)."""
        return require_neuron("neuronx_distributed")

    def _max_norm(self) -> float:
        # clipping stays on so that the optimizer always computes the norm the loop logs;
        # gradClip 0 (off) becomes a bound no gradient reaches
        clip = self.spec.optimizer.grad_clip
        return clip if clip > 0 else _NO_CLIP

    def nxd_config(self) -> dict[str, Any]:
        """One NxD config shared by the model and the optimizer (it also initialises the TP/DP
        groups: parallel_state.initialize_model_parallel)."""
        if self._nxd_config is None:
            nxd = self.nxd()
            p = self.spec.parallelism
            self._nxd_config = nxd.neuronx_distributed_config(
                tensor_parallel_size=p.tensor,
                pipeline_parallel_size=p.pipeline,
                optimizer_config={"zero_one_enabled": p.zero1, "grad_clipping": True,
                                  "max_grad_norm": self._max_norm()},
                sequence_parallel=p.sequence_parallel,
                activation_checkpoint_config=self._activation_checkpoint_config(),
                model_init_config=self._model_init_config(),
                mixed_precision_config=dict(self.precision().mixed_precision_config),
                # trn2 runs 2 physical cores per logical one by default (LNC=2); NxD does not
                # infer it and needs it to lay out replica groups (parallel_state.py)
                lnc_size=logical_nc_size(self.spec.instance_type),
            )
        return self._nxd_config

    def precision(self) -> NxDPrecision:
        return nxd_precision(self.spec.precision, self.spec.parallelism.zero1)

    def param_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.precision().param_dtype)
        return dtype

    def _model_init_config(self) -> dict[str, Any]:
        from hlat_trainer.backends.nxd_model import init_module

        # meta_device_init needs a param_init_fn (trainer.py 113-115); NxD calls it as
        # fn(module, cpu) for every module after emptying its parameters on the CPU
        # (utils/model_utils.py reinit_model, 220-229), then moves the model to the device
        return {"meta_device_init": True, "param_init_fn": init_module}

    def _activation_checkpoint_config(self) -> type[nn.Module] | None:
        from hlat_trainer.backends.nxd_model import CoreAttention, NxDDecoderLayer

        mode = self.spec.parallelism.activation_checkpointing
        # selective recompute of the attention core needs NEURON_CC_FLAGS -O1 (neuron_env.py)
        return {"none": None, "selective": CoreAttention, "full": NxDDecoderLayer}[mode]

    def build_model(self, device: torch.device) -> nn.Module:
        from hlat_trainer.backends.nxd_model import build_nxd_model
        from hlat_trainer.precision import PrecisionPolicy

        nxd = self.nxd()
        s = self.spec
        dtype = self.param_dtype()
        # initialize_parallel_model(nxd_config, model_fn, include_buffers, *model_args): the
        # third positional is include_buffers, then the model's args. False: the RoPE tables
        # (buffers NxD's reinit does not rebuild) are computed for real, not left on meta.
        # The layers are built in the parameter dtype: NxD's ParallelEmbedding picks its output
        # dtype from that argument, not from its weight (layers.py), so a cast afterwards would
        # leave the residual stream fp32 under tensor parallelism.
        model: nn.Module = nxd.initialize_parallel_model(
            self.nxd_config(), build_nxd_model, False, s.model.dims(),
            s.parallelism.sequence_parallel, s.train.seed, dtype)
        # the norms' weights too (the layers are built in it): bf16 parameters under bf16,
        # bf16-sr and ZeRO-1 mixed, the rounding done by the runtime (env), not XLA_USE_BF16
        return PrecisionPolicy(s.precision, dtype, None).apply(model)

    def build_optimizer(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        import torch

        nxd = self.nxd()
        o = self.spec.optimizer
        extra: dict[str, Any] = {}
        optimizer_dtype = self.precision().optimizer_dtype
        if optimizer_dtype is not None:
            # NeuronZero1Optimizer (torch-xla's ZeroRedundancyOptimizer) does not take the
            # config's max_grad_norm (it clips at 1.0 unless given max_norm), and keeps master
            # weights, moments and the gradient norm in optimizer_dtype: both are passed here,
            # where they reach it and not plain AdamW, which refuses them
            extra = {"max_norm": self._max_norm(),
                     "optimizer_dtype": getattr(torch, optimizer_dtype)}
        opt: torch.optim.Optimizer = nxd.initialize_parallel_optimizer(
            self.nxd_config(), torch.optim.AdamW, params, lr=o.lr, betas=o.betas,
            eps=o.eps, weight_decay=o.weight_decay, **extra)
        return opt

    def is_tp_sharded(self, param: Tensor) -> bool:
        # NxD's parallel layers mark their sharded weights (parallel_layers/utils.py
        # set_tensor_model_parallel_attributes)
        return bool(getattr(param, "tensor_model_parallel", False))

    # --- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer, user_content: dict[str, int]) -> None:
        nxd = self.nxd()
        self.step_end()  # materialise pending device work before the host copies
        c = self.spec.checkpoint
        # num_kept_ckpts None: NxD keeps every complete checkpoint (trainer/checkpoint.py
        # 95); ManagedEngine purges to checkpoint.keep itself, sparing those being read (an
        # evaluation Job's), which NxD's purge knows nothing of
        nxd.save_checkpoint(directory, tag=f"step_{step}", model=model, optimizer=optimizer,
                            user_content=user_content, use_xser=True, num_kept_ckpts=None,
                            async_save=c.async_)

    def load_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> None:
        # an explicit tag: the engine picks the checkpoint (newest complete, older ones when it
        # does not load) and reads its own per-rank loop state from the same directory.
        # Two calls, the model first: one call loads the optimizer first (trainer/checkpoint.py
        # 894-937, then the model 939-951), and ZeRO-1's load_state_dict re-shards the
        # parameters as they are then (torch-xla zero_redundancy_optimizer.py 518 init_zero,
        # 255 `param.data`): the fresh initialisation, which its first step all-gathers over
        # the loaded model. Loaded first, the model is what gets sharded. (Master weights in
        # the checkpoint, nxd_precision, are copied over those shards: 524-548.)
        nxd = self.nxd()
        nxd.load_checkpoint(directory, tag=f"step_{step}", model=model)
        # the loaded weights as device data before init_zero's `xm.unlazy` reads them: left
        # pending, torch-xla 2.9 (PJRT CPU, the xla tier) fails the next sync on a donated
        # buffer ("buffer ... is deleted")
        self.step_end()
        nxd.load_checkpoint(directory, tag=f"step_{step}", optimizer=optimizer)

    def finalize_checkpoint(self) -> None:
        self.nxd().finalize_checkpoint()

    # --- in-memory snapshots ----------------------------------------------------------------

    def snapshot_state(self, model: nn.Module, optimizer: torch.optim.Optimizer
                       ) -> dict[str, Any]:
        # what NxD's save_checkpoint writes of a rank, the optimizer's state_dict (under
        # ZeRO-1 torch-xla's: its shard's moments, the shapes, and the fp32 master weights when
        # save_master_weights, zero_redundancy_optimizer.py 496-510) and the model's, each
        # tensor copied to the host: the state dicts hold the live device tensors (`shard.data`)
        self.step_end()  # device data: each copy is a transfer, no graph
        state: dict[str, Any] = _on_host({"optim": optimizer.state_dict(),
                                          "model": model.state_dict()})
        return state

    def load_snapshot_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                            state: dict[str, Any]) -> None:
        # as load_checkpoint and for its reasons: the model first, its weights made device
        # data, then the optimizer, whose load_state_dict re-shards the loaded parameters
        # (init_zero) and copies the master weights over the shards (512-548)
        model.load_state_dict(state["model"], strict=True)
        self.step_end()
        optimizer.load_state_dict(state["optim"])
        self.step_end()


def _on_host(value: Any) -> Any:
    """`value` (state dicts: dicts, lists and tuples of tensors and plain values) with every
    tensor a host copy."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)([_on_host(v) for v in value])
    return value
