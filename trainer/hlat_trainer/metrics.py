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
    "compute_seconds": "Median compute time (forward and backward, less data wait, no wait on "
                       "peers) of this rank's recent steps; eager CPU only",
    "sync_seconds": "Median gradient synchronisation time (mostly waiting for the slowest "
                    "peer) of this rank's recent steps; eager CPU only",
    "data_wait_median_seconds": "Median time this rank's recent steps waited for the data "
                                "loader (a slow data path holds back the gang as a slow chip "
                                "does)",
    "host_seconds": "Median host overhead (the optimizer update, clipping, moving batches: a "
                    "step less compute, sync, data wait and staging) of this rank's recent "
                    "steps; eager CPU only",
    "checkpoint_blocking_seconds": "Time the last checkpoint blocked training",
    "validation_loss": "Held-out validation loss of the latest evaluation (spec.eval), mean "
                       "per token over data-parallel ranks",
}


SPIKE_LENGTHS = ("1", "2", "3", "4+")


def bucket_spike_lengths(histogram: dict[int, int]) -> dict[str, int]:
    """Spike length -> count, with lengths of 4 and more in one bucket (bounded labels)."""
    out = dict.fromkeys(SPIKE_LENGTHS, 0)
    for length, count in histogram.items():
        out[str(length) if length < 4 else "4+"] += count
    return out


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
        self.spike_lengths = Gauge(
            "hlat_train_grad_spikes_by_length",
            "Gradient spikes so far by how many consecutive steps they lasted (the HLAT paper: "
            "most last one step)", ("length",), registry=self.registry)
        for length in SPIKE_LENGTHS:
            self.spike_lengths.labels(length).set(0)

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
        lengths = stats.get("spike_lengths")
        if lengths is not None:
            for length, count in bucket_spike_lengths(lengths).items():
                self.spike_lengths.labels(length).set(count)
        self.spikes.inc(stats.get("grad_spikes", 0))  # spike steps since the last report
