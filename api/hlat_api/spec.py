"""The PretrainJob spec: one schema for Kubernetes manifests and local runs.

Field names are snake_case in Python and camelCase in YAML (pydantic aliases), every field is
documented (the descriptions become the CRD's `kubectl explain` text), and unknown fields are
rejected so that a typo never silently falls back to a default. Defaults are the HLAT paper's
recipe (section 3.2): AdamW 0.9/0.95, eps 1e-8, weight decay 0.1, clip 1.0, cosine 3e-4 -> 3e-5,
2000 warmup steps, sequence length 4096, global batch 1024.

Cross-field rules (parallel degrees against the model and the world size, batch divisibility,
sequence length against the model, memory per device) live in `PretrainJobSpec`'s validator and
raise with the offending field's camelCase path, so both the operator (InvalidSpec) and
`hlat-train` print an actionable message.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from hlat_api.errors import SpecError
from hlat_api.labels import INSTANCE_TYPE_LABEL, NETWORK_LAYERS
from hlat_api.memory import (
    GIB,
    Estimate,
    Layout,
    activation_bytes,
    reserve_gib,
    snapshot_bytes_per_rank,
    state_bytes_per_rank,
)
from hlat_api.podtemplate import PodTemplate
from hlat_api.presets import (
    HYPERPOD_INSTANCE_TYPES,
    INSTANCE_TYPES,
    MODEL_PRESETS,
    PAPER_PRECISION,
    PAPER_TENSOR_PARALLEL,
    ULTRASERVER_INSTANCE_TYPES,
    InstanceType,
    ModelDims,
    ModelPreset,
    canonical_instance_type,
    ultraserver_group_size,
)

Precision = Literal["fp32", "mixed", "bf16", "bf16-sr"]
ActivationCheckpointing = Literal["none", "selective", "full"]
PositiveInt = Annotated[int, Field(ge=1)]
Text = Annotated[str, Field(min_length=1, max_length=4096)]
"""A non-empty string of reasonable size (paths, URIs, image references)."""
AbsolutePath = Annotated[str, Field(min_length=2, max_length=4096, pattern=r"^/")]
ObjectName = Annotated[str, Field(min_length=1, max_length=253,
                                  pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]
"""A Kubernetes object name (DNS subdomain): PVCs, PriorityClasses, queues."""
MAX_NODES = 4096
"""More worker nodes than any EKS cluster runs for one job (the paper: 64)."""
MAX_PROCESSES_PER_NODE = 256
BACKENDS_BY_ACCELERATOR = {"trn": ("neuron-xla", "neuron-native"), "p5": ("cuda",), "cpu": ("cpu",)}
"""Which backends an instance type's devices can run (by the type's prefix)."""


def micro_batch_share(micro_batches: int, dp: int, dp_rank: int) -> range:
    """The micro-batches of a step's global batch (numbered from 0, in the data loader's
    order) that data-parallel rank `dp_rank` of `dp` trains: consecutive, and the first
    `micro_batches % dp` ranks take one more than the others. The trainer's loader and its
    accumulation both follow it, so the global batch is the same sequences at every degree."""
    base, extra = divmod(micro_batches, dp)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (dp_rank < extra))


class _Model(BaseModel):
    """Strict like the API server: a "2" is not a number nor a "false" a boolean, NaN and
    infinities are refused, and only the camelCase names of the manifest are read (the
    snake_case names are for Python code)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        strict=True,
        allow_inf_nan=False,
    )


class ModelSpec(_Model):
    """The decoder: a preset, optionally with individual dimensions overridden."""

    preset: ModelPreset | None = "7b"
    """Named size: tiny (tests, CPU demo), 125m, 1b, 7b (LLaMA-2-7B), 70b (LLaMA-2-70B, GQA)."""
    hidden_size: PositiveInt | None = None
    """Model width; overrides the preset's."""
    layers: PositiveInt | None = None
    """Number of decoder layers; overrides the preset's."""
    heads: PositiveInt | None = None
    """Attention (query) heads; overrides the preset's."""
    kv_heads: PositiveInt | None = None
    """Key/value heads (grouped-query attention when fewer than heads); overrides the preset's."""
    intermediate_size: PositiveInt | None = None
    """SwiGLU hidden width; overrides the preset's."""
    vocab_size: PositiveInt | None = None
    """Vocabulary size; must be at least the tokenizer's. Overrides the preset's."""
    max_seq_len: PositiveInt | None = None
    """Longest sequence the model supports (RoPE table size); overrides the preset's."""
    rope_theta: Annotated[float, Field(gt=0)] | None = None
    """RoPE base frequency; overrides the preset's."""

    def dims(self) -> ModelDims:
        """The preset's dimensions with this spec's overrides applied."""
        overrides = {k: v for k, v in self.model_dump(exclude={"preset"}).items() if v is not None}
        if self.preset is None:
            missing = [to_camel(n) for n in ModelDims.__dataclass_fields__ if n not in overrides]
            missing = [m for m in missing if m not in ("ropeTheta", "normEps")]
            if missing:
                raise SpecError("model", f"no preset, so these dimensions are required: {missing}")
            return ModelDims(**overrides)
        base = MODEL_PRESETS[self.preset]
        return ModelDims(**{**base.__dict__, **overrides})


def _no_schema_default(schema: dict[str, Any]) -> None:
    # the API server must leave the field unset, so that the spec's own default (which depends
    # on the model and the instance type) applies rather than a fixed 1
    schema.pop("default", None)


class ParallelismSpec(_Model):
    """How the model is split over the ranks; the data-parallel degree is what remains."""

    tensor: PositiveInt = Field(default=1, json_schema_extra=_no_schema_default)
    """Tensor-parallel degree within a node: divides heads; divides kvHeads or is a multiple of it (kv heads replicated). Unset: the paper's layout for the preset (7b 8, 70b 32, else 1), lowered to fit a node and the heads."""
    pipeline: PositiveInt = 1
    """Pipeline-parallel degree. Only 1 is supported for now."""
    sequence_parallel: bool = Field(default=False, json_schema_extra=_no_schema_default)
    """Shard activations along the sequence between tensor-parallel ranks (paper section 3.5). Unset: on for the 7b and 70b presets on Neuron instance types when tensor > 1 (the paper's scripts), else off."""
    zero1: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO stage 1)."""
    activation_checkpointing: ActivationCheckpointing = Field(
        default="none", json_schema_extra=_no_schema_default)
    """Recompute activations in the backward pass: none, selective (attention core), or full (whole layers). Unset: for the 7b and 70b presets on Neuron instance types, selective (the paper's scripts), or full where selective would not fit the device memory (70B without pipeline parallelism on trn1: docs/neuron.md, "Memory per rank"); else none."""


class OptimizerSpec(_Model):
    """AdamW with a linear warmup and cosine decay (paper section 3.2)."""

    lr: Annotated[float, Field(gt=0)] = 3.0e-4
    """Peak learning rate, reached after warmupSteps."""
    min_lr: Annotated[float, Field(ge=0)] = 3.0e-5
    """Learning rate at the end of the cosine decay (the last training step)."""
    betas: Annotated[
        tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]],
        Field(strict=False),  # a YAML/JSON list; its items stay strict numbers
    ] = (0.9, 0.95)
    """AdamW beta1, beta2. The paper found beta2=0.99 unstable with BF16+SR; 0.95 fixed it."""
    eps: Annotated[float, Field(gt=0)] = 1.0e-8
    """AdamW epsilon."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    """Decoupled weight decay, applied to all parameters (norm weights included, as the paper)."""
    grad_clip: Annotated[float, Field(ge=0)] = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    warmup_steps: Annotated[int, Field(ge=0)] = 2000
    """Linear warmup from 0 to lr over this many steps."""


class DataSpec(_Model):
    """The training corpus and how it is tokenized and packed."""

    path: Text
    """Arrow files (IPC file or stream, as HF datasets writes): a file, a directory, or a glob."""
    tokenizer: Text
    """A HF tokenizers JSON file, or "bytes" for the built-in byte-level tokenizer (tests)."""
    text_column: Annotated[str, Field(min_length=1, max_length=256)] = "text"
    """The column holding each document's text."""
    seq_len: PositiveInt = 4096
    """Tokens per training sequence; at most the model's maxSeqLen."""
    shuffle_seed: int = 1234
    """Seed of the document shuffle; each epoch reshuffles with (seed, epoch)."""


class TrainSpec(_Model):
    """Batch sizes and run length."""

    global_batch: PositiveInt = 1024
    """Sequences per optimizer step, over all data-parallel ranks: globalBatch / microBatch
    micro-batches, at least one per data-parallel rank. When the data-parallel degree does not
    divide them, the first ranks train one micro-batch more than the others (the step waits
    for them)."""
    micro_batch: PositiveInt = 1
    """Sequences per rank per forward pass (divides globalBatch); gradients accumulate to
    globalBatch."""
    steps: PositiveInt | None = None
    """Optimizer steps to run; or give tokens instead."""
    tokens: Annotated[float, Field(gt=0)] | None = None
    """Tokens to train on (e.g. 1.8e12); converted to steps, rounded up."""
    seed: int = 1
    """Seed for weight init and every other random choice of the run."""
    log_interval: PositiveInt = 1
    """Log and publish metrics every this many steps."""


class EvalSpec(_Model):
    """Held-out validation loss in the training loop."""

    path: Text
    """Arrow files of held-out text (as data.path: a file, a directory or a glob), read with
    data's tokenizer, text column and sequence length. Keep them out of data.path: training
    must never see them."""
    interval: PositiveInt = 1000
    """Evaluate after every this many steps (and after the last)."""
    batches: PositiveInt = 8
    """Micro-batches of the held-out set each evaluation reads, over all data-parallel ranks:
    the same ones every time (the set's first, read and dealt to the ranks as a step's global
    batch is), so evaluations compare, across elastic sizes too, and `hlat-eval` reproduces
    them in one process. Ranks beyond this many evaluate none."""


class EvaluationSpec(_Model):
    """Evaluation jobs on durable checkpoints: a Kubernetes Job per checkpoint chosen, beside
    the training (never blocking it), on nodes of its own. Its command finds the checkpoint's
    step in HLAT_EVAL_STEP and the job's spec at HLAT_CONFIG, and writes its results, one JSON
    object of numbers of at most 4 KiB, to HLAT_EVAL_RESULT (the container's
    terminationMessagePath: the operator reads them from the pod's status). The checkpoint is
    held against checkpoint.keep while read (hlat_api.layout's reader files; hlat-eval holds
    it)."""

    every: PositiveInt = 1
    """Evaluate every this many durable checkpoints (those whose step is a multiple of every x
    checkpoint.interval), and the last."""
    image: Text | None = None
    """The evaluator's image. Unset: the trainer's (spec.image)."""
    command: list[Text] = Field(default_factory=lambda: ["hlat-eval"])
    """The evaluator. Default: hlat-eval, the held-out loss of spec.eval's set (which it
    needs)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Where the evaluations run, e.g. {node.kubernetes.io/instance-type: trn1.2xlarge}."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the evaluations' nodes may carry (e.g. aws.amazon.com/neuron)."""
    resources: dict[str, Text] = Field(default_factory=dict)
    """Requests (and limits) of the evaluator's container, e.g. {cpu: "8", memory: 64Gi}."""
    retries: Annotated[int, Field(ge=0, le=10)] = 2
    """Retries of a failed evaluation (the Job's backoffLimit); a failure after them is
    reported and never fails the training job."""
    deadline_seconds: PositiveInt = 3600
    """The longest one evaluation may take, retries included (activeDeadlineSeconds)."""
    keep: Annotated[int, Field(ge=1, le=100)] = 20
    """Evaluations kept in status.evaluations (the newest)."""


class CheckpointSpec(_Model):
    """Where and how often state is saved; layout `<dir>/<job>/step_<N>/`, complete iff `done`."""

    dir: Text = "/fsx/checkpoints"
    """Root directory; each job writes under `<dir>/<job name>/`."""
    interval: PositiveInt = 1000
    """Save every this many steps (and always after the last step)."""
    keep: PositiveInt = 3
    """Keep this many newest complete checkpoints; older ones are deleted."""
    async_: bool = Field(
        default=True,
        alias="async",
        validation_alias=AliasChoices("async", "async_"),
        description="Write in the background; the step waits only for the copy to host memory.",
    )
    memory_interval: PositiveInt | Literal["auto", "off"] | None = None
    """Also snapshot each rank's state into its pod's memory (/dev/shm, held by the launcher,
    so a trainer crash loses nothing there) every this many steps: a trainer restarted in its
    pod resumes from the newest snapshot every rank holds, when it is not older than the
    durable checkpoint, with nothing read from the volume and at most this many steps lost.
    auto: every step, or, when that would cost more, the smallest interval whose snapshots hold
    the loop under 1% of the training time (measured by every rank on a snapshot after its
    attempt's third step, the slowest rank's figures used; each attempt measures again).
    Each rank keeps its two newest. On torch-native backends a snapshot holds the rank's 1/dp
    of the weights and its share of the optimizer state (what its dp replicas hold alike is
    kept once per dp group, gathered back at a restore): host memory, per rank, twice its
    state over the dp degree. On the neuron-xla stack it holds what NxD's checkpoint holds of
    the rank (its tp slice of the weights whole, its optimizer shard), loaded back in NxD's
    order (docs/trainer.md): more nodes do not shrink it. A replaced pod (a lost node) resumes
    from a peer's replica (memoryReplicas), else from the durable checkpoint; an elastic job
    shrunk in place, from the old world's snapshots resharded (docs/operator.md). Needs
    restartStrategy InPlace. Unset: auto where snapshots can serve (InPlace, and room in the
    node's memory) on torch-native backends (cpu, cuda, neuron-native); off with RecreateGang,
    and on neuron-xla unless set (that path has not run on Trainium). off: none."""
    memory_replicas: int = Field(default=1, ge=0, le=1)
    """With memoryInterval, and more than one node: copies of each node's snapshots kept in
    another node's memory (the next node rank's, in a ring), pushed by the launchers over TCP
    port 29491 off the training loop, checked by SHA-256. A node that is lost hands its ranks
    to a spare or a new pod, which fetches their snapshots back from that peer before its
    trainers start: the job resumes from memory with nothing read from the volume, when the
    copy is no more than one snapshot behind the other ranks' newest. Host memory per node:
    twice its own snapshots. 0: no copies (a lost node's ranks resume from the durable
    checkpoint)."""


class StorageSpec(_Model):
    """The shared volume for data and checkpoints (FSx for Lustre on EKS)."""

    claim_name: ObjectName | None = None
    """PersistentVolumeClaim mounted in every worker pod; none for local runs."""
    mount_path: AbsolutePath = "/fsx"
    """Where the claim is mounted in the pods."""


class BackoffSpec(_Model):
    """Exponential backoff between restarts that make no progress. An attempt that made
    progress (a durable checkpoint or a snapshot every worker holds, newer than where it
    started) restarts at once, as the kubelet restarts a container the first time."""

    initial_seconds: Annotated[float, Field(ge=0)] = 30
    """Delay before a restart after an attempt that made no progress; doubles for each such
    attempt in a row."""
    max_seconds: Annotated[float, Field(ge=0)] = 600
    """Upper bound of the delay."""

    def delay_seconds(self, streak: int) -> float:
        """The wait before the next attempt after `streak` attempts in a row that made no
        progress: none after one that did (a fault in steady training is not a crash loop,
        which is what a backoff guards against), else `initialSeconds` doubling per attempt,
        capped at `maxSeconds`."""
        if streak <= 0:
            return 0.0
        return min(self.max_seconds, self.initial_seconds * 2.0 ** (streak - 1))


class HeartbeatSpec(_Model):
    """When a worker counts as hung."""

    startup_timeout_seconds: Annotated[float, Field(gt=0)] = 3600
    """Longest wait for a pod's first heartbeat (process start, compile, checkpoint load)."""
    timeout_seconds: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    """Longest a training worker may go without progress (a step), whole seconds; auto =
    observed step time x safetyFactor."""
    safety_factor: Annotated[float, Field(ge=1)] = 5
    """Multiplier on the observed step time for the automatic timeout."""


class StragglerSpec(_Model):
    """Fail-slow nodes: a node whose workers compute, load data or update slower than the rest
    of the gang holds every step back (synchronous data parallel runs at its slowest rank's
    pace) without failing anything. Each worker reports the medians of its recent steps' own
    time: compute (forward and backward), the wait for its data loader, and host work (the
    optimizer update, clipping); not the time it waited for its peers, which is where a
    healthy rank spends a straggler's extra time. The operator compares each node's sum with
    the median of the other nodes'."""

    action: Literal["Report", "Replace"] = "Report"
    """Report: condition `Straggler` naming the node, its slowdown and since when, a Warning
    event, and `hlat_node_step_slowdown_ratio` per node. Replace: the same, then the node's
    rank moves to a ready spare (restartStrategy InPlace, spareNodes >= 1) in an in-place
    restart, and the node goes on the avoid list; the move uses no restart budget. With no
    ready spare the job restarts off the node (its pod recreated on another) once the time the
    node has cost exceeds what a restart costs this job (its attempts' measured starts plus
    the backoff); until then it stays, reported. Either move waits for a checkpoint completed
    after the flag (nothing trained is lost), which the operator asks the workers for as soon
    as the move is due, not an interval later."""
    threshold: Annotated[float, Field(gt=0, le=10)] = 0.2
    """Flag a node whose own time a step is more than (1 + threshold) x the median of the
    other nodes' (0.2: 20% slower)."""
    window_seconds: Annotated[float, Field(ge=0)] = 30
    """How long a node must stay over the threshold before it is flagged (noise, a garbage
    collection or a checkpoint's copy on one node, is not a straggler). A dip back under it
    for no more than two heartbeat periods does not start the window over (each report is a
    median of a few steps, and one slow step of a healthy node moves the baseline), nor clears
    a node already flagged: it is cleared once under for longer."""


RestartStrategy = Literal["InPlace", "RecreateGang"]


class ElasticSpec(_Model):
    """Train on fewer nodes while nodes are missing, and grow back when they return, with the
    same global batch and the same data throughout (the data-parallel degree changes, the
    tensor layout does not)."""

    min_nodes: PositiveInt
    """The fewest nodes the job trains on. It shrinks to the largest size, down to this one,
    that the usable nodes hold and that keeps train.globalBatch (whole tensor x pipeline
    groups, at least one micro-batch per data-parallel rank: docs/operator.md); a spec that
    allows none below `nodes` is refused with the sizes it allows."""
    wait_seconds: Annotated[float, Field(ge=0)] = 300
    """How long a job whose pods cannot all be placed waits for a spare or a replacement node
    before it restarts on fewer nodes."""


class FaultToleranceSpec(_Model):
    """Automatic gang restart from the latest complete checkpoint."""

    restart_strategy: RestartStrategy = "InPlace"
    """InPlace: the pods stay and every launcher restarts its trainer for the new attempt; only
    pods that are gone (lost node, deleted, evicted, container failed) are recreated. Falls
    back to RecreateGang after two in-place attempts in a row that failed before training.
    RecreateGang: every pod is deleted and a new gang created."""
    spare_nodes: Annotated[int, Field(ge=0, le=64)] = 0
    """Extra worker pods kept scheduled and warm (InPlace only): a launcher with warm standby
    trainers and the node's compile cache, outside the rendezvous. A lost node's rank moves to
    a ready spare at once (no scheduling, no cold start) and a new spare is requested. Each
    spare takes a whole node and counts against quota like a worker."""

    max_restarts: Annotated[int, Field(ge=0)] = 20
    """Restarts that count against the budget before the job is Failed."""
    infra_faults_count: bool = False
    """Whether node loss, eviction and preemption use restart budget."""
    backoff: BackoffSpec = Field(default_factory=BackoffSpec)
    """Delay between restarts."""
    heartbeat: HeartbeatSpec = Field(default_factory=HeartbeatSpec)
    """Hang detection."""
    no_progress_restarts: PositiveInt = 3
    """Restarts in a row without a new complete checkpoint before the job is Failed."""
    avoid_failed_nodes: bool = True
    """Keep nodes that failed out of the next attempts (node affinity), never so many that
    fewer usable nodes than `nodes` remain (the least recently failed are let back first)."""
    avoid_failed_nodes_seconds: Annotated[float, Field(ge=0)] = 3600
    """How long a failed node stays avoided; shown in status.avoidedNodes."""
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)
    """Detecting nodes slower than their gang (fail-slow hardware)."""


class Toleration(_Model):
    """A pod toleration, as in the Kubernetes Pod spec."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


LabelKey = Annotated[str, Field(min_length=1, max_length=316,
                                pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")]
"""A node label key (an optional DNS-subdomain prefix and a name), e.g.
topology.k8s.aws/network-node-layer-3."""


class TopologySpec(_Model):
    """Where the gang goes in the network, by the node labels that name each node's place in
    it (on EKS, EC2's instance topology: `topology.k8s.aws/network-node-layer-1` the top
    layer, the least selective, to `-3` the bottom one, nodes sharing it the closest; AWS EKS
    user guide, "Place distributed AI/ML workloads with network topology labels"). The
    operator picks the nodes (the tightest domain that holds the gang, as Kueue's
    Topology-Aware Scheduling does) and orders node ranks by the levels, so consecutive ranks,
    and so the data-parallel rings, share the lowest switch they can. Set exactly one of
    `required` and `preferred`; see docs/operator.md, "Network topology"."""

    required: LabelKey | None = None
    """Every worker pod in one domain of this level (required node affinity on its value).
    While no domain has enough usable nodes the job waits, Schedulable=False with reason
    TopologyUnavailable, and creates no pods."""
    preferred: LabelKey | None = None
    """As few domains of this level as hold the gang, each pod steered to its planned node
    (preferred node affinity): placed elsewhere when that node is taken, never left waiting."""
    levels: list[LabelKey] = Field(
        default_factory=lambda: list(NETWORK_LAYERS),
        min_length=1, max_length=8)
    """The network's levels, top first; node ranks follow them, then the node name. For
    instance types with a fourth layer, add `topology.k8s.aws/network-node-layer-4`."""
    slice_size: Annotated[int, Field(ge=2, le=64)] | None = None
    """Place the gang in slices of this many consecutive node ranks, each slice whole in one
    domain of the level (`required` or `preferred`): a domain gives whole slices or none, and
    a slice's rank made again goes only to its slice's domain. On trn2 UltraServers, 4 at
    `neuron.amazonaws.com/ultraserver-server-id-4` (NeuronLink joins the nodes of one, and the
    runtime wants whole ones). `nodes` must be a multiple. Where too few domains hold whole
    slices the job waits (TopologyUnavailable), `preferred` too. Through Kueue: the pod set's
    `podSetSliceRequiredTopology` and `podSetSliceSize`."""

    @model_validator(mode="after")
    def _one_level(self) -> TopologySpec:
        """Exactly one of `required` and `preferred`, and it is one of `levels`."""
        named = [(f, v) for f, v in (("required", self.required),
                                      ("preferred", self.preferred)) if v is not None]
        if len(named) != 1:
            raise SpecError("scheduling.topology", "set exactly one of required and preferred "
                            "(a level, e.g. topology.k8s.aws/network-node-layer-3)")
        field, level = named[0]
        if level not in self.levels:
            raise SpecError(f"scheduling.topology.{field}",
                            f"{level!r} is not one of scheduling.topology.levels {self.levels}")
        if len(set(self.levels)) != len(self.levels):
            raise SpecError("scheduling.topology.levels", "names a level twice")
        return self


class SchedulingSpec(_Model):
    """Placement extras passed through to the worker pods."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Extra node labels the worker nodes must carry."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Extra tolerations (the Neuron taint is tolerated automatically on trn instances)."""
    priority_class_name: ObjectName | None = None
    """PriorityClass of the worker pods."""
    scheduler_name: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    """Scheduler for the worker pods; unset: the operator's default (HLAT_OPERATOR_SCHEDULER_NAME,
    else Kubernetes' default scheduler). `volcano`: the operator creates a PodGroup (minMember
    = nodes) so the gang is placed whole or not at all."""
    queue: ObjectName | None = None
    """Volcano queue of the job's PodGroup (with schedulerName volcano); unset: `default`."""
    topology: TopologySpec | None = None
    """Network-topology placement and rank order (unset: wherever the scheduler puts them,
    ranks by pod name)."""


class NeuronSpec(_Model):
    """Neuron compiler and runtime settings (Trainium only); see docs/neuron.md."""

    cache_dir: AbsolutePath = "/var/tmp/neuron-compile-cache"
    """Node-local compile cache the compiler reads and writes (--cache_dir and NEURON_COMPILE_CACHE_URL both name it); never on the shared volume: the paper saw timeouts there."""
    shared_cache_dir: AbsolutePath | None = None
    """Shared copy of the compile cache on the job's volume: hlat-launch copies its graphs into cacheDir before the workers start and publishes new ones back, so a new or spare node starts warm. Unset: `<checkpoint.dir>/.neuron-compile-cache`."""
    share_cache: bool = True
    """Seed cacheDir from sharedCacheDir and publish new graphs back; false keeps each node's cache to itself."""
    compiler_flags: list[str] = Field(
        default_factory=lambda: ["--model-type=transformer", "--distribution-strategy=llm-training"])
    """NEURON_CC_FLAGS (the paper's, section 3.5); --cache_dir is added from cacheDir."""
    exec_timeout_seconds: Annotated[int, Field(ge=1)] = 4000
    """NEURON_RT_EXEC_TIMEOUT: how long one graph execution, a collective waiting for a peer that is still compiling included, may take (the paper's scripts: 4000)."""
    fuse_softmax: bool = True
    """NEURON_FUSE_SOFTMAX=1: the compiler's custom softmax lowering (paper 3.5)."""
    async_exec_max_inflight_requests: Annotated[int, Field(ge=0)] = 3
    """NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS: overlap host and device work (paper 3.5)."""
    compile_only: bool = False
    """Only trace and compile the graphs (for neuron_parallel_compile), then exit."""

    @model_validator(mode="after")
    def _caches_differ(self) -> NeuronSpec:
        """`neuron.sharedCacheDir`, when set, is another directory than `neuron.cacheDir`."""
        if self.shared_cache_dir is not None and (
                self.shared_cache_dir.rstrip("/") == self.cache_dir.rstrip("/")):
            raise SpecError(
                "neuron.sharedCacheDir", "must differ from neuron.cacheDir: cacheDir is the "
                "node-local cache the compiler uses, sharedCacheDir the copy on the shared "
                "volume it is seeded from")
        return self


class PretrainJobSpec(_Model):
    """What to train, on what, and how to survive faults."""

    image: Text | None = None
    """The trainer image (Dockerfile.trainer); required on Kubernetes, unused by local runs."""
    nodes: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1
    """Worker pods, one per node."""
    instance_type: Annotated[InstanceType, WithJsonSchema(
        {"type": "string", "enum": [*INSTANCE_TYPES, *HYPERPOD_INSTANCE_TYPES]})] = "trn1.32xlarge"
    """Node type: trn1.2xlarge, trn1.32xlarge, trn1n.32xlarge, trn2.48xlarge, trn2u.48xlarge
    (in UltraServers), p5.48xlarge, cpu.
    On SageMaker HyperPod's EKS nodes, whose `node.kubernetes.io/instance-type` label reads
    `ml.<type>`, give the `ml.` name (`ml.trn1.32xlarge`): it is the same type, and the workers'
    node selector asks for the label as HyperPod sets it (`scheduling.nodeSelector` wins)."""
    processes_per_node: Annotated[int, Field(ge=1, le=MAX_PROCESSES_PER_NODE)] | None = None
    """Trainer processes per node; defaults to the instance type's (32 on trn1.32xlarge), and
    at most that on accelerator instances (one per NeuronCore or GPU)."""
    backend: Literal["auto", "cpu", "cuda", "neuron-native", "neuron-xla"] = "auto"
    """Device stack: auto picks neuron-xla on trn instances, cuda on p5, cpu on cpu."""
    neuron: NeuronSpec = Field(default_factory=NeuronSpec)
    """Neuron compiler/runtime settings, used by the neuron backends only."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """The decoder."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """Tensor/pipeline/sequence parallelism, ZeRO-1, activation checkpointing."""
    precision: Precision = Field(default="bf16-sr", json_schema_extra=_no_schema_default)
    """fp32, mixed (bf16 autocast, fp32 master), bf16 (round to nearest), bf16-sr (stochastic). Unset: as the paper ran the preset (7b bf16-sr, 70b mixed: awslabs/HLAT's scripts), else bf16-sr."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """AdamW and the learning-rate schedule."""
    data: DataSpec
    """Corpus, tokenizer, sequence length."""
    train: TrainSpec = Field(default_factory=TrainSpec)
    """Batch sizes and run length."""
    eval: EvalSpec | None = None
    """Held-out validation loss every eval.interval steps: in the step's log line, the
    heartbeat, status.progress and metrics. Unset: none."""
    evaluation: EvaluationSpec | None = None
    """Evaluation jobs on durable checkpoints, their results in status.evaluations and
    metrics. Unset: none."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpoint location and cadence."""
    storage: StorageSpec = Field(default_factory=StorageSpec)
    """Shared volume for data and checkpoints."""
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    """Restart policy."""
    elastic: ElasticSpec | None = None
    """Shrink to a smaller size that keeps the global batch when nodes are missing for
    elastic.waitSeconds, grow back at a checkpoint asked for once they return. Unset: the job
    waits for all its nodes. Not applied to a job in a Kueue queue."""
    suspend: bool = False
    """Delete the pods but keep progress (Kueue-compatible); false resumes."""
    active_deadline_seconds: PositiveInt | None = None
    """Fail the job after this many seconds since it started."""
    ttl_seconds_after_finished: Annotated[int, Field(ge=0)] | None = None
    """Delete the job this long after it Succeeded or Failed."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Placement extras."""
    template: PodTemplate | None = None
    """A PodTemplateSpec the worker pods are built on: service account, image pull secrets,
    env, volumes, labels, tolerations, affinity, priority class, security context, resources,
    sidecars. Its container named `trainer` is merged into the worker's container."""

    # --- derived quantities (pure functions of the spec) -------------------------------------

    @property
    def ranks_per_node(self) -> int:
        return self.processes_per_node or INSTANCE_TYPES[self.instance_type].ranks_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def snapshot_interval(self) -> PositiveInt | Literal["auto"] | None:
        """checkpoint.memoryInterval in effect: as set; unset, auto where in-memory snapshots
        can serve (`snapshots_refused` finds nothing), else None; off: None."""
        every = self.checkpoint.memory_interval
        if every == "off":
            return None
        if every is None:  # on neuron-xla only when set: that path has not run on Trainium
            return "auto" if snapshots_refused(self) is None and not uses_nxd(self) else None
        return every

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.parallelism.tensor * self.parallelism.pipeline)

    @property
    def micro_batches_per_step(self) -> int:
        """The micro-batches of a step's global batch, over all data-parallel ranks."""
        return self.train.global_batch // self.train.micro_batch

    def micro_batches(self, dp_rank: int) -> int:
        """How many micro-batches data-parallel rank `dp_rank` trains each step."""
        return len(micro_batch_share(self.micro_batches_per_step, self.data_parallel, dp_rank))

    @property
    def grad_accum_steps(self) -> int:
        """The most micro-batches a rank trains each step (rank 0's): what a step waits for."""
        return self.micro_batches(0)

    @property
    def uneven(self) -> bool:
        """Whether the ranks train different numbers of micro-batches a step."""
        return self.micro_batches_per_step % self.data_parallel != 0

    @property
    def total_steps(self) -> int:
        if self.train.steps is not None:
            return self.train.steps
        assert self.train.tokens is not None  # guaranteed by validation
        return math.ceil(self.train.tokens / (self.train.global_batch * self.data.seq_len))

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.data.seq_len

    def sizes(self, min_nodes: int = 1) -> list[int]:
        """The node counts from `nodes` down to `min_nodes` this job can train at with the
        same global batch, largest first: the ranks split into whole tensor x pipeline groups
        and every data-parallel rank gets at least one micro-batch (where the degree does not
        divide the micro-batches, some ranks train one more: `speed_at`). What an elastic run
        may shrink to (a loss of one node of 64 with the paper's 7B layout: 63)."""
        model_ranks = self.parallelism.tensor * self.parallelism.pipeline
        fits = []
        for nodes in range(self.nodes, max(min_nodes, 1) - 1, -1):
            world = nodes * self.ranks_per_node
            if world % model_ranks == 0 and world // model_ranks <= self.micro_batches_per_step:
                fits.append(nodes)
        return fits

    def at_size(self, nodes: int | None) -> PretrainJobSpec:
        """The spec an attempt at `nodes` runs (None: `nodes` itself). It has no `elastic`:
        at its own size it need allow no smaller one."""
        if nodes is None or nodes == self.nodes:
            return self
        return self.model_copy(update={"nodes": nodes, "elastic": None})

    def at_world(self, world_size: int) -> PretrainJobSpec:
        """An elastic spec at the size its processes were started at (`world_size` ranks:
        torchrun's WORLD_SIZE), where that is one of its `sizes`: the trainers of a job
        resized in place (their pods kept, the ConfigMap still the spec as written) learn the
        size from the world their launcher started. Any other spec, or a size it does not
        allow, is returned as it is (the world check then says what does not match)."""
        e, per_node = self.elastic, self.ranks_per_node
        if e is None or world_size % per_node or world_size == self.world_size:
            return self
        nodes = world_size // per_node
        return self.at_size(nodes) if nodes in self.sizes(e.min_nodes) else self

    def speed_at(self, nodes: int) -> float:
        """Steps per second at `nodes`, relative to `self.nodes` (compute-bound, collectives
        aside): a step takes as long as the most micro-batches a rank trains. The paper's 7B
        (1024 micro-batches, 4 data-parallel ranks a node) on 63 of its 64 nodes: 4/5."""
        return self.grad_accum_steps / self.model_copy(update={"nodes": nodes}).grad_accum_steps

    # --- cross-field validation ---------------------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def _default_layout(cls, raw: Any) -> Any:
        """Unset `parallelism.tensor`, `sequenceParallel`, `activationCheckpointing` and
        `precision` become the paper's for the preset (`_with_paper_defaults`)."""
        if not isinstance(raw, dict):
            return raw
        raw = _with_ultraserver_placement(_hyperpod_instance_type(raw))
        try:
            return _with_paper_defaults(raw)
        except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
            return raw  # the field's own validation reports what is wrong

    @model_validator(mode="after")
    def _check(self) -> PretrainJobSpec:
        for check in _CHECKS:
            check(self)
        return self


def _field(raw: dict[str, Any], camel: str) -> Any:
    """A raw field by its camelCase alias or its snake_case name."""
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)
    return raw.get(camel, raw.get(snake))


def _hyperpod_instance_type(raw: dict[str, Any]) -> dict[str, Any]:
    """`instanceType: ml.trn1.32xlarge` (HyperPod's name) is `trn1.32xlarge` whose nodes are
    selected by the label HyperPod sets, `node.kubernetes.io/instance-type: ml.trn1.32xlarge`."""
    name = _field(raw, "instanceType")
    if not isinstance(name, str) or name not in HYPERPOD_INSTANCE_TYPES:
        return raw
    out = {k: v for k, v in raw.items() if k not in ("instanceType", "instance_type")}
    out["instanceType"] = canonical_instance_type(name)
    scheduling = _field(raw, "scheduling")
    if scheduling is None or isinstance(scheduling, dict):
        scheduling = dict(scheduling or {})
        key = "nodeSelector" if "nodeSelector" in scheduling or \
            "node_selector" not in scheduling else "node_selector"
        selector = scheduling.get(key)
        if selector is None or isinstance(selector, dict):
            scheduling[key] = {INSTANCE_TYPE_LABEL: name, **(selector or {})}
        out["scheduling"] = scheduling
    return out


ULTRASERVER_LABEL: Final = "neuron.amazonaws.com/ultraserver-{}-{}"
"""The Neuron device plugin's UltraServer node labels (aws-neuron-sdk deploy/eks/ultraserver.rst
337-363): `server-id-N` names a node's N-node group, `node-id-N` its place in it."""


def _with_ultraserver_placement(raw: dict[str, Any]) -> dict[str, Any]:
    """A trn2u.48xlarge job with no `scheduling.topology` (and not elastic) is placed on whole
    UltraServer groups of the size its launchers will run (the largest of 4 and 2 dividing
    `nodes`: `neuron_env.ultraserver_node_config`), ranks in (server id, node id) order:
    `preferred` on `server-id-N` in slices of N. One node per group (an odd count) needs none."""
    scheduling = _field(raw, "scheduling")
    instance = _field(raw, "instanceType")
    if (not isinstance(instance, str) or instance not in ULTRASERVER_INSTANCE_TYPES
            or _field(raw, "elastic") is not None
            or not isinstance(scheduling, dict | None)
            or (scheduling and _field(scheduling, "topology") is not None)):
        return raw
    nodes = _field(raw, "nodes") or 1
    size = ultraserver_group_size(nodes) if isinstance(nodes, int) and nodes > 0 else 1
    if size == 1:
        return raw
    server, node = (ULTRASERVER_LABEL.format(k, size) for k in ("server-id", "node-id"))
    return {**raw, "scheduling": {**(scheduling or {}), "topology": {
        "preferred": server, "levels": [server, node], "sliceSize": size}}}


def _with_paper_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    par = _field(raw, "parallelism")
    if par is None:
        par = {}
    if not isinstance(par, dict):
        return raw
    model = _field(raw, "model") or {}
    preset = model.get("preset", "7b")
    instance = _field(raw, "instanceType") or "trn1.32xlarge"
    out, par = dict(raw), dict(par)
    out["parallelism"] = par
    if _field(par, "tensor") is None:
        ranks = _field(raw, "processesPerNode") or INSTANCE_TYPES[instance].ranks_per_node
        par["tensor"] = default_tensor(ModelSpec.model_validate(model).dims(), preset, ranks)
    if _field(raw, "precision") is None:
        out["precision"] = PAPER_PRECISION.get(preset or "", "bf16-sr")
    if not instance.startswith("trn"):
        return out
    if _field(par, "sequenceParallel") is None:
        par["sequenceParallel"] = _field(par, "tensor") > 1
    if _field(par, "activationCheckpointing") is None:
        # selective, as the paper; full where selective would not fit (its figures are the
        # memory check's: a spec that fails for another reason fails the same way with full)
        par["activationCheckpointing"] = "selective"
        try:
            PretrainJobSpec.model_validate(out)
        except ValidationError:
            par["activationCheckpointing"] = "full"
    return out


def default_tensor(dims: ModelDims, preset: str | None, ranks_per_node: int) -> int:
    """The paper's tensor-parallel degree for the preset (PAPER_TENSOR_PARALLEL), halved until
    it fits one node and divides the heads (and divides, or is a multiple of, the kv heads)."""
    tp = min(PAPER_TENSOR_PARALLEL.get(preset or "", 1), ranks_per_node)
    while tp > 1 and (dims.heads % tp or (dims.kv_heads % tp and tp % dims.kv_heads)
                      or ranks_per_node % tp):
        tp //= 2
    return max(tp, 1)


def _check_model(spec: PretrainJobSpec) -> None:
    """The model's dimensions (the preset's with the overrides; without a preset, every one
    given): `hiddenSize` divisible by `heads`, an even head dimension (RoPE), `heads` a multiple
    of `kvHeads`."""
    d = spec.model.dims()
    if d.hidden_size % d.heads:
        raise SpecError(
            "model.hiddenSize", f"{d.hidden_size} is not divisible by heads={d.heads}"
        )
    if d.head_dim % 2:
        raise SpecError("model.heads", f"head dim {d.head_dim} must be even for RoPE")
    if d.heads % d.kv_heads:
        raise SpecError("model.kvHeads", f"heads={d.heads} must be a multiple of kvHeads={d.kv_heads}")


def _check_parallelism(spec: PretrainJobSpec) -> None:
    """`parallelism.pipeline` is 1; `parallelism.tensor` divides the heads, divides the kv
    heads or is a multiple of them, and is at most one node's ranks; `nodes` x ranks per node
    is divisible by tensor x pipeline."""
    d, p = spec.model.dims(), spec.parallelism
    if p.pipeline != 1:
        raise SpecError("parallelism.pipeline", "pipeline parallelism is not supported yet: set 1")
    if d.heads % p.tensor:
        raise SpecError(
            "parallelism.tensor",
            f"{p.tensor} does not divide the model's {d.heads} attention heads: "
            f"use a divisor of {d.heads}",
        )
    if d.kv_heads % p.tensor and p.tensor % d.kv_heads:
        raise SpecError(
            "parallelism.tensor",
            f"{p.tensor} neither divides the model's {d.kv_heads} key/value heads (each rank "
            f"owning whole kv heads) nor is a multiple of them (each kv head replicated on "
            f"tensor / kvHeads ranks): use a divisor or a multiple of {d.kv_heads}",
        )
    if p.tensor > spec.ranks_per_node:
        raise SpecError(
            "parallelism.tensor",
            f"{p.tensor} exceeds the {spec.ranks_per_node} ranks of one {spec.instance_type} "
            "node: tensor parallelism stays within a node",
        )
    model_ranks = p.tensor * p.pipeline
    if spec.world_size % model_ranks:
        raise SpecError(
            "nodes",
            f"{spec.nodes} nodes x {spec.ranks_per_node} ranks = {spec.world_size} ranks, "
            f"not divisible by tensor x pipeline = {model_ranks}",
        )


def _check_batch(spec: PretrainJobSpec) -> None:
    """`train.globalBatch` is divisible by `microBatch` and gives every data-parallel rank at
    least one micro-batch; exactly one of `train.steps` and `train.tokens` is given."""
    t, dp = spec.train, spec.data_parallel
    if t.global_batch % t.micro_batch:
        raise SpecError(
            "train.globalBatch",
            f"{t.global_batch} is not divisible by microBatch {t.micro_batch}",
        )
    if spec.micro_batches_per_step < dp:
        raise SpecError(
            "train.globalBatch",
            f"{t.global_batch} sequences make {spec.micro_batches_per_step} micro-batches of "
            f"microBatch {t.micro_batch}, fewer than the {dp} data-parallel ranks: each needs "
            f"at least one (raise globalBatch to {t.micro_batch * dp} or more, or lower "
            "microBatch or nodes)",
        )
    if (t.steps is None) == (t.tokens is None):
        raise SpecError("train", "give exactly one of train.steps or train.tokens")


def _check_lengths(spec: PretrainJobSpec) -> None:
    """`data.seqLen` at most the model's `maxSeqLen`; `optimizer.minLr` at most `lr`;
    `optimizer.warmupSteps` at most the run's steps; the backoff's `initialSeconds` at most its
    `maxSeconds`."""
    d = spec.model.dims()
    if spec.data.seq_len > d.max_seq_len:
        raise SpecError(
            "data.seqLen", f"{spec.data.seq_len} exceeds the model's maxSeqLen {d.max_seq_len}"
        )
    o = spec.optimizer
    if o.min_lr > o.lr:
        raise SpecError("optimizer.minLr", f"{o.min_lr} is above optimizer.lr {o.lr}")
    if o.warmup_steps > spec.total_steps:
        raise SpecError(
            "optimizer.warmupSteps",
            f"{o.warmup_steps} exceeds the run's {spec.total_steps} steps: lower it",
        )
    b = spec.fault_tolerance.backoff
    if b.initial_seconds > b.max_seconds:
        raise SpecError("faultTolerance.backoff.initialSeconds", "is above maxSeconds")


def uses_nxd(spec: PretrainJobSpec) -> bool:
    """Whether the spec runs on the neuron-xla stack (explicitly, or `auto` on trn)."""
    return spec.backend == "neuron-xla" or (
        spec.backend == "auto" and spec.instance_type.startswith("trn"))


def estimate_state_bytes_per_rank(spec: PretrainJobSpec) -> float:
    """Weights, gradients and optimizer state on one rank (hlat_api.memory)."""
    p = spec.parallelism
    return state_bytes_per_rank(spec.model.dims(), tp=p.tensor * p.pipeline,
                                dp=spec.data_parallel, precision=spec.precision,
                                managed=uses_nxd(spec), zero1=p.zero1)


SNAPSHOT_AUTO_SHARE = 0.01
"""checkpoint.memoryInterval auto: the share of the training time snapshots may hold the loop."""
SNAPSHOT_AUTO_PROBE_STEPS = 3
"""... measured on the snapshot after this many steps of an attempt (the first are slower)."""
SNAPSHOTS_KEPT = 2
"""In-memory snapshots a rank keeps: the newest, and the one before while the next is written."""
SNAPSHOT_MEMORY_SHARE = 0.5
"""At most this share of a node's memory (the worker's request) may hold snapshots: the rest
is the trainers' own (processes, the data loader, an asynchronous save's staged copy)."""


def snapshot_gib_per_node(spec: PretrainJobSpec) -> float:
    """Host memory a node's in-memory snapshots take: SNAPSHOTS_KEPT of each of its ranks, and
    as many copies of its predecessor's (checkpoint.memoryReplicas)."""
    p = spec.parallelism
    one = snapshot_bytes_per_rank(spec.model.dims(), tp=p.tensor * p.pipeline,
                                  dp=spec.data_parallel, precision=spec.precision,
                                  zero1=p.zero1, managed=uses_nxd(spec))
    copies = 1 + (spec.checkpoint.memory_replicas if spec.nodes > 1 else 0)
    return copies * SNAPSHOTS_KEPT * one * spec.ranks_per_node / GIB


def snapshots_refused(spec: PretrainJobSpec) -> SpecError | None:
    """Why in-memory snapshots cannot serve this spec, or None: they need restarts in place
    and room in their share of the node's memory."""
    if spec.fault_tolerance.restart_strategy != "InPlace":
        return SpecError("checkpoint.memoryInterval",
                         "in-memory snapshots serve restarts in place: set "
                         "faultTolerance.restartStrategy: InPlace (a recreated gang starts on "
                         "new pods, with none of the old pods' memory), or set it off")
    memory = INSTANCE_TYPES[spec.instance_type].memory
    if memory is None:
        return None
    node_gib = _gib(memory)
    need = snapshot_gib_per_node(spec)
    if need > SNAPSHOT_MEMORY_SHARE * node_gib:
        # what shrinks a rank's snapshot: on NxD a rank keeps its weights whole (its tp
        # slice), so more nodes (a higher dp) cut only a ZeRO-1 optimizer shard
        shard = ("parallelism.zero1, a higher parallelism.tensor" if uses_nxd(spec) else
                 "parallelism.zero1, a higher parallelism.tensor, more nodes")
        return SpecError(
            "checkpoint.memoryInterval",
            f"in-memory snapshots need {need:.0f} GiB per node ({SNAPSHOTS_KEPT} per rank, "
            f"{spec.ranks_per_node} ranks, and as many of a peer's with memoryReplicas), over "
            f"{SNAPSHOT_MEMORY_SHARE:.0%} of a {spec.instance_type}'s {node_gib:g} GiB: set it "
            f"off, set checkpoint.memoryReplicas: 0, or shard the state more ({shard})")
    return None


def _check_snapshots(spec: PretrainJobSpec) -> None:
    """checkpoint.memoryInterval, when set: snapshots can serve the spec (unset, they are on
    only where they can: `PretrainJobSpec.snapshot_interval`)."""
    if spec.checkpoint.memory_interval in (None, "off"):
        return
    refused = snapshots_refused(spec)
    if refused is not None:
        raise refused


def _gib(quantity: str) -> float:
    """A Kubernetes memory quantity (Gi, Mi) in GiB."""
    units = {"Gi": 1.0, "Mi": 1 / 1024, "Ti": 1024.0}
    for suffix, scale in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * scale
    return float(quantity) / GIB


def memory_layout(spec: PretrainJobSpec) -> Layout:
    """What the activation estimate reads from the spec. Attention is eager (s x s scores
    kept) on NxD (nxd_model.CoreAttention) and on neuron-native (counted as SDPA's math
    path: whether TorchNeuron fuses it is not known here); fused (SDPA's flash or
    memory-efficient kernel) on CUDA."""
    p = spec.parallelism
    managed = uses_nxd(spec)
    return Layout(seq_len=spec.data.seq_len, micro_batch=spec.train.micro_batch,
                  tp=p.tensor * p.pipeline, sequence_parallel=p.sequence_parallel,
                  checkpointing=p.activation_checkpointing, precision=spec.precision,
                  managed=managed, zero1=p.zero1,
                  eager_attention=accelerator(spec.instance_type) != "p5")


def memory_estimate(spec: PretrainJobSpec) -> Estimate | None:
    """A rank's peak against its device memory; None where the instance type is not checked."""
    capacity = INSTANCE_TYPES[spec.instance_type].device_memory_gib
    if capacity is None:
        return None
    act = activation_bytes(spec.model.dims(), memory_layout(spec)).total
    return Estimate(estimate_state_bytes_per_rank(spec) / GIB, act / GIB,
                    reserve_gib(spec.instance_type), capacity)


def _memory_advice(spec: PretrainJobSpec, est: Estimate) -> tuple[str, list[str]]:
    """The field to name and what to change, the biggest lever first."""
    p, advice = spec.parallelism, []
    state_bound = est.state + est.reserve > est.capacity
    if not state_bound and ((not p.sequence_parallel and p.tensor > 1)
                            or p.activation_checkpointing == "none"):
        advice.append("turn on parallelism.sequenceParallel and activationCheckpointing: "
                      "selective")
    elif not state_bound and p.activation_checkpointing == "selective":
        advice.append("set parallelism.activationCheckpointing: full")
    tensor_up = (2 * p.tensor <= spec.ranks_per_node
                 and spec.model.dims().heads % (2 * p.tensor) == 0)
    if tensor_up:
        advice.append("raise parallelism.tensor")
    if spec.train.micro_batch > 1:
        advice.append("lower train.microBatch")
    advice.append("add nodes (ZeRO-1 shards the optimizer state over data-parallel ranks)"
                  if p.zero1 else "enable parallelism.zero1")
    if spec.precision in ("mixed", "fp32"):
        advice.append("use precision bf16-sr (smaller weights, gradients and activations)")
    if state_bound:
        field = "parallelism.tensor" if tensor_up else "nodes"
    elif not p.sequence_parallel and p.tensor > 1:
        field = "parallelism.sequenceParallel"
    elif p.activation_checkpointing != "full":
        field = "parallelism.activationCheckpointing"
    else:
        field = "parallelism.tensor"
    return field, advice


def _check_memory(spec: PretrainJobSpec) -> None:
    """On trn and p5, a rank's estimated peak (model state, activations and the runtime's
    reserve: `hlat_api.memory`) fits its NeuronCore's or GPU's memory; the error names the field
    to change first (`parallelism.tensor`, `sequenceParallel`, `activationCheckpointing` or
    `nodes`) and lists every change that would help."""
    est = memory_estimate(spec)
    if est is None or est.fits:
        return
    p = spec.parallelism
    unit = "GPU" if accelerator(spec.instance_type) == "p5" else "NeuronCore"
    field, advice = _memory_advice(spec, est)
    raise SpecError(
        field,
        f"needs about {est.total:.1f} GiB per {unit} but a {spec.instance_type} {unit} has "
        f"{est.capacity:g} GiB: {est.state:.1f} GiB model state ({spec.precision}, tensor "
        f"{p.tensor}, data-parallel {spec.data_parallel}, zero1 {str(p.zero1).lower()}) + "
        f"{est.activations:.1f} GiB activations (seqLen {spec.data.seq_len}, microBatch "
        f"{spec.train.micro_batch}, sequenceParallel {str(p.sequence_parallel).lower()}, "
        f"activationCheckpointing {p.activation_checkpointing}) + {est.reserve:.1f} GiB "
        f"runtime reserve (hlat_api.memory; docs/neuron.md, \"Memory per rank\"). To fit: "
        + "; or ".join(advice),
    )


def accelerator(instance_type: str) -> str:
    """The key of `BACKENDS_BY_ACCELERATOR` an instance type falls under."""
    return next(k for k in BACKENDS_BY_ACCELERATOR if instance_type.startswith(k))


def _check_devices(spec: PretrainJobSpec) -> None:
    """`backend` is one the instance type's devices run (trn: neuron-xla or neuron-native,
    p5: cuda, cpu: cpu; or auto), and `processesPerNode` is at most its NeuronCores or GPUs."""
    kind = accelerator(spec.instance_type)
    allowed = BACKENDS_BY_ACCELERATOR[kind]
    if spec.backend != "auto" and spec.backend not in allowed:
        raise SpecError(
            "backend",
            f"{spec.backend} cannot run on {spec.instance_type}: use "
            f"{' or '.join(allowed)} (or auto), or another instanceType",
        )
    devices = INSTANCE_TYPES[spec.instance_type].ranks_per_node
    if kind != "cpu" and spec.processes_per_node is not None and spec.processes_per_node > devices:
        raise SpecError(
            "processesPerNode",
            f"{spec.processes_per_node} exceeds the {devices} "
            f"{'GPUs' if kind == 'p5' else 'NeuronCores'} of one {spec.instance_type}: one "
            "process per device at most",
        )


def _check_image(spec: PretrainJobSpec) -> None:
    """The template's `trainer` container names no image other than `image`: set one of them."""
    theirs = spec.template.trainer().get("image") if spec.template else None
    if theirs and spec.image and theirs != spec.image:
        raise SpecError(
            "template.spec.containers",
            f"the trainer container's image {theirs!r} differs from spec.image {spec.image!r}: "
            "set one of them",
        )


def _check_spares(spec: PretrainJobSpec) -> None:
    """`faultTolerance.spareNodes` needs `faultTolerance.restartStrategy: InPlace`, and an
    instance type whose nodes can stand in for each other (not an UltraServer's)."""
    ft = spec.fault_tolerance
    if ft.spare_nodes and ft.restart_strategy != "InPlace":
        raise SpecError("faultTolerance.spareNodes", f"{ft.spare_nodes} spare nodes need "
                        "faultTolerance.restartStrategy: InPlace (a gang that is recreated "
                        "has no use for them)")
    if ft.spare_nodes and canonical_instance_type(spec.instance_type) in ULTRASERVER_INSTANCE_TYPES:
        raise SpecError("faultTolerance.spareNodes", "trn2u.48xlarge takes no spare nodes: "
                        "NeuronLink joins the fixed nodes of an UltraServer, and a spare cannot "
                        "take one of their places (set spareNodes to 0)")


def _check_slices(spec: PretrainJobSpec) -> None:
    """`scheduling.topology.sliceSize` divides `nodes`, and no elastic size is asked of it."""
    topo = spec.scheduling.topology
    size = topo.slice_size if topo is not None else None
    if size is None:
        return
    if spec.nodes % size:
        raise SpecError("scheduling.topology.sliceSize", f"{size} does not divide nodes "
                        f"({spec.nodes}): the gang is placed in whole slices")
    if spec.elastic is not None:
        raise SpecError("scheduling.topology.sliceSize", "is not taken with elastic: a size "
                        "between minNodes and nodes may not be whole slices (remove one)")


def _check_elastic(spec: PretrainJobSpec) -> None:
    """Not on the neuron-xla stack; `elastic.minNodes` at most `nodes`, and some size from it
    to nodes - 1 that keeps the global batch (`PretrainJobSpec.sizes`)."""
    e = spec.elastic
    if e is None:
        return
    if uses_nxd(spec):
        raise SpecError(
            "elastic", "the neuron-xla stack resumes only the layout its checkpoint was saved "
            "with (NxD keeps the optimizer's ZeRO-1 shards per data-parallel rank), and a "
            "resize changes it: drop elastic, or set backend: neuron-native (the torch-native "
            "stack reshards at any size)")
    if e.min_nodes > spec.nodes:
        raise SpecError("elastic.minNodes", f"{e.min_nodes} is more than nodes ({spec.nodes})")
    if len(spec.sizes(e.min_nodes)) < 2:
        raise SpecError(
            "elastic.minNodes",
            f"no size from {e.min_nodes} to {spec.nodes - 1} nodes keeps train.globalBatch "
            f"{spec.train.global_batch} (whole tensor x pipeline groups, at least one "
            f"micro-batch per data-parallel rank); the sizes this spec allows: {spec.sizes()}")


def _check_eval(spec: PretrainJobSpec) -> None:
    """`eval.path` is not the training data itself (a validation loss on data the model
    trains on measures nothing held out)."""
    if spec.eval is not None and spec.eval.path.rstrip("/") == spec.data.path.rstrip("/"):
        raise SpecError("eval.path", f"{spec.eval.path} is data.path: give held-out files the "
                        "training data does not include")


def evaluation_due(spec: PretrainJobSpec, step: int) -> bool:
    """Whether the durable checkpoint of `step` gets an evaluation Job (spec.evaluation): every
    `every` x checkpoint.interval steps, and the last."""
    ev = spec.evaluation
    if ev is None or step <= 0:
        return False
    return step % (ev.every * spec.checkpoint.interval) == 0 or step >= spec.total_steps


def _check_evaluation(spec: PretrainJobSpec) -> None:
    """The default evaluator, hlat-eval, takes the loss of spec.eval's held-out set."""
    ev = spec.evaluation
    if ev is not None and ev.command and ev.command[0] == "hlat-eval" and spec.eval is None:
        raise SpecError("evaluation.command", "hlat-eval (the default) takes the loss of the "
                        "held-out set: set eval.path, or give your own evaluator's command")


_CHECKS = (_check_image, _check_devices, _check_model, _check_parallelism, _check_batch,
           _check_lengths, _check_memory, _check_spares, _check_eval, _check_elastic,
           _check_slices,
           _check_snapshots, _check_evaluation)
