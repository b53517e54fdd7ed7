"""The fused AdamW-SR kernel: bit for bit its pure-torch reference, counter-based noise, the
fallback when no compiler is present, and a build from nothing into a fresh cache."""

from __future__ import annotations

import itertools
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor

from hlat_trainer import sr_kernel
from hlat_trainer.optim import AdamWSR
from hlat_trainer.sr_kernel import Update

BF16, F32 = torch.bfloat16, torch.float32
SIZES = [1, 7, 1000, 4099, 70_000]  # odd sizes: vector tails; 70_000 > one thread's minimum


def _kernel() -> sr_kernel.Kernel:
    kernel = sr_kernel.load()
    assert kernel is not None, "the C++ kernel did not build (is g++ installed?)"
    return kernel


def _updates(seed: int, param: torch.dtype, grad: torch.dtype, state: torch.dtype,
             step: int = 3) -> list[Update]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(SIZES):
        g = torch.randn(n, generator=gen) * 1e-2
        g[:: 97] = 0.0
        if i == 3:
            g[5], g[6], g[7] = float("nan"), float("inf"), -float("inf")  # specials propagate
        lr, wd, beta1, beta2 = 1e-2 * (i + 1), 0.1, 0.9, 0.95
        out.append(Update(
            param=torch.randn(n, generator=gen).to(param), grad=g.to(grad),
            exp_avg=(torch.randn(n, generator=gen) * 1e-2).to(state),
            exp_avg_sq=(torch.rand(n, generator=gen) * 1e-4).to(state),
            keys=(sr_kernel.stream_key(seed, i, 0), sr_kernel.stream_key(seed, i, 1),
                  sr_kernel.stream_key(seed, i, 2)),
            decay=1 - lr * wd, w1=1 - beta1, beta2=beta2, c2=1 - beta2,
            inv_bc2=1 / (1 - beta2**step) ** 0.5, eps=1e-8, step_size=-lr / (1 - beta1**step)))
    return out


def _tensors(updates: list[Update]) -> list[Tensor]:
    return [t for u in updates for t in (u.param, u.exp_avg, u.exp_avg_sq)]


def _same_bits(a: Tensor, b: Tensor) -> bool:
    view = torch.int16 if a.dtype == BF16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize(("param", "grad", "state"), list(itertools.product((F32, BF16),
                                                                            repeat=3)))
def test_fused_kernel_equals_the_torch_reference_bit_for_bit(
    param: torch.dtype, grad: torch.dtype, state: torch.dtype
) -> None:
    """Weights and moments after three steps: the C++ loop (split over 3 threads) and the
    pure-torch path (in chunks of 1000) agree in every bit, NaN and inf included."""
    fused, reference = _updates(5, param, grad, state), _updates(5, param, grad, state)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for _ in range(3):
            _kernel().adamw_(fused)
            sr_kernel.torch_adamw_(reference, chunk=1000)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(_tensors(fused), _tensors(reference), strict=True):
        assert _same_bits(a, b)
    moved = fused[2].param.float() != _updates(5, param, grad, state)[2].param.float()
    assert moved.float().mean() > 0.5, "the update did something"


def test_sr_of_every_kind_of_bit_pattern_matches_and_noise_is_per_element() -> None:
    """Random fp32 bit patterns (NaNs, infs, subnormals, values beyond bf16's range): the
    kernel's SR equals the torch path's, whose noise depends only on (key, element index) —
    not on chunking, and correct past 2^32 elements, where the index's high half enters."""
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(-(2**31), 2**31, (50_000,), generator=gen, dtype=torch.int64)
    src = src.to(torch.int32).view(F32)
    key = 0xDEADBEEF12345678
    for first in (0, 2**32 - 20_000, 5 * 2**32):
        fused, ref, chunked = (torch.empty(src.numel(), dtype=BF16) for _ in range(3))
        _kernel().sr_bf16_(fused, src, key, first)
        sr_kernel.torch_sr_bf16_(ref, src, key, first)
        sr_kernel.torch_sr_bf16_(chunked, src, key, first, chunk=333)
        assert _same_bits(fused, ref) and _same_bits(ref, chunked)
    index = torch.arange(2**32 - 4, 2**32 + 4)
    assert not torch.equal(sr_kernel.noise16(index, key), sr_kernel.noise16(index + 2**32, key))
    counts = torch.bincount(sr_kernel.noise16(torch.arange(1 << 20), key) >> 12, minlength=16)
    assert int(counts.min()) > 0.95 * (1 << 16), "each 4-bit prefix near 1/16 of the draws"


def test_results_do_not_depend_on_the_thread_count() -> None:
    one, many = _updates(9, BF16, BF16, BF16), _updates(9, BF16, BF16, BF16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _kernel().adamw_(one)
        torch.set_num_threads(4)
        _kernel().adamw_(many)
    finally:
        torch.set_num_threads(threads)
    assert all(_same_bits(a, b) for a, b in zip(_tensors(one), _tensors(many), strict=True))


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """sr_kernel as in a new process, with an empty build cache."""
    monkeypatch.setattr(sr_kernel, "_loaded", None)
    monkeypatch.setattr(sr_kernel, "_load_failed", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(sr_kernel.ENV_BACKEND, raising=False)
    monkeypatch.delenv("CXX", raising=False)
    return tmp_path


def _train(steps: int = 3) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(BF16)) for n in (300, 17)]
    opt = AdamWSR(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, seed=4,
                  state_dtype=BF16)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2 * (step + i + 1)).to(BF16)
        opt.step()
    return [p.detach() for p in params]


def test_without_a_compiler_one_warning_and_the_same_results(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _train()  # the C++ path
    monkeypatch.setattr(sr_kernel, "_loaded", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train()
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
        "AdamWSR: fused C++ kernel unavailable (no C++ compiler (g++ or c++) on PATH); using "
        "the slower pure-torch path (same results)"]
    assert sr_kernel._loaded is None and sr_kernel._load_failed
    assert all(_same_bits(a, b) for a, b in zip(expected, got, strict=True))


def test_a_failing_build_falls_back_too(fresh_loader: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.warns(RuntimeWarning, match="kernel unavailable"):
        assert sr_kernel.load() is None
    assert not list(fresh_loader.rglob("*.so"))


def test_builds_into_an_empty_cache_once(fresh_loader: Path) -> None:
    kernel = sr_kernel.load()
    assert kernel is not None
    [built] = list((fresh_loader / "hlat" / "sr_kernel").glob("sr_adamw-*.so"))
    mtime = built.stat().st_mtime_ns
    assert sr_kernel.build("g++") == built and built.stat().st_mtime_ns == mtime, "cached"
    assert list(built.parent.iterdir()) == [built], "no temporary files left behind"
