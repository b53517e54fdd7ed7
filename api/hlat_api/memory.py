"""Device memory per rank: model state, activations, and the runtime's reserve.

The spec's memory check and docs/neuron.md's table read this module. A training step's peak on
one rank is its model state (weights, gradients, optimizer state) plus the activations the
backward pass needs at its start, plus the working set of the one layer in backward, plus what
the device runtime itself holds. Each term is derived below from what our code keeps.

Model state, bytes per parameter a rank holds (`STATE_BYTES`; ZeRO-1 shards the optimizer
column over dp):

| stack | precision | ZeRO-1 | weight | gradient | optimizer state |
|---|---|---|---|---|---|
| neuron-xla (NxD) | bf16, bf16-sr | on | 2 | 2 | fp32 master shard + 2 fp32 moments = 12 |
| neuron-xla (NxD) | mixed | on | 2 | 4 (fp32 accumulation) | 12 |
| neuron-xla (NxD) | fp32 | on | 4 | 4 | 12 |
| neuron-xla (NxD) | bf16, bf16-sr | off | 2 | 2 | 2 bf16 moments = 4 |
| neuron-xla (NxD) | fp32, mixed | off | 4 | 4 | 2 fp32 moments = 8 |
| torch-native | bf16-sr | either | 2 | 2 | AdamWSR's 2 fp32 moments = 8 (no master copy) |
| torch-native | bf16 | either | 2 | 2 | 2 bf16 moments = 4 |
| torch-native | fp32, mixed | either | 4 | 4 | 2 fp32 moments = 8 |

The NxD rows follow neuron_xla.py's `nxd_precision` (the paper's recipes, awslabs/HLAT 7b/
and 70b/): under ZeRO-1, torch-xla's ZeroRedundancyOptimizer keeps the shard it updates and
AdamW's moments on it in `optimizer_dtype`, fp32 (torch_xla/distributed/
zero_redundancy_optimizer.py, `_shard_parameters`); NxD's `use_fp32_grad_acc` adds a full-size
fp32 `main_grad` per parameter (its `_make_param_hook`), which frees the bf16 gradient.
A rank holds 1/tp of every matrix, except the key/value projections when tp exceeds the kv
heads: each kv head is then replicated on tp / kvHeads ranks.

Activations (`activation_bytes`): the tensors autograd keeps for the backward pass, counted
the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198, section 4) count them for GPT (34sbh + 5as^2b bytes per layer in
fp16; sequence parallel divides every term by t; selective recompute drops the attention
core's), re-derived for our decoder, in the dtypes our code makes them. s sequence, b
micro-batch, h hidden, f intermediate, a heads, t tensor-parallel degree, r = 1/t under
sequence parallelism else 1, e the matmul dtype's bytes (2 under bf16 or autocast, 4 in fp32),
w the residual stream's (the parameter dtype's). Per layer, no recompute:

- each RMSNorm (2): its fp32 input (`x.float()`, 4 sbh r) and its bf16 output that the
  weight multiplies (w sbh r). GPT's LayerNorm counts 2sbh.
- each column-parallel linear input (QKV, gate/up): e sbh r on NxD, whose linear saves the
  sequence shard and all-gathers it again in backward (NxD parallel_layers/layers_utils.py,
  `_linear_autograd_base_setup_fwd` saves `input` before the gather); e sbh on torch-native,
  whose DTensor plan all-gathers before `nn.Linear`, which saves the gathered input.
- attention, eager as NxD's `CoreAttention` (nxd_model.py): q, and k and v repeated to the
  query heads (`repeat_interleave`, so GQA saves nothing here): 3 e sbh/t; the fp32 softmax
  output (4 as^2b/t) and its bf16 cast that multiplies v (e as^2b/t; none in fp32, where the
  cast is the same tensor). GPT's 5as^2b is fp16 softmax output, dropout mask and output.
  Fused, as torch-native's SDPA on CUDA (flash or memory-efficient): q, k and v at their own
  head counts, the output and the fp32 log-sum-exp (4 asb/t); no s x s term.
- the attention output that wo multiplies (a reshaped copy): e sbh/t.
- SwiGLU: gate and up (the fused projection's output), silu(gate), and their product that
  w_down multiplies: 4 e sbf/t. GPT's 4h GeLU MLP counts 19sbh.

Selective recompute (the spec's `selective`: NxD's `activation_checkpoint_config=CoreAttention`,
torch-native's checkpoint of `core_attention`) keeps only the core's inputs, q, k and v at
their own head counts. Full recompute keeps each layer's input (w sbh r). The layer in
backward holds its gradients, at most the shapes of its full set (one more no-recompute layer),
beside what it keeps; under recompute it also holds what it recomputed, which the gradients
need: the attention core under selective, the whole layer under full. (Checked against CUDA's
allocator, bench/check_memory_gpu.py on an H200: without the recomputed core the selective
peak with eager attention was under-predicted by 11-25%, with it the peaks land within a few
percent; docs/neuron.md has the table.) The head adds the
final norm, the output projection's input and the loss: the fp32 softmax NxD's
`parallel_cross_entropy` saves over the vocab shard (4 sbV/t), plus the logits and their fp32
copy while the loss is formed; torch-native gathers full logits (V, not V/t).
Not counted: the token ids, RoPE tables and the causal mask (XLA folds it to a constant: the
paper's "constant attention mask"), and NxD's ZeRO-1 gradient shards at the optimizer step,
which exist after the activations are freed and are smaller than them.

What the compiler makes of this is its own: neuronx-cc decides which values stay live
between forward and backward (its scratchpad, device-memory.rst) and may recompute cheap
ones (the fp32 norm inputs), so this is what eager autograd keeps, an upper estimate for
the dominant terms, not a measurement. See `RUNTIME_RESERVE_GIB` for the runtime's share.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlat_api.presets import (
    INSTANCE_TYPES,
    MODEL_PRESETS,
    PAPER_PRECISION,
    PAPER_TENSOR_PARALLEL,
    ModelDims,
)

GIB = 2**30

STATE_BYTES: dict[tuple[str, str, bool], tuple[int, int, int]] = {
    # (stack, precision, zero1) -> (weight, gradient, optimizer state) bytes per parameter
    ("nxd", "bf16", True): (2, 2, 12), ("nxd", "bf16-sr", True): (2, 2, 12),
    ("nxd", "mixed", True): (2, 4, 12), ("nxd", "fp32", True): (4, 4, 12),
    ("nxd", "bf16", False): (2, 2, 4), ("nxd", "bf16-sr", False): (2, 2, 4),
    ("nxd", "fp32", False): (4, 4, 8), ("nxd", "mixed", False): (4, 4, 8),
    **{("torch", "bf16-sr", z): (2, 2, 8) for z in (True, False)},
    **{("torch", "bf16", z): (2, 2, 4) for z in (True, False)},
    **{("torch", p, z): (4, 4, 8) for p in ("fp32", "mixed") for z in (True, False)},
}
"""The module table. The one place to change when a backend changes what it keeps."""

RUNTIME_RESERVE_GIB: dict[str, float] = {
    # Neuron runtime (neuron-runtime/explore/device-memory.rst, aws-neuron-sdk): 96 MiB
    # micro-code per NeuronCore; the shared scratchpad rounded up to 512 MiB pages (up to
    # one page unused); plus NxD's ZeRO-1 collective buckets, 130 MB for reduce-scatter and
    # as much for all-gather (neuronx-distributed trainer/trainer.py,
    # _ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB). DMA rings, per-graph code and runtime
    # buffers are KiB to MiB per graph in that page's tables: not counted.
    "trn": (96 * 2**20 + 512 * 2**20 + 2 * 130e6) / GIB,
    # CUDA context, cuBLAS workspace, NCCL buffers and the caching allocator's rounding:
    # an allowance, not measured here.
    "p5": 2.0,
}
"""Device memory per rank that neither model state nor activations may use (GiB)."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter held: replicated over dp, and sharded by ZeRO-1."""

    weight: int
    grad: int
    optimizer: int

    @property
    def weights_grads(self) -> int:
        return self.weight + self.grad


def stack_of(managed: bool) -> str:
    return "nxd" if managed else "torch"


def bytes_per_param(precision: str, managed: bool, zero1: bool) -> StateBytes:
    """See `STATE_BYTES`; `managed` is the neuron-xla (NxD) stack."""
    return StateBytes(*STATE_BYTES[(stack_of(managed), precision, zero1)])


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


def snapshot_bytes_per_rank(dims: ModelDims, *, tp: int, dp: int, precision: str,
                            zero1: bool, managed: bool = False) -> float:
    """One in-memory snapshot of a rank (checkpoint.memoryInterval), not its gradients. The
    torch-native stack: its 1/dp of the weights and of the optimizer state (what the dp
    replicas hold alike is kept once per dp group, and ZeRO-1 splits the optimizer state the
    same way). The neuron-xla stack (`managed`): what its checkpoint holds of the rank, the
    weights whole (its tensor-parallel shard) and the optimizer state split only by ZeRO-1."""
    b = bytes_per_param(precision, managed, zero1)
    if managed:
        return params_per_rank(dims, tp) * (b.weight + b.optimizer / (dp if zero1 else 1))
    return params_per_rank(dims, tp) * (b.weight + b.optimizer) / dp


@dataclass(frozen=True)
class Layout:
    """What the activation estimate needs to know about a run, per rank."""

    seq_len: int
    micro_batch: int
    tp: int
    sequence_parallel: bool
    checkpointing: str  # none | selective | full
    precision: str
    managed: bool  # the neuron-xla (NxD) stack; else torch-native
    zero1: bool
    eager_attention: bool  # s x s scores kept (NxD's CoreAttention); else a fused kernel


def _dtype_bytes(lay: Layout) -> tuple[int, int]:
    """(matmul activations e, residual stream w): autocast and bf16 compute in bf16; the
    residual stream (the embedding's output onwards) is in the weights' dtype."""
    e = 4 if lay.precision == "fp32" else 2
    return e, bytes_per_param(lay.precision, lay.managed, lay.zero1).weight


def _layer_terms(dims: ModelDims, lay: Layout) -> dict[str, float]:
    """Bytes one decoder layer keeps for backward without recompute, by tensor group."""
    s, b, h, f, t = lay.seq_len, lay.micro_batch, dims.hidden_size, dims.intermediate_size, lay.tp
    e, w = _dtype_bytes(lay)
    r = 1 / t if lay.sequence_parallel else 1.0
    sbh = s * b * h
    kv_local = max(dims.kv_heads // t, 1) * dims.head_dim  # replicated kv: one head per rank
    heads = dims.heads / t
    if lay.eager_attention:
        probs = 4 + (e if e != 4 else 0)
        core = 3 * e * sbh / t + probs * heads * s * s * b
    else:
        core = e * (2 * sbh / t + 2 * s * b * kv_local) + 4 * heads * s * b
    return {
        "norms": 2 * (4 + w) * sbh * r,
        "linear inputs": 2 * e * sbh * (r if lay.managed else 1.0),
        "attention core": core,
        "attention output": e * sbh / t,
        "mlp": 4 * e * s * b * f / t,
    }


def _core_inputs(dims: ModelDims, lay: Layout) -> float:
    """What a checkpointed attention core keeps: q, k and v at their own head counts."""
    e, _ = _dtype_bytes(lay)
    kv_local = max(dims.kv_heads // lay.tp, 1) * dims.head_dim
    s, b = lay.seq_len, lay.micro_batch
    return e * (s * b * dims.hidden_size / lay.tp + 2 * s * b * kv_local)


@dataclass(frozen=True)
class Activations:
    """Activation bytes on one rank at the start of the backward pass."""

    per_layer: float  # what each layer keeps under the checkpointing mode
    layers: int
    in_flight: float  # the layer in backward: its gradients and what it recomputed
    head: float  # final norm, output projection input, loss

    @property
    def total(self) -> float:
        return self.per_layer * self.layers + self.in_flight + self.head


def activation_bytes(dims: ModelDims, lay: Layout) -> Activations:
    """See the module docstring for each term and its source."""
    terms = _layer_terms(dims, lay)
    full = sum(terms.values())
    if lay.checkpointing == "none":
        kept, recomputed = full, 0.0
    elif lay.checkpointing == "selective":
        kept = full - terms["attention core"] + _core_inputs(dims, lay)
        recomputed = terms["attention core"]
    elif lay.checkpointing == "full":
        _, w = _dtype_bytes(lay)
        kept = w * lay.seq_len * lay.micro_batch * dims.hidden_size / (
            lay.tp if lay.sequence_parallel else 1)
        recomputed = full - kept
    else:
        raise ValueError(f"activation checkpointing must be none, selective or full, got "
                         f"{lay.checkpointing!r}")
    e, w = _dtype_bytes(lay)
    sb = lay.seq_len * lay.micro_batch
    r = 1 / lay.tp if lay.sequence_parallel else 1.0
    vocab = dims.vocab_size / (lay.tp if lay.managed else 1)
    head = ((4 + w) * sb * dims.hidden_size * r
            + e * sb * dims.hidden_size * (r if lay.managed else 1.0)
            + (4 + e + 4) * sb * vocab)
    return Activations(kept, dims.layers, full + recomputed, head)


@dataclass(frozen=True)
class Estimate:
    """A rank's peak, in GiB, against what the device has."""

    state: float
    activations: float
    reserve: float
    capacity: float

    @property
    def total(self) -> float:
        return self.state + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def reserve_gib(instance_type: str) -> float:
    return next((v for k, v in RUNTIME_RESERVE_GIB.items() if instance_type.startswith(k)), 0.0)


def paper_estimate(preset: str, instance_type: str, nodes: int, *, checkpointing: str,
                   sequence_parallel: bool = True, precision: str | None = None,
                   seq_len: int = 4096, micro_batch: int = 1) -> Estimate:
    """A preset at the paper's tensor degree on the neuron-xla stack with ZeRO-1: what the
    spec's memory check computes for it (docs/neuron.md's tables)."""
    dims, tp = MODEL_PRESETS[preset], PAPER_TENSOR_PARALLEL[preset]
    info = INSTANCE_TYPES[instance_type]
    assert info.device_memory_gib is not None
    prec = precision or PAPER_PRECISION[preset]
    dp = nodes * info.ranks_per_node // tp
    state = state_bytes_per_rank(dims, tp=tp, dp=dp, precision=prec, managed=True, zero1=True)
    lay = Layout(seq_len, micro_batch, tp, sequence_parallel, checkpointing, prec, managed=True,
                 zero1=True, eager_attention=True)
    return Estimate(state / GIB, activation_bytes(dims, lay).total / GIB,
                    reserve_gib(instance_type), info.device_memory_gib)


def table(nodes: tuple[int, ...] = (4, 8, 16, 32, 64)) -> str:
    """docs/neuron.md's "Memory per rank" tables: (1) the presets' defaults (the paper's tp,
    precision, sequence parallel, selective recompute or full where selective does not fit)
    per node count, GiB per rank; (2) 7B on one trn1.32xlarge by recompute mode."""
    lines = ["| model | precision | instance (GiB/rank) | "
             + " | ".join(f"{n} nodes" for n in nodes) + " |",
             "|---|---|---|" + "---|" * len(nodes)]
    rows = (("7b", "bf16-sr", "trn1.32xlarge"), ("7b", "bf16-sr", "trn2.48xlarge"),
            ("70b", "mixed", "trn1.32xlarge"), ("70b", "bf16-sr", "trn1.32xlarge"),
            ("70b", "mixed", "trn2.48xlarge"))
    for preset, precision, instance in rows:
        cells = []
        for n in nodes:
            est = paper_estimate(preset, instance, n, checkpointing="selective",
                                 precision=precision)
            mode = "selective"
            if not est.fits:
                est = paper_estimate(preset, instance, n, checkpointing="full",
                                     precision=precision)
                mode = "full"
            cells.append(f"{est.total:.1f} ({mode if est.fits else 'too big'})")
        default = "" if precision == PAPER_PRECISION[preset] else " (not the default)"
        lines.append(f"| {preset} | {precision}{default} | {instance} ({est.capacity:g}) | "
                     + " | ".join(cells) + " |")
    lines += ["", "| 7b, tp 8, 1 trn1.32xlarge node | model state | activations | runtime reserve "
              "| total (of 16) |", "|---|---|---|---|---|"]
    for sp, mode in ((False, "none"), (True, "none"), (False, "selective"), (True, "selective"),
                     (True, "full")):
        est = paper_estimate("7b", "trn1.32xlarge", 1, checkpointing=mode, sequence_parallel=sp)
        lines.append(f"| sequence parallel {'on' if sp else 'off'}, {mode} | {est.state:.1f} | "
                     f"{est.activations:.1f} | {est.reserve:.1f} | {est.total:.1f}"
                     f"{'' if est.fits else ' (refused)'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
