"""AdamW that keeps bf16 weights and rounds its updates stochastically (the paper's BF16 + SR).

Why: with bf16 weights, round-to-nearest drops every update smaller than half a bf16 step
(2^-9 relative, about 0.2%), so at a small learning rate the weights stop moving (the paper's
pure-BF16 run diverged). Stochastic rounding (SR) rounds up with probability equal to the
distance from the lower neighbour, so the *expected* stored weight equals the exact fp32
result and small updates accumulate. Trainium does this in hardware; here it is software.

Design choices and trade-offs:
- SR on the bit pattern (as pytorch/pytorch#120376 and torchao do): add a uniform random
  integer in [0, 2^16) to the fp32 bits viewed as int32, clear the low 16 bits, reinterpret as
  bf16. IEEE floats are sign-magnitude, so the carry rounds the *magnitude* up; negatives are
  unbiased too, and a carry out of the mantissa steps into the next binade correctly. Whole
  tensors at once; no per-element Python.
- Specials: NaN stays NaN (a NaN's low payload bits or a carry out of 0x7FFFFFFF, CUDA's NaN,
  would otherwise become inf or wrap to -0.0 and hide a divergence); +-inf stays +-inf; a
  finite value beyond bf16's range saturates to +-bf16 max instead of randomly becoming inf
  (a weight should not turn infinite because of rounding noise). On CPU the check is one
  min/max pass per bucket and the fix-up runs only where needed; on other devices the fix-up
  always runs, branch-free, to avoid a host sync per bucket.
- The math is fp32: bf16 weights, gradients and (optionally) moments are copied into fp32,
  updated with torch's own multi-tensor (`torch._foreach_*`) AdamW sequence, and written back
  with SR. The fp32 path is op for op torch.optim.AdamW(foreach=True) (bitwise equal on CPU).
- Buckets: tensors are cut into flat pieces and packed into buckets of at most `_CHUNK` (2^21)
  elements of one parameter dtype; each bucket is one set of foreach calls. The fp32 working
  copies live in reused scratch buffers of that size (28 MiB, 44 with bf16 moments; not an fp32
  copy of the model), because on CPU allocating fresh large buffers every step (page faults)
  costs more than the arithmetic. Parameters must therefore be contiguous (checked).
- Noise: 16 uniform bits per element, cut from 64-bit draws (a quarter of the generator
  calls of one draw per element). CPU's generator (mt19937) is serial, so on CPU AdamWSR's
  step costs about twice torch's fp32 foreach AdamW (more, unfused elementwise passes: the
  conversions and the rounding); on GPUs it is a few more memory-bound passes over 2-byte
  data, and a fused kernel would make it cheaper than fp32. See bench/bench_optimizer.py.
- `state_dtype` defaults to fp32 moments: 12 bytes per parameter (bf16 weight + bf16 grad +
  2 x fp32 moments) against 16 for fp32 master weights, and the moments, including the
  second moment whose small increments (1 - beta2 of it per step) bf16 would resolve only
  coarsely and whose square root sits in a denominator, match torch.optim.AdamW exactly. So
  SR noise is confined to the weights, which is what the SR-vs-nearest comparison is about.
  `state_dtype=torch.bfloat16` gives the paper's all-bf16 footprint (8 bytes per parameter,
  half of mixed precision), with both moments also rounded stochastically.
- fp32 parameters are accepted: they are updated in place with no rounding (plain foreach
  AdamW), so the trainer can use one optimizer for every mode. Other dtypes raise.
- Reproducible: one `torch.Generator` seeded with `seed` supplies all rounding noise, in a
  fixed order (bucket by bucket: weights, then moments). Its state is saved in `state_dict()`
  under `param_groups[0]["sr_generator_state"]` (inside param_groups because
  torch.distributed.checkpoint's optimizer helpers keep only "state" and "param_groups"), so
  a resumed run continues bit for bit. Under data parallelism with replicated weights every
  rank must use the same seed, so the replicas round identically and stay equal.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from hlat_trainer.precision import PRECISIONS

BF16_MAX = torch.finfo(torch.bfloat16).max
_HIGH16_MASK = -(1 << 16)  # 0xFFFF0000 as int32: keeps sign, exponent and bf16's 7 mantissa bits
_GENERATOR_KEY = "sr_generator_state"
_CHUNK = 1 << 21  # elements per bucket: the fp32 scratch buffers are this size (8 MiB each)
_SUPPORTED = (torch.float32, torch.bfloat16)


class _Scratch:
    """Reusable flat buffers. Allocating fresh large buffers every step costs more than the
    arithmetic on CPU (first-touch page faults), so working copies live here instead."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, dtype: torch.dtype, numel: int, device: torch.device) -> Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


def _sr_flat(src: Tensor, generator: torch.Generator, scratch: _Scratch) -> Tensor:
    """Stochastically rounded copy of flat fp32 `src`, as fp32 with the low 16 bits zero.

    The noise is 16 uniform bits per element, cut from 64-bit draws (a quarter of the calls
    into the generator), zero-extended into int32 and added to the bit pattern."""
    n, device = src.numel(), src.device
    words = scratch.get("words", torch.int64, (n + 3) // 4, device)
    words.random_(-(2**63), None, generator=generator)  # every one of the 64 bits uniform
    noise = scratch.get("noise", torch.int32, n, device)
    noise.copy_(words.view(torch.uint16)[:n])
    noise.add_(src.view(torch.int32)).bitwise_and_(_HIGH16_MASK)
    rounded = noise.view(torch.float32)
    if src.device.type != "cpu" or not _within_bf16_range(src):
        rounded = _fix_specials(src, rounded)  # off CPU branch-free: no host sync per bucket
    return rounded


def _fix_specials(src: Tensor, rounded: Tensor) -> Tensor:
    """NaN -> NaN, +-inf -> +-inf, finite beyond bf16 range -> +-BF16_MAX; the rest as rounded."""
    saturated = torch.where(torch.isinf(src), src, src.clamp(-BF16_MAX, BF16_MAX))
    return torch.where(src.abs() <= BF16_MAX, rounded, saturated)


def _within_bf16_range(src: Tensor) -> bool:
    """All values finite and within +-BF16_MAX (NaN fails): one min/max pass, one host sync."""
    if src.numel() == 0:
        return True
    lo, hi = torch.aminmax(src)
    return bool((lo >= -BF16_MAX) & (hi <= BF16_MAX))


def _check_fp32(src: Tensor) -> None:
    if src.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes a float32 source, got {src.dtype}")


def stochastic_round_bf16(src_fp32: Tensor, generator: torch.Generator) -> Tensor:
    """Round fp32 `src_fp32` to bf16 stochastically (unbiased); a new tensor of the same shape.

    Each value becomes one of its two bf16 neighbours, the upper one (in magnitude) with
    probability equal to its distance from the lower one in units of the bf16 step. NaN and
    +-inf pass through; finite values beyond bf16's range saturate at +-BF16_MAX.
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
    rounded = _sr_flat(src_fp32.contiguous().view(-1), generator, _Scratch())
    dst.copy_(rounded.view(src_fp32.shape))  # exact: the low 16 bits are zero
    return dst


def _pack(numels: Sequence[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """Split tensors into pieces of at most `limit` elements and pack consecutive pieces into
    buckets of at most `limit`: lists of (tensor index, start, end) in flat element offsets."""
    buckets: list[list[tuple[int, int, int]]] = [[]]
    total = 0
    for i, n in enumerate(numels):
        for start in range(0, n, limit):
            end = min(start + limit, n)
            if total + end - start > limit:
                buckets.append([])
                total = 0
            buckets[-1].append((i, start, end))
            total += end - start
    return [b for b in buckets if b]


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
        self._scratch = _Scratch()
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        device = self.param_groups[0]["params"][0].device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    @property
    def generator(self) -> torch.Generator:
        """The stochastic-rounding noise source (saved with the optimizer's state)."""
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
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = self._gather(group)
        if not params:
            return
        torch._foreach_add_(steps, 1.0)
        step_values = [float(s.item()) for s in steps]
        tensors = (params, grads, exp_avgs, exp_avg_sqs)
        for dtype in _SUPPORTED:  # buckets of one parameter dtype, in a fixed order
            idx = [i for i, p in enumerate(params) if p.dtype == dtype]
            for bucket in _pack([params[i].numel() for i in idx], _CHUNK):
                pieces = [(idx[j], start, end) for j, start, end in bucket]
                self._update_bucket(group, pieces, tensors, step_values)

    def _gather(self, group: dict[str, Any]) -> tuple[list[Tensor], ...]:
        """Parameters with a gradient, their gradients, moments and step counters (lazy init)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamWSR does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
            params.append(p)
            grads.append(p.grad.contiguous())
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return params, grads, exp_avgs, exp_avg_sqs, steps

    def _update_bucket(self, group: dict[str, Any], pieces: list[tuple[int, int, int]],
                       tensors: tuple[list[Tensor], ...], step_values: list[float]) -> None:
        """torch's multi-tensor AdamW on fp32 working pieces, then SR back where bf16."""
        lr, eps, weight_decay = float(group["lr"]), group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        params, grads, exp_avgs, exp_avg_sqs = (
            [t[i].view(-1)[start:end] for i, start, end in pieces] for t in tensors)
        steps = [step_values[i] for i, _, _ in pieces]
        p32, g32 = self._working("p", params), self._working("g", grads)
        m32, v32 = self._working("m", exp_avgs), self._working("v", exp_avg_sqs)
        if weight_decay != 0:
            torch._foreach_mul_(p32, 1 - lr * weight_decay)
        torch._foreach_lerp_(m32, g32, 1 - beta1)
        torch._foreach_mul_(v32, beta2)
        torch._foreach_addcmul_(v32, g32, g32, 1 - beta2)
        step_size = [(lr / (1 - beta1**s)) * -1 for s in steps]
        bias_correction2_sqrt = [(1 - beta2**s) ** 0.5 for s in steps]
        denom = torch._foreach_sqrt(v32)  # pieces <= _CHUNK: small reused heap blocks
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(p32, m32, denom, step_size)
        for name, dsts in (("p", params), ("m", exp_avgs), ("v", exp_avg_sqs)):
            if dsts[0].dtype == torch.bfloat16:  # one dtype per bucket: its fp32 copy is flat
                self._round_back(name, dsts)

    def _working(self, name: str, pieces: list[Tensor]) -> list[Tensor]:
        """fp32 pieces themselves (updated in place), else fp32 copies in flat scratch `name`."""
        if all(t.dtype == torch.float32 for t in pieces):
            return pieces
        views = self._scratch_views(name, pieces)
        torch._foreach_copy_(views, pieces)
        return views

    def _scratch_views(self, name: str, like: list[Tensor]) -> list[Tensor]:
        sizes = [t.numel() for t in like]
        flat = self._scratch.get(name, torch.float32, sum(sizes), like[0].device)
        return list(torch.split(flat, sizes))

    def _round_back(self, name: str, dsts: list[Tensor]) -> None:
        """SR the flat fp32 scratch `name` (the updated pieces, in order) into bf16 `dsts`."""
        assert self._generator is not None
        sizes = [t.numel() for t in dsts]
        flat = self._scratch.get(name, torch.float32, sum(sizes), dsts[0].device)
        rounded = _sr_flat(flat, self._generator, self._scratch)
        torch._foreach_copy_(dsts, list(torch.split(rounded, sizes)))  # exact: low 16 bits are zero

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
