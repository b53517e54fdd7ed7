"""Prometheus metrics of a training process (local rank 0 serves them).

One registry per trainer, so tests and repeated runs in one process never collide. Names carry
the `hlat_train_` prefix; the chart's dashboards read them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

_GAUGES = {
    "step": "Optimizer steps completed",
    "loss": "Training loss of the last step (mean over micro-batches and data-parallel ranks)",
    "grad_norm": "Global gradient L2 norm before clipping",
    "param_norm": "Global parameter L2 norm",
    "lr": "Learning rate of the last step",
    "tokens_per_second": "Training throughput over the steps since the last report",
    "mfu": "Model FLOPs utilisation of the last step (0..1)",
    "step_seconds": "Mean wall time of an optimizer step since the last report (saves excluded)",
    "data_wait_seconds": "Time the last step waited for the data loader",
    "checkpoint_blocking_seconds": "Time the last checkpoint blocked training",
}


class TrainMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.gauges = {
            name: Gauge(f"hlat_train_{name}", doc, registry=self.registry)
            for name, doc in _GAUGES.items()
        }
        self.tokens = Counter("hlat_train_tokens", "Tokens trained on", registry=self.registry)
        self.spikes = Counter(
            "hlat_train_grad_spikes", "Steps whose grad norm spiked", registry=self.registry
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint; returns the bound port (useful with port 0)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)

    def update(self, stats: dict[str, Any]) -> None:
        for name, gauge in self.gauges.items():
            value = stats.get(name)
            if value is not None:
                gauge.set(value)
        self.tokens.inc(stats.get("tokens_step", 0))
        self.spikes.inc(stats.get("grad_spikes", 0))  # spike steps since the last report
