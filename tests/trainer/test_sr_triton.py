"""The Triton AdamW-SR kernel (the GPU path): bit for bit the pure-torch reference.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), which executes
the same kernel source with numpy; with one (the device checks), they are compiled for it.
Either way the reference is the torch path on the same device.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator

import pytest
import torch
from test_sr_kernel import BF16, F32, _same_bits, _tensors, _updates

from hlat_trainer import sr_kernel, sr_triton

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fresh kernels, interpreted on the CPU unless a GPU is present."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    sys.modules.pop("hlat_trainer.sr_triton_kernels", None)
    sr_triton._kernels.cache_clear()
    yield
    sys.modules.pop("hlat_trainer.sr_triton_kernels", None)
    sr_triton._kernels.cache_clear()


def _on_device(updates: list[sr_kernel.Update]) -> list[sr_kernel.Update]:
    for u in updates:
        for name in ("param", "grad", "exp_avg", "exp_avg_sq"):
            setattr(u, name, getattr(u, name).to(DEVICE))
    return updates


@pytest.mark.parametrize(("param", "grad", "state"), list(itertools.product((F32, BF16),
                                                                            repeat=3)))
def test_triton_kernel_equals_the_torch_reference_bit_for_bit(
    param: torch.dtype, grad: torch.dtype, state: torch.dtype
) -> None:
    """Three steps over odd sizes (partial last blocks), NaN and inf in a gradient: every bit
    of weights and moments equals the torch path's."""
    fused = _on_device(_updates(5, param, grad, state))
    reference = _on_device(_updates(5, param, grad, state))
    for _ in range(3):
        sr_triton.adamw_(fused)
        sr_kernel.torch_adamw_(reference, chunk=1000)
    for a, b in zip(_tensors(fused), _tensors(reference), strict=True):
        assert _same_bits(a, b)
    before = _updates(5, param, grad, state)[2].param.float()
    assert (fused[2].param.cpu().float() != before).float().mean() > 0.5, "the update moved"


def test_triton_sr_of_every_bit_pattern_matches_past_two_to_the_32() -> None:
    """Random fp32 bit patterns (NaNs, infs, subnormals, beyond bf16's range), with the noise
    of elements near and past 2^32, where the index's high half enters the hash."""
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(-(2**31), 2**31, (20_000,), generator=gen, dtype=torch.int64)
    src = src.to(torch.int32).view(F32).to(DEVICE)
    key = 0xDEADBEEF12345678
    for first in (0, 2**32 - 7_000, 5 * 2**32):
        fused, ref = (torch.empty(src.numel(), dtype=BF16, device=DEVICE) for _ in range(2))
        sr_triton.sr_bf16_(fused, src, key, first)
        sr_kernel.torch_sr_bf16_(ref, src, key, first)
        assert _same_bits(fused, ref)


def test_adamwsr_takes_the_triton_path_where_triton_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sr_kernel.adamw_ hands tensors to the Triton kernel where it can run them (CUDA; here
    the interpreter is let stand in for CUDA by `available`), and not under HLAT_SR_KERNEL=torch."""
    calls: list[int] = []
    real = sr_triton.adamw_
    monkeypatch.setattr(sr_triton, "available", lambda device: True)
    monkeypatch.setattr(sr_triton, "adamw_", lambda u: (calls.append(len(u)), real(u)))
    fused = _on_device(_updates(1, BF16, BF16, F32))
    sr_kernel.adamw_(fused)
    assert calls == [len(fused)]
    reference = _on_device(_updates(1, BF16, BF16, F32))
    sr_kernel.torch_adamw_(reference)
    assert all(_same_bits(a, b) for a, b in zip(_tensors(fused), _tensors(reference),
                                                 strict=True))
    monkeypatch.setenv(sr_kernel.ENV_BACKEND, "torch")
    sr_kernel.adamw_(_on_device(_updates(1, BF16, BF16, F32)))
    assert calls == [len(fused)], "HLAT_SR_KERNEL=torch keeps the torch path"
