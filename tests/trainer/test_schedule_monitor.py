"""The LR schedule and the gradient-spike monitor follow the paper."""

from __future__ import annotations

import itertools

import pytest

from hlat_trainer.monitor import GradSpikeMonitor
from hlat_trainer.schedule import lr_at

PAPER = {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 2000, "total_steps": 430_000}


def test_warmup_then_cosine_to_min() -> None:
    assert lr_at(1, **PAPER) == pytest.approx(3e-4 / 2000)
    assert lr_at(1000, **PAPER) == pytest.approx(1.5e-4)
    assert lr_at(2000, **PAPER) == pytest.approx(3e-4)
    mid = 2000 + (430_000 - 2000) // 2
    assert lr_at(mid, **PAPER) == pytest.approx((3e-4 + 3e-5) / 2)
    assert lr_at(430_000, **PAPER) == pytest.approx(3e-5)
    rates = [lr_at(s, **PAPER) for s in range(2000, 430_001, 1000)]
    assert all(a >= b for a, b in itertools.pairwise(rates))


def test_spikes_are_counted_by_length() -> None:
    mon = GradSpikeMonitor(window=20, threshold=0.1)
    norms = [1.0] * 20 + [1.5] + [1.0] * 5 + [2.0, 2.0, 2.0] + [1.0] * 3 + [3.0]
    flags = [mon.observe(n) for n in norms]
    assert not any(flags[:20]), "no spike before the window is full"
    assert flags[20] and flags[26] and flags[27] and flags[-1]
    assert mon.histogram() == {1: 2, 3: 1}
    assert mon.total_spike_steps == 5


def test_below_threshold_is_not_a_spike_and_state_round_trips() -> None:
    mon = GradSpikeMonitor()
    for _ in range(20):
        mon.observe(1.0)
    assert not mon.observe(1.09)
    twin = GradSpikeMonitor()
    twin.load_state_dict(mon.state_dict())
    assert twin.observe(2.0) == mon.observe(2.0)
    assert twin.state_dict() == mon.state_dict()


def test_spike_lengths_reach_prometheus_in_bounded_buckets() -> None:
    """The dashboard's "spikes by length" panel: the monitor's histogram, lengths of 4 or more
    in one bucket, every bucket present from the start (a panel with no spikes shows zeros)."""
    from prometheus_client import generate_latest

    from hlat_trainer.metrics import TrainMetrics, bucket_spike_lengths

    assert bucket_spike_lengths({1: 7, 2: 1, 5: 1, 9: 2}) == {"1": 7, "2": 1, "3": 0, "4+": 3}
    metrics = TrainMetrics()
    assert 'hlat_train_grad_spikes_by_length{length="1"} 0.0' in generate_latest(
        metrics.registry).decode()
    metrics.update({"spike_lengths": {1: 6, 3: 1}})
    text = generate_latest(metrics.registry).decode()
    assert 'hlat_train_grad_spikes_by_length{length="1"} 6.0' in text
    assert 'hlat_train_grad_spikes_by_length{length="3"} 1.0' in text
