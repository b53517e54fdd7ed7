"""AdamW that keeps bf16 weights and rounds its updates stochastically (the paper's BF16 + SR).

Why: with bf16 weights, round-to-nearest drops every update smaller than half a bf16 step
(2^-9 relative, about 0.2%), so at a small learning rate the weights stop moving (the paper's
pure-BF16 run diverged). Stochastic rounding (SR) rounds up with probability equal to the
distance from the lower neighbour, so the *expected* stored weight equals the exact fp32
result and small updates accumulate. Trainium does this in hardware; here it is software.

Design choices and trade-offs:
- SR on the bit pattern (as pytorch/pytorch#120376 and torchao do): add a uniform random
  integer in [0, 2^16) to the fp32 bits, clear the low 16 bits, reinterpret as bf16. IEEE
  floats are sign-magnitude, so the carry rounds the *magnitude* up; negatives are unbiased
  too, and a carry out of the mantissa steps into the next binade correctly.
- Specials: NaN stays NaN (a NaN's low payload bits, or a carry, would otherwise become inf
  and hide a divergence); +-inf stays +-inf; a finite value beyond bf16's range saturates to
  +-bf16 max instead of randomly becoming inf (a weight should not turn infinite because of
  rounding noise).
- One pass per tensor: `hlat_trainer.sr_kernel` reads weight, gradient and moments, does the
  AdamW update in fp32 and writes back with SR, in a C++ loop compiled at first use (a
  pure-torch path with bit-identical results where no compiler is present, off the CPU, or
  under HLAT_SR_KERNEL=torch). No fp32 copy of the model, no scratch buffers. On CPU it is
  faster than torch's foreach AdamW on fp32 master weights (bench/bench_optimizer.py).
- Counter-based noise: the 16 random bits of element i of tensor t are a hash of
  (step key, t, stream, i) (MurmurHash3's finaliser keyed by SplitMix64 outputs; see
  sr_kernel), so they do not depend on threads, chunking or the order of work. The step key
  is one 64-bit draw per `step()` from a `torch.Generator` seeded with `seed`; t is the
  parameter's position in the optimizer (over all param groups); the streams are weights,
  first and second moment.
- `state_dtype` defaults to fp32 moments: 12 bytes per parameter (bf16 weight + bf16 grad +
  2 x fp32 moments) against 16 for fp32 master weights, and the moments, including the
  second moment whose small increments (1 - beta2 of it per step) bf16 would resolve only
  coarsely and whose square root sits in a denominator, stay exact AdamW moments. So SR noise
  is confined to the weights, which is what the SR-vs-nearest comparison is about.
  `state_dtype=torch.bfloat16` gives the paper's all-bf16 footprint (8 bytes per parameter,
  half of mixed precision), with both moments also rounded stochastically.
- fp32 parameters are accepted: updated in place with no rounding (the same update, within
  an ulp or so per step of torch.optim.AdamW: no FMA, a reciprocal multiply for the bias
  correction), so the trainer can use one optimizer for every mode. Other dtypes raise.
- Reproducible: all the noise of a step follows from the generator's state before it, which
  `state_dict()` saves under `param_groups[0]["sr_generator_state"]` (inside param_groups
  because torch.distributed.checkpoint's optimizer helpers keep only "state" and
  "param_groups"), so a resumed run continues bit for bit. Under data parallelism with
  replicated weights every rank must use the same seed, so the replicas round identically and
  stay equal.
"""

from __future__ import annotations

import math
import warnings
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from hlat_trainer import sr_kernel
from hlat_trainer.precision import PRECISIONS

BF16_MAX = torch.finfo(torch.bfloat16).max
_GENERATOR_KEY = "sr_generator_state"
_SUPPORTED = (torch.float32, torch.bfloat16)


def draw_key(generator: torch.Generator) -> int:
    """One uniform 64-bit key (as an unsigned Python int) from `generator`: a step's noise."""
    word = torch.empty((), dtype=torch.int64, device=generator.device)
    word.random_(-(2**63), None, generator=generator)  # every one of the 64 bits uniform
    return int(word.item()) & ((1 << 64) - 1)


def _check_fp32(src: Tensor) -> None:
    if src.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes a float32 source, got {src.dtype}")


def stochastic_round_bf16(src_fp32: Tensor, generator: torch.Generator) -> Tensor:
    """Round fp32 `src_fp32` to bf16 stochastically (unbiased); a new tensor of the same shape.

    Each value becomes one of its two bf16 neighbours, the upper one (in magnitude) with
    probability equal to its distance from the lower one in units of the bf16 step. NaN and
    +-inf pass through; finite values beyond bf16's range saturate at +-BF16_MAX. The noise
    is the counter-based stream of one 64-bit key drawn from `generator`.
    """
    _check_fp32(src_fp32)
    out = torch.empty(src_fp32.shape, dtype=torch.bfloat16, device=src_fp32.device)
    return stochastic_round_bf16_(out, src_fp32, generator)


def stochastic_round_bf16_(dst: Tensor, src_fp32: Tensor, generator: torch.Generator) -> Tensor:
    """In-place variant: write the stochastic rounding of `src_fp32` into bf16 `dst`; returns dst."""
    _check_fp32(src_fp32)
    if dst.dtype != torch.bfloat16 or dst.shape != src_fp32.shape:
        raise TypeError(f"dst must be bf16 of shape {tuple(src_fp32.shape)}, got {dst.dtype} "
                        f"{tuple(dst.shape)}")
    flat = torch.empty(src_fp32.numel(), dtype=torch.bfloat16, device=src_fp32.device)
    sr_kernel.sr_bf16_(flat, src_fp32.contiguous().view(-1), draw_key(generator))
    dst.copy_(flat.view(src_fp32.shape))
    return dst


class AdamWSR(torch.optim.Optimizer):
    """torch.optim.AdamW semantics (decoupled weight decay, bias correction) for bf16 weights,
    fp32 math, stochastically rounded write-back; fp32 weights are updated without rounding.

    Args: as torch.optim.AdamW (lr, betas, eps, weight_decay, maximize=False only), plus
    `seed` for the rounding noise and `state_dtype` for the moments (float32 or bfloat16).
    `group["lr"]` may be changed between steps (LR schedulers do).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        seed: int,
        state_dtype: torch.dtype = torch.float32,
        maximize: bool = False,
    ) -> None:
        _validate_hyper(lr, betas, eps, weight_decay, maximize, state_dtype)
        self.state_dtype = state_dtype
        self._generator: torch.Generator | None = None
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        device = self.param_groups[0]["params"][0].device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    @property
    def generator(self) -> torch.Generator:
        """The source of each step's noise key (saved with the optimizer's state)."""
        assert self._generator is not None
        return self._generator

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        params: list[Tensor] = self.param_groups[-1]["params"]
        device = self._generator.device if self._generator is not None else params[0].device
        for p in params:
            if p.dtype not in _SUPPORTED:
                raise TypeError(f"AdamWSR updates float32 or bfloat16 parameters, got {p.dtype}")
            if not p.is_contiguous():
                raise ValueError("AdamWSR updates contiguous parameters (it works on flat views)")
            if p.device != device:
                raise ValueError(f"AdamWSR keeps one generator: parameters on {p.device} and "
                                 f"{device}; use one optimizer per device")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step_key = draw_key(self.generator)
        updates: list[sr_kernel.Update] = []
        index = 0  # the parameter's position over all groups: its tensor index in the noise
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    updates.append(self._update(group, p, p.grad, step_key, index))
                index += 1
        if updates:
            sr_kernel.adamw_(updates)
        return loss

    def _update(self, group: dict[str, Any], p: Tensor, grad: Tensor, step_key: int,
                index: int) -> sr_kernel.Update:
        """Parameter p's update this step (its state initialised lazily, its step counted)."""
        if grad.is_sparse:
            raise RuntimeError("AdamWSR does not support sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        if not (state["exp_avg"].dtype == state["exp_avg_sq"].dtype in _SUPPORTED
                and state["exp_avg"].is_contiguous() and state["exp_avg_sq"].is_contiguous()):
            raise ValueError("AdamWSR's moments must be contiguous, both float32 or bfloat16")
        state["step"] += 1
        step = float(state["step"])
        if grad.dtype not in _SUPPORTED:
            grad = grad.to(p.dtype)
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        return sr_kernel.Update(
            param=p, grad=grad.contiguous(), exp_avg=state["exp_avg"],
            exp_avg_sq=state["exp_avg_sq"],
            keys=(sr_kernel.stream_key(step_key, index, 0),  # weights, first, second moment
                  sr_kernel.stream_key(step_key, index, 1),
                  sr_kernel.stream_key(step_key, index, 2)),
            decay=1 - lr * wd, w1=1 - beta1, beta2=beta2, c2=1 - beta2,
            inv_bc2=1 / math.sqrt(1 - beta2**step), eps=float(group["eps"]),
            step_size=(lr / (1 - beta1**step)) * -1)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus the rounding generator's state in param_groups[0]."""
        state_dict = super().state_dict()
        assert self._generator is not None
        state_dict["param_groups"][0][_GENERATOR_KEY] = self._generator.get_state()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load through torch's machinery, then undo its cast of the moments to the parameter
        dtype (it would round fp32 moments of bf16 weights to bf16) and restore the generator."""
        saved_groups = state_dict["param_groups"]
        generator_state = next((g[_GENERATOR_KEY] for g in saved_groups if _GENERATOR_KEY in g),
                               None)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.pop(_GENERATOR_KEY, None)
        saved_ids = chain.from_iterable(g["params"] for g in saved_groups)
        live = chain.from_iterable(g["params"] for g in self.param_groups)
        for param_id, p in zip(saved_ids, live, strict=True):
            if param_id in state_dict["state"]:
                self._restore_param_state(p, state_dict["state"][param_id])
        assert self._generator is not None
        if generator_state is None:
            warnings.warn("optimizer state has no stochastic-rounding generator state (not "
                          "saved by AdamWSR?): keeping the current generator", stacklevel=2)
        else:
            self._generator.set_state(generator_state.to("cpu", torch.uint8))

    def _restore_param_state(self, p: Tensor, saved: dict[str, Any]) -> None:
        state = self.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            value = saved[key].to(device=p.device, dtype=self.state_dtype, copy=True)
            state[key] = value.contiguous()
        step = saved["step"]
        state["step"] = (step.detach().to("cpu", torch.float32, copy=True)
                         if isinstance(step, Tensor) else torch.tensor(float(step)))


def _validate_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                    maximize: bool, state_dtype: torch.dtype) -> None:
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate {lr}: must be >= 0")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps {eps}: must be >= 0")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
    if not weight_decay >= 0.0:
        raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
    if maximize:
        raise ValueError("AdamWSR supports maximize=False only")
    if state_dtype not in _SUPPORTED:
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")


def build_optimizer(
    params: ParamsT,
    *,
    precision: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    seed: int,
    state_dtype: torch.dtype = torch.float32,
) -> torch.optim.Optimizer:
    """The optimizer for a precision mode: AdamWSR for "bf16-sr", torch's foreach AdamW otherwise.

    For "bf16" the parameters are bf16, so torch's AdamW rounds each update to nearest: the
    baseline that SR is compared with. `seed` and `state_dtype` matter only for "bf16-sr".
    """
    if precision == "bf16-sr":
        return AdamWSR(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                       seed=seed, state_dtype=state_dtype)
    if precision in PRECISIONS:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay, foreach=True)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
