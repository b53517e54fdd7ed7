"""Model-state memory per rank: what the spec's memory check and docs/neuron.md's table use.

What is counted, per parameter a rank holds (bytes), by device stack and precision:

| stack | precision | weights + grads | optimizer state (ZeRO-1 shards it over dp) |
|---|---|---|---|
| neuron-xla (NxD) | bf16, bf16-sr | 2 + 2 | ZeRO-1: master copy + 2 moments in the parameter dtype (`optimizer_dtype`) = 6; without: 2 moments = 4 |
| neuron-xla (NxD) | fp32, mixed | 4 + 4 | ZeRO-1: fp32 master + 2 moments = 12; without: 8 |
| torch-native | bf16-sr | 2 + 2 | AdamWSR's 2 moments, fp32 by default = 8 (no master copy: the rounding is the update's) |
| torch-native | bf16 | 2 + 2 | 2 bf16 moments = 4 |
| torch-native | fp32, mixed | 4 + 4 | 2 fp32 moments = 8 |

A rank holds 1/tp of every matrix, except the key/value projections when tp exceeds the kv
heads: each kv head is then replicated on tp / kvHeads ranks, so a rank holds one whole kv head
(2 x hidden x headDim per layer) rather than 1/tp of them. Norm weights are counted as sharded
(they are a rounding error).

Not counted: activations (they depend on micro-batch, sequence length, sequence parallelism
and activation checkpointing: the paper's 7B and 70B runs used selective recompute), the
runtime's and collectives' buffers, fragmentation. The check therefore keeps a headroom
(`MEMORY_HEADROOM`: state may use 80% of a rank's memory) and is a floor, not a guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlat_api.presets import ModelDims

MEMORY_HEADROOM = 0.8
"""Share of a rank's device memory the model state may use; the rest is for activations,
buffers and the runtime."""

_HALF = ("bf16", "bf16-sr")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter held: replicated over dp, and sharded by ZeRO-1."""

    weights_grads: int
    optimizer: int


def bytes_per_param(precision: str, managed: bool, zero1: bool) -> StateBytes:
    """See the module table; `managed` is the neuron-xla (NxD) stack."""
    half = precision in _HALF
    weights_grads = 4 if half else 8
    if managed:
        moments = 4 if half else 8
        master = (2 if half else 4) if zero1 else 0
        return StateBytes(weights_grads, moments + master)
    if precision == "bf16":
        return StateBytes(weights_grads, 4)
    return StateBytes(weights_grads, 8)


def params_per_rank(dims: ModelDims, tp: int) -> float:
    """Parameters one tensor-parallel rank holds (kv heads replicated when tp > kvHeads)."""
    if tp <= dims.kv_heads:
        return dims.param_count() / tp
    kv_all = dims.layers * 2 * dims.hidden_size * dims.kv_heads * dims.head_dim
    kv_local = dims.layers * 2 * dims.hidden_size * dims.head_dim  # one whole kv head
    return (dims.param_count() - kv_all) / tp + kv_local


def state_bytes_per_rank(dims: ModelDims, *, tp: int, dp: int, precision: str, managed: bool,
                         zero1: bool) -> float:
    """Weights, gradients and optimizer state on one rank."""
    b = bytes_per_param(precision, managed, zero1)
    shards = dp if zero1 else 1
    return params_per_rank(dims, tp) * (b.weights_grads + b.optimizer / shards)


def table(nodes: tuple[int, ...] = (4, 8, 16, 32, 64)) -> str:
    """docs/neuron.md's "Memory per rank" table: the paper's layouts (7b tp 8, 70b tp 32) in
    bf16-sr with ZeRO-1 on the neuron-xla stack, GiB of model state per rank."""
    from hlat_api.presets import INSTANCE_TYPES, MODEL_PRESETS, PAPER_TENSOR_PARALLEL

    instances = ("trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge")
    lines = ["| model | tp | instance (GiB/rank, 80% for state) | "
             + " | ".join(f"{n} nodes" for n in nodes) + " |",
             "|---|---|---|" + "---|" * len(nodes)]
    for preset in ("7b", "70b"):
        dims, tp = MODEL_PRESETS[preset], PAPER_TENSOR_PARALLEL[preset]
        for instance in instances:
            info = INSTANCE_TYPES[instance]
            assert info.device_memory_gib is not None
            cells = []
            for n in nodes:
                gib = state_bytes_per_rank(dims, tp=tp, dp=n * info.ranks_per_node // tp,
                                           precision="bf16-sr", managed=True,
                                           zero1=True) / 2**30
                fits = gib <= info.device_memory_gib * MEMORY_HEADROOM
                cells.append(f"{gib:.1f}" + ("" if fits else " (too big)"))
            lines.append(f"| {preset} | {tp} | {instance} ({info.device_memory_gib:g}) | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
