"""neuronx-distributed's optimizer and checkpoint entry points at one rank, for the xla tier.

NxD is not installable here; torch-xla is, and with it the ZeRO-1 optimizer NxD's
NeuronZero1Optimizer subclasses. So the optimizer is the real thing and only NxD's glue around
it is replayed, each piece from aws-neuron/neuronx-distributed at fbac349 ("Release 2.29"):

- `initialize_parallel_optimizer`: trainer/trainer.py 243-315 (initialize_optimizer_from_class):
  under ZeRO-1, torch-xla's `ZeroRedundancyOptimizer` (NeuronZero1Optimizer only adds DP
  sharding groups and its own norm helper: optimizer/zero_redundancy_optimizer.py 30-104) with
  the keywords NxD adds: grad_clipping, pin_layout=False, the DP and TP replica groups ([[0]] at
  one rank), the bucket caps (130 MB, / dp for the all-gather), `use_grad_acc_hook` and
  `higher_cc_precision` when `use_fp32_grad_acc`, `save_master_weights` from
  `use_master_weights_in_ckpt`; it refuses master weights without ZeRO-1 (304-309). Without
  ZeRO-1, AdamW behind NxDOptimizer's clip (trainer/optimizer.py 122-147).
- `save_checkpoint`: checkpoint.py 654-824: the optimizer's `state_dict()` (master weights
  included when the optimizer saves them), then the model's, then user content; `done` last.
- `load_checkpoint`: checkpoint.py 838-967, in its order and with its side effects: the
  OPTIMIZER first (894-937: `load_state_dict`, which for ZeRO-1 re-shards the parameters as they
  are at that moment: torch-xla zero_redundancy_optimizer.py 512-548), and if its state holds
  `sharded_master_weights` the model's tensors are then skipped (917-919, 625-626); the MODEL
  after (939-951, `load_state_dict(strict=True)`); the saved user content returned.
Files are torch.save'd per rank under `<dir>/<tag>/` (NxD's own layout and xser format differ;
nothing here depends on them).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

_BUCKET_CAP_MB = 130  # trainer.py 260; dp 1 here, so the all-gather's cap is the same


class ClippingAdamW(torch.optim.AdamW):
    """AdamW behind NxDOptimizer without ZeRO-1: clips the global norm and exposes it."""

    def __init__(self, params: Any, *, max_norm: float, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.max_norm = max_norm
        self.grad_norm: Tensor | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        return super().step(closure)


def neuronx_distributed_config(**kwargs: Any) -> dict[str, Any]:
    return dict(kwargs)


def initialize_parallel_optimizer(nxd_config: dict[str, Any], optimizer_class: Any,
                                  parameters: Any, **defaults: Any) -> torch.optim.Optimizer:
    opt, mp = nxd_config["optimizer_config"], nxd_config["mixed_precision_config"]
    if not opt["zero_one_enabled"]:
        if any(mp.values()):
            raise RuntimeError("NxD: master weights / fp32 grad acc need ZeRO-1 (trainer.py 304)")
        return ClippingAdamW(parameters, max_norm=opt["max_grad_norm"], **defaults)
    configs: dict[str, Any] = {
        "grad_clipping": opt["grad_clipping"], "pin_layout": False,
        "sharding_groups": [[0]], "grad_norm_groups": [[0]],
        "bucket_cap_mb_all_gather": _BUCKET_CAP_MB, "bucket_cap_mb_reduce_scatter": _BUCKET_CAP_MB,
        "save_master_weights": bool(mp["use_master_weights_in_ckpt"]),
    }
    if mp["use_fp32_grad_acc"]:
        configs.update(use_grad_acc_hook=True, higher_cc_precision=True)
    return ZeroRedundancyOptimizer(parameters, optimizer_class, **configs, **defaults)


def _host(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_host(v) for v in obj]
    return obj


def shard_path(directory: str, tag: str, part: str) -> Path:
    return Path(directory) / tag / part / f"rank_{dist.get_rank():05d}.pt"


def save_checkpoint(checkpoint_dir_str: str, tag: str, model: nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None,
                    user_content: Any = None, **_: Any) -> None:
    for part, obj in (("optim", optimizer), ("model", model)):  # NxD's order
        if obj is not None:
            path = shard_path(checkpoint_dir_str, tag, part)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(_host(obj.state_dict()), path)
    if user_content is not None and dist.get_rank() == 0:
        torch.save(user_content, Path(checkpoint_dir_str) / tag / "user_content.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(checkpoint_dir_str) / tag / "done").write_text("1")


def load_checkpoint(path: str, tag: str | None = None, model: nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, **_: Any) -> Any:
    assert tag is not None, "the backend always names its tag"
    ignore_model_tensors = False
    if optimizer is not None:  # first, as checkpoint.py 894-937
        state = torch.load(shard_path(path, tag, "optim"), weights_only=False)
        ignore_model_tensors = "sharded_master_weights" in state  # 917-919
        optimizer.load_state_dict(state)
    if model is not None and not ignore_model_tensors:  # then the model, 939-951
        model.load_state_dict(torch.load(shard_path(path, tag, "model"), weights_only=True),
                              strict=True)
    content = Path(path) / tag / "user_content.pt"
    dist.barrier()  # xm.rendezvous("load all checkpoints done")
    return torch.load(content, weights_only=True) if content.is_file() else None


def finalize_checkpoint() -> None:
    return None  # saves are synchronous here


def module() -> types.ModuleType:
    """What `NeuronXlaBackend.nxd()` returns in the xla tier."""
    mod = types.ModuleType("neuronx_distributed (xla-tier stand-in)")
    for fn in (neuronx_distributed_config, initialize_parallel_optimizer, save_checkpoint,
               load_checkpoint, finalize_checkpoint):
        setattr(mod, fn.__name__, fn)
    return mod
