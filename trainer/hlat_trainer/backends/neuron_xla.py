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
  mixed_precision_config)` then `nxd.initialize_parallel_model(cfg, model_fn, ...)`
  (trainer/trainer.py); the model is `nxd_model.NxDTransformer` (NxD parallel layers).
- Precision: pure BF16 with stochastic rounding as the paper, the current way: parameters cast
  to bf16 (`model.to(torch.bfloat16)`; the deprecated XLA_USE_BF16 is not set) and
  `NEURON_RT_STOCHASTIC_ROUNDING_EN=1` in the environment (neuron_env.py), per
  migration-from-xla-downcast-bf16.rst. NxD's master-weight / fp32-grad-accumulation options are
  turned off explicitly: by default NxD enables them whenever ZeRO-1 is on (trainer.py), which
  would be mixed precision, not the paper's recipe. `mixed` autocasts on device type "xla".
- Optimizer: `nxd.initialize_parallel_optimizer(cfg, torch.optim.AdamW, params, lr, betas, eps,
  weight_decay)`: NeuronZero1Optimizer when zero1 (shards over DP groups, grad norm over TP
  groups), which also clips to `max_grad_norm` and exposes `grad_norm`; the trainer must not
  clip again (`parallelizes_model`).
- Loss: `parallel_cross_entropy` over the vocab-parallel logits
  (parallel_layers/loss_functions.py, as the LLaMA example).
- Checkpoints: `nxd.save_checkpoint(dir, tag="step_<N>", model, optimizer, user_content,
  use_xser=True, num_kept_ckpts, async_save)`, `nxd.load_checkpoint(dir, tag=None, ...)` (newest
  complete), `nxd.has_checkpoint(dir)`, `nxd.finalize_checkpoint()` (trainer/checkpoint.py).
  NxD writes `<tag>/done` last (rank 0, after a rendezvous) and deletes `done` first when
  purging: the same completeness rule as hlat_api's layout, with `<dir>` = `<root>/<job>`.
  NxD's checkpoint format is its own: a checkpoint from one backend kind does not load in the
  other.

Nothing here ran: torch-xla for Neuron, torch-neuronx and neuronx-distributed are not on PyPI.
The Neuron packages are imported inside methods only, so this module imports anywhere; using
the backend without them raises `UserError` naming the package and the image to use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from hlat_trainer.backends.base import Backend, BackendName
from hlat_trainer.backends.neuron_import import require_neuron
from hlat_trainer.neuron_env import logical_nc_size

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import Tensor, nn

    from hlat_trainer.distributed import World

_NO_CLIP = 1e30
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

    def _max_norm(self) -> float:
        # clipping stays on so that the optimizer always computes the norm the loop logs;
        # gradClip 0 (off) becomes a bound no gradient reaches
        clip = self.spec.optimizer.grad_clip
        return clip if clip > 0 else _NO_CLIP

    def nxd_config(self) -> dict[str, Any]:
        """One NxD config shared by the model and the optimizer (it also initialises the TP/DP
        groups: parallel_state.initialize_model_parallel)."""
        if self._nxd_config is None:
            nxd = require_neuron("neuronx_distributed")
            p = self.spec.parallelism
            self._nxd_config = nxd.neuronx_distributed_config(
                tensor_parallel_size=p.tensor,
                pipeline_parallel_size=p.pipeline,
                optimizer_config={"zero_one_enabled": p.zero1, "grad_clipping": True,
                                  "max_grad_norm": self._max_norm()},
                sequence_parallel=p.sequence_parallel,
                activation_checkpoint_config=self._activation_checkpoint_config(),
                mixed_precision_config={"use_master_weights": False, "use_fp32_grad_acc": False,
                                        "use_master_weights_in_ckpt": False},
                # trn2 runs 2 physical cores per logical one by default (LNC=2); NxD does not
                # infer it and needs it to lay out replica groups (parallel_state.py)
                lnc_size=logical_nc_size(self.spec.instance_type),
            )
        return self._nxd_config

    def _activation_checkpoint_config(self) -> type[nn.Module] | None:
        from hlat_trainer.backends.nxd_model import CoreAttention, NxDDecoderLayer

        mode = self.spec.parallelism.activation_checkpointing
        # selective recompute of the attention core needs NEURON_CC_FLAGS -O1 (neuron_env.py)
        return {"none": None, "selective": CoreAttention, "full": NxDDecoderLayer}[mode]

    def build_model(self, device: torch.device) -> nn.Module:
        from hlat_trainer.backends.nxd_model import build_nxd_model
        from hlat_trainer.precision import precision_policy

        nxd = require_neuron("neuronx_distributed")
        s = self.spec
        dtype = precision_policy(s.precision).param_dtype
        # initialize_parallel_model(nxd_config, model_fn, include_buffers, *model_args): the
        # third positional is include_buffers (meta-device init only), then the model's args.
        # The layers are built in the parameter dtype: NxD's ParallelEmbedding picks its output
        # dtype from that argument, not from its weight (layers.py), so a cast afterwards would
        # leave the residual stream fp32 under tensor parallelism.
        model: nn.Module = nxd.initialize_parallel_model(
            self.nxd_config(), build_nxd_model, False, s.model.dims(),
            s.parallelism.sequence_parallel, s.train.seed, dtype)
        # bf16 / bf16-sr: parameters in bf16, rounding done by the runtime (env), not XLA_USE_BF16
        return precision_policy(s.precision).apply(model)

    def build_optimizer(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        import torch

        from hlat_trainer.precision import precision_policy

        nxd = require_neuron("neuronx_distributed")
        o = self.spec.optimizer
        extra: dict[str, Any] = {}
        if self.spec.parallelism.zero1:
            # NeuronZero1Optimizer (torch-xla's ZeroRedundancyOptimizer) takes neither the
            # config's max_grad_norm (it clips at 1.0 unless given max_norm) nor the parameter
            # dtype (it keeps master weights and moments in optimizer_dtype, fp32 by default):
            # both are passed here, where they reach it and not plain AdamW, which refuses them
            extra = {"max_norm": self._max_norm(),
                     "optimizer_dtype": precision_policy(self.spec.precision).param_dtype}
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
        nxd = require_neuron("neuronx_distributed")
        self.step_end()  # materialise pending device work before the host copies
        c = self.spec.checkpoint
        nxd.save_checkpoint(directory, tag=f"step_{step}", model=model, optimizer=optimizer,
                            user_content=user_content, use_xser=True, num_kept_ckpts=c.keep,
                            async_save=c.async_)

    def load_checkpoint(self, directory: str, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> None:
        # an explicit tag: the engine picks the checkpoint (newest complete, older ones when it
        # does not load) and reads its own per-rank loop state from the same directory
        nxd = require_neuron("neuronx_distributed")
        nxd.load_checkpoint(directory, tag=f"step_{step}", model=model, optimizer=optimizer)

    def finalize_checkpoint(self) -> None:
        require_neuron("neuronx_distributed").finalize_checkpoint()
