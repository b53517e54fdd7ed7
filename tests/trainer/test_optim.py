"""Stochastic rounding and AdamWSR: unbiased, reproducible, AdamW-exact in fp32, and it matters."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import Tensor

from hlat_trainer import sr_kernel
from hlat_trainer.optim import (
    BF16_MAX,
    AdamWSR,
    build_optimizer,
    stochastic_round_bf16,
    stochastic_round_bf16_,
)

MASK = -(1 << 16)  # 0xFFFF0000 as int32
SIGMAS = 5.0  # statistical bounds: a false failure has probability ~6e-7 per check
BACKENDS = ["cpp", "torch"]  # the fused C++ kernel and the pure-torch path (fallback)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on each path of sr_kernel; the C++ one must load on a machine with g++."""
    if request.param == "torch":
        monkeypatch.setenv(sr_kernel.ENV_BACKEND, "torch")
    else:
        monkeypatch.delenv(sr_kernel.ENV_BACKEND, raising=False)
        assert sr_kernel.load() is not None, "the C++ kernel did not build"
    return str(request.param)


def _bits(x: Tensor) -> Tensor:
    return x.view(torch.int32)


def _neighbours(x32: Tensor) -> tuple[Tensor, Tensor]:
    """The bf16 values below and above x in magnitude (as fp32); equal-ish when exact."""
    low = _bits(x32) & MASK
    return low.view(torch.float32), (low + (1 << 16)).view(torch.float32)


def _from_bits(values: list[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


# A bf16 value (upper 16 bits) and where between it and the next one (low 16 bits, /65536).
BASES = {
    "1.0": 0x3F800000,
    "-1.0": 0xBF800000,
    "binade top 1.99": 0x3FFF0000,  # rounding up crosses into [2, 4)
    "-binade top": 0xBFFF0000,
    "3e-3": 0x3B440000,
    "-300": 0xC3960000,
    "1e20": 0x60AD0000,
    "subnormal": 0x00050000,
}
FRACTIONS = [0x1999, 0x5EB8, 0x8000, 0xE666]  # about 0.1, 0.37, 0.5, 0.9 of a bf16 step


@pytest.mark.parametrize("base", list(BASES))
def test_sr_is_unbiased_and_lands_on_a_neighbour(base: str, backend: str) -> None:
    n = 100_000
    x = _from_bits([BASES[base] + f for f in FRACTIONS])
    lo, hi = _neighbours(x)
    samples = stochastic_round_bf16(x.repeat(n, 1), torch.Generator().manual_seed(7)).float()

    is_lo, is_hi = samples == lo, samples == hi
    assert bool((is_lo | is_hi).all()), "every rounding is one of the two bf16 neighbours"
    p = torch.tensor(FRACTIONS, dtype=torch.float64) / 65536  # exact probability of rounding up
    p_hat = is_hi.double().mean(0)
    # mean of n Bernoulli(p) draws: standard error sqrt(p(1-p)/n); mean(value) - x = (p_hat - p) * step
    bound = SIGMAS * torch.sqrt(p * (1 - p) / n)
    assert bool(((p_hat - p).abs() <= bound).all()), (p_hat, p)
    step = (hi.double() - lo.double()).abs()
    sr_bias = (samples.double().mean(0) - x.double()).abs() / step
    nearest_bias = (x.to(torch.bfloat16).double() - x.double()).abs() / step
    assert bool((sr_bias <= bound).all())
    assert bool((nearest_bias >= 10 * bound).all()), "round-to-nearest is biased by >= 0.1 step"


def test_representable_values_and_specials(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    exact = torch.randn(10_000).to(torch.bfloat16)
    assert torch.equal(stochastic_round_bf16(exact.float(), gen), exact), "exact values stay"

    nans = _from_bits([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001])
    infs = torch.tensor([math.inf, -math.inf])
    too_big = torch.tensor([torch.finfo(torch.float32).max, -3.3961e38])  # finite, > bf16 max
    edge = torch.tensor([BF16_MAX, -BF16_MAX, 0.0, -0.0])
    for _ in range(20):  # random noise: several draws
        assert bool(stochastic_round_bf16(nans.repeat(50), gen).isnan().all())
        assert torch.equal(stochastic_round_bf16(infs, gen).float(), infs)
        assert torch.equal(stochastic_round_bf16(too_big, gen).float(),
                           torch.tensor([BF16_MAX, -BF16_MAX]))
        out = stochastic_round_bf16(edge, gen).float()
        assert torch.equal(out, edge) and torch.equal(out.signbit(), edge.signbit())


def test_in_place_variant_and_input_checks() -> None:
    src = torch.randn(3, 5).t()  # non-contiguous
    dst = torch.empty(5, 3, dtype=torch.bfloat16)
    assert stochastic_round_bf16_(dst, src, torch.Generator().manual_seed(1)) is dst
    assert torch.equal(dst, stochastic_round_bf16(src, torch.Generator().manual_seed(1)))
    lo, hi = _neighbours(src.contiguous())
    assert bool(((dst.float() == lo) | (dst.float() == hi)).all())
    with pytest.raises(TypeError, match="float32 source"):
        stochastic_round_bf16(src.double(), torch.Generator())
    with pytest.raises(TypeError, match="dst must be bf16"):
        stochastic_round_bf16_(torch.empty(5, 3), src, torch.Generator())


# ---------------------------------------------------------------- the optimizer


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (17,), (8, 8, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """Deterministic gradients that depend on the weights (so trajectories can diverge)."""
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(1000 * step + i)
        noise = torch.randn(p.shape, generator=gen)
        p.grad = (0.3 * p.detach().float() + 0.05 * noise).to(p.dtype)


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        _set_grads(params, step)
        opt.step()


def _sr(params: list[torch.nn.Parameter], seed: int = 0, **kw: object) -> AdamWSR:
    return AdamWSR(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, seed=seed,
                   **kw)  # type: ignore[arg-type]


def test_same_seed_same_result_different_seed_differs(backend: str) -> None:
    runs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        params = _params(torch.bfloat16)
        _run(_sr(params, seed=seed), params, range(1, 6))
        runs[name] = params
    assert all(torch.equal(a, b) for a, b in zip(runs["a"], runs["b"], strict=True))
    assert not all(torch.equal(a, c) for a, c in zip(runs["a"], runs["c"], strict=True))


def test_each_tensor_and_step_has_its_own_noise(backend: str) -> None:
    """Two equal parameters with equal gradients in one optimizer round apart (the tensor's
    index is in the noise), and so does one parameter over two equal steps."""
    x = torch.randn(4096).to(torch.bfloat16)
    twins = [torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())]
    opt = _sr(twins)
    for p in twins:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    assert not torch.equal(twins[0], twins[1])
    from_a, from_b = opt.state[twins[0]]["exp_avg"], opt.state[twins[1]]["exp_avg"]
    assert torch.equal(from_a, from_b), "the same update, rounded differently"
    noise = [stochastic_round_bf16(torch.full((4096,), 1 + 2**-9), gen)
             for gen in [torch.Generator().manual_seed(0)] * 2]
    assert not torch.equal(*noise), "two draws from one generator: two different streams"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_bit_for_bit(state_dtype: torch.dtype,
                                                     backend: str) -> None:
    params = _params(torch.bfloat16) + _params(torch.float32, seed=1)[:1]  # fp32 ones too
    opt = _sr(params, state_dtype=state_dtype)
    _run(opt, params, range(1, 4))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buffer)
    _run(opt, params, range(4, 9))  # the uninterrupted run

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = [torch.nn.Parameter(p) for p in saved["params"]]
    opt2 = _sr(resumed, seed=999, state_dtype=state_dtype)  # the saved generator state wins
    opt2.load_state_dict(saved["opt"])
    assert "sr_generator_state" not in opt2.param_groups[0]
    _run(opt2, resumed, range(4, 9))

    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)
        sa, sb = opt.state[a], opt2.state[b]
        assert sb["exp_avg"].dtype == state_dtype, "load must not cast moments to the param dtype"
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
        assert float(sb["step"]) == 8.0


@pytest.mark.parametrize(("before", "after"), [("cpp", "torch"), ("torch", "cpp")])
def test_resume_on_the_other_path_continues_bit_for_bit(
    before: str, after: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint from a machine with the C++ kernel resumes on one without (and back):
    the weights after the resumed steps equal those of an uninterrupted run on either path."""
    def use(path: str) -> None:
        monkeypatch.setenv(sr_kernel.ENV_BACKEND, "torch" if path == "torch" else "")

    params = _params(torch.bfloat16)
    use(before)
    opt = _sr(params, state_dtype=torch.bfloat16)
    _run(opt, params, range(1, 4))
    saved = {"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}
    saved = torch.load(_saved(saved))
    _run(opt, params, range(4, 7))  # uninterrupted, on the first path

    use(after)
    resumed = [torch.nn.Parameter(p) for p in saved["params"]]
    opt2 = _sr(resumed, seed=999, state_dtype=torch.bfloat16)
    opt2.load_state_dict(saved["opt"])
    _run(opt2, resumed, range(4, 7))
    assert all(torch.equal(a, b) for a, b in zip(params, resumed, strict=True))


def _saved(obj: object) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_matches_torch_adamw_on_fp32_params(backend: str) -> None:
    ours, theirs = _params(torch.float32), _params(torch.float32)
    opt = _sr(ours)
    ref = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=True)
    for step in range(1, 6):
        for group in (*opt.param_groups, *ref.param_groups):
            group["lr"] = 1e-2 / step  # as a scheduler would
        _set_grads(ours, step)
        _set_grads(theirs, step)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        # the same update; torch's kernels use FMA and a rounded reciprocal: an ulp or so apart
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"],
                                   rtol=1e-6, atol=1e-12)


def test_bf16_update_is_a_rounding_of_the_exact_adamw_update(backend: str) -> None:
    """From the same bf16 weights and grads, each new weight is a bf16 neighbour of what
    torch.optim.AdamW computes on fp32 copies (the two fp32 computations may differ by the
    rounding of their operands), unbiased on average, the first moment identical."""
    torch.manual_seed(20261126)
    ours = [torch.nn.Parameter(torch.randn(256, 256).to(torch.bfloat16))]
    before = ours[0].detach().float()
    theirs = [torch.nn.Parameter(before.clone())]
    ours[0].grad = torch.randn(256, 256).to(torch.bfloat16)
    theirs[0].grad = ours[0].grad.float()
    lr = 1e-2
    opt, ref = _sr(ours), torch.optim.AdamW(theirs, lr=lr, betas=(0.9, 0.95),
                                            weight_decay=0.1, foreach=True)
    opt.step()
    ref.step()
    exact = theirs[0].detach()
    lo, hi = _neighbours(exact)
    got = ours[0].detach().float()
    # Where lr * update nearly cancels the weight, the result is tiny and an ulp of the operands
    # (the weight, lr * update ~ lr) is many ulps of it: the two fp32 computations may differ by
    # that much. So: got is a bf16 value at most a bf16 step from exact, give or take 2 ulps
    # of the operands (measured: at most 0.4 of them over 400 random draws).
    operand_ulps = 2 * torch.finfo(torch.float32).eps * (before.abs() + lr)
    step = (hi - lo).abs()
    assert bool(((got - exact).abs() <= step + operand_ulps).all())
    rel_err = ((got - exact) / step).double()
    assert abs(rel_err.mean().item()) <= SIGMAS * 0.5 / math.sqrt(rel_err.numel())
    assert torch.equal(opt.state[ours[0]]["exp_avg"], ref.state[theirs[0]]["exp_avg"])


def test_lr_is_read_each_step_and_grad_none_is_skipped() -> None:
    params = _params(torch.bfloat16)
    before = [p.detach().clone() for p in params]
    opt = _sr(params)
    _set_grads(params, 1)
    params[1].grad = None
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert params[1] not in opt.state
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()
    assert not torch.equal(params[0], before[0]) and torch.equal(params[1], before[1])


def test_rejects_what_it_cannot_do() -> None:
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        AdamWSR([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))], seed=0)
    with pytest.raises(ValueError, match="maximize"):
        AdamWSR(_params(torch.bfloat16), seed=0, maximize=True)
    with pytest.raises(ValueError, match="state_dtype"):
        AdamWSR(_params(torch.bfloat16), seed=0, state_dtype=torch.float16)
    p = torch.nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        AdamWSR([p], seed=0).step()


@pytest.mark.parametrize(("precision", "kind"), [
    ("fp32", torch.optim.AdamW), ("mixed", torch.optim.AdamW), ("bf16", torch.optim.AdamW),
    ("bf16-sr", AdamWSR),
])
def test_build_optimizer(precision: str, kind: type) -> None:
    opt = build_optimizer(_params(torch.bfloat16), precision=precision, lr=3e-4,
                          betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, seed=0)
    assert type(opt) is kind and opt.param_groups[0]["betas"] == (0.9, 0.95)
    if kind is torch.optim.AdamW:
        assert opt.param_groups[0]["foreach"] is True


def test_build_optimizer_rejects_unknown_precision() -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        build_optimizer(_params(torch.float32), precision="fp16", lr=1e-3, betas=(0.9, 0.95),
                        eps=1e-8, weight_decay=0.0, seed=0)


# ---------------------------------------------------------------- SR matters


def _fit(precision: str, state_dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """Least squares toward target weights of magnitude in [1, 2), where a bf16 step is 2^-7:
    Adam moves a weight by at most about lr = 1e-3 per step, under half a bf16 step, so
    round-to-nearest never moves it. Returns (initial, final) loss."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    sign = torch.randint(0, 2, (16, 16), generator=gen) * 2 - 1
    target = sign * (1.125 + 0.75 * torch.rand(16, 16, generator=gen))
    start = (target + 0.2 * torch.rand(16, 16, generator=gen) - 0.1).to(torch.bfloat16)
    y = x @ target.T
    w = torch.nn.Parameter(start.float() if precision == "fp32" else start.clone())
    opt = build_optimizer([w], precision=precision, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                          weight_decay=0.0, seed=0, state_dtype=state_dtype)
    losses = []
    for _ in range(400):
        loss = ((x @ w.float().T - y) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses[0], losses[-1]


def test_sr_tracks_fp32_where_round_to_nearest_stalls() -> None:
    initial, fp32 = _fit("fp32")
    _, nearest = _fit("bf16")
    _, sr = _fit("bf16-sr")
    _, sr_bf16_state = _fit("bf16-sr", torch.bfloat16)
    # fp32 and SR both remove > 98% of the loss and end within 2% of the initial loss of each
    # other; SR's floor is its bf16 grid (about 1e-5 per weight squared), far below that
    assert fp32 < 0.02 * initial
    for final in (sr, sr_bf16_state):
        assert abs(final - fp32) < 0.02 * initial, (initial, fp32, final)
    assert nearest > 0.99 * initial, "bf16 round-to-nearest drops every update here"
