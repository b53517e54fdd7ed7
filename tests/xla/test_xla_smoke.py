"""The tier is wired end to end: torch-xla imports, PJRT runs on the CPU, the metrics count.

A 3-step MLP training loop on the XLA device (AdamW, a graph cut per step): steps 1 and 2
compile (the second step's graph differs, as AdamW's state now exists), step 3 compiles nothing.
"""

from __future__ import annotations

import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch import nn


def compilations() -> int:
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def test_a_small_training_loop_compiles_nothing_after_two_steps() -> None:
    device = torch_xla.device()
    assert device.type == "xla"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16).to(device)
    y = torch.randint(0, 4, (8,)).to(device)
    torch_xla.sync()

    compiled, losses = [], []
    for _ in range(3):
        before = compilations()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        compiled.append(compilations() - before)
        losses.append(loss.detach())

    assert compiled[0] > 0, compiled
    assert compiled[2] == 0, compiled
    values = [float(v.cpu()) for v in losses]
    assert values[2] < values[0], values
    assert all(p.device.type == "xla" for p in model.parameters())
