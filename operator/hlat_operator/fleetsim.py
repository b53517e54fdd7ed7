"""Fleet simulator: uptime and goodput of a weeks-long pretraining job under faults, with and
without automatic recovery, and the checkpoint interval that maximises goodput.

Why it exists: the paper's Table 1 (98.81% uptime with automatic fault recovery, 77.83% without,
64 trn1.32xlarge) is one pair of figures from two runs. This module turns fault rates, detection
and recovery times and checkpoint costs into such figures, so that each input can be questioned
and varied (`hlat-fleet-sim --help`; docs/benchmarks.md, the fleet simulator's section, lists the defaults' sources).

The model (Monte Carlo over independent runs; numpy only; seeded, so deterministic):
- Faults arrive while the gang runs: independent Poisson processes per kind whose rates add up
  to nodes / node MTBF. Arrivals are drawn in the gang's own running clock, so runs with and
  without recovery on one seed meet the same faults at the same points of training (a gang that
  is down does not fail again; faults during a restart are not modelled).
- A fault costs its detection (crash: at once; hang: the heartbeat timeout; node lost: the node
  lifecycle grace) and its recovery (the longer of teardown and backoff, then the new gang's
  start up to its first step). Without automatic recovery a person restarts the job instead of
  the operator: after a response time (exponential) from the fault when it falls in working
  hours, from the start of the next working day otherwise; the restart itself costs the same.
- Training alternates `interval` seconds of steps with a save that blocks `block` seconds. A
  save is complete `complete` seconds after it began (sync: when it stops blocking; async: after
  its background write; the next save waits for it). A fault loses the training done since the
  last complete save.
- uptime = up / (up + down), where up is all the time the gang runs (steps, recomputed steps,
  saves): the paper's measure and `accounting.uptime_after`'s. One difference: the operator
  counts a gang as running from when its pods run, so its own ratio also counts the in-pod start
  (compile-cache and checkpoint load) and the detection time as up.
  goodput = training seconds that count (not recomputed) / wall seconds.
- Recovery paths (issue 34, `RecoveryPath`): where a restart resumes from per fault kind (its
  own node's in-memory snapshot, a peer's replica of it, or the durable checkpoint), what it
  then loses (the training since that state) and what the restart costs (the load of that
  state). Evaluated on the same faults as the durable-only baseline (`evaluate_path`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from hlat_api.memory import bytes_per_param, params_per_rank, snapshot_bytes_per_rank
from hlat_api.spec import FaultToleranceSpec, ModelSpec
from hlat_operator.config import OperatorSettings

FaultKind = Literal["crash", "hang", "node_lost"]
KINDS: tuple[FaultKind, ...] = ("crash", "hang", "node_lost")
Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
HOUR, DAY = 3600.0, 86400.0

# --- published inputs --------------------------------------------------------------------------

PAPER_UPTIME_WITH, PAPER_UPTIME_WITHOUT, PAPER_NODES = 0.9881, 0.7783, 64
"""HLAT paper, Table 1, on up to 64 trn1.32xlarge. The run without recovery was another,
600B-token experimental run."""

LLAMA3_DAYS, LLAMA3_HOSTS, LLAMA3_UNEXPECTED, LLAMA3_HARDWARE = 54.0, 2048, 419, 0.78
"""Llama 3 ("The Llama 3 Herd of Models", 2024, section 3.3.4): 466 job interruptions in a
54-day snapshot on 16,384 H100 GPUs (2,048 hosts of 8), 47 of them planned maintenance, 419
unexpected; about 78% of the unexpected ones attributed to hardware."""

LLAMA3_ROOT_CAUSES: dict[str, tuple[int, FaultKind]] = {
    "faulty GPU": (148, "crash"), "GPU HBM3 memory": (72, "crash"), "software bug": (54, "crash"),
    "network switch/cable": (35, "hang"), "host maintenance": (32, "node_lost"),
    "GPU SRAM memory": (19, "crash"), "GPU system processor": (17, "crash"), "NIC": (7, "hang"),
    "NCCL watchdog timeouts": (7, "hang"), "silent data corruption": (6, "crash"),
    "GPU thermal interface + sensor": (6, "crash"), "SSD": (3, "node_lost"),
    "power supply": (3, "node_lost"), "server chassis": (2, "node_lost"),
    "IO expansion board": (2, "node_lost"), "dependency": (2, "crash"), "CPU": (2, "node_lost"),
    "system memory": (2, "node_lost"),
}
"""Llama 3's Table 5 (the 419 unexpected interruptions by root cause) and how each shows to the
operator. The mapping is ours, an assumption: device and software errors end the process, network
faults stall a collective until the heartbeat timeout, host failures take the node away."""

LLAMA3_SHARES: dict[FaultKind, float] = {
    kind: sum(n for n, k in LLAMA3_ROOT_CAUSES.values() if k == kind) / LLAMA3_UNEXPECTED
    for kind in KINDS
}

LLAMA3_PLANNED = 47
"""Llama 3, section 3.3.4: the planned interruptions of the 54 days (automated maintenance such
as firmware upgrades, or operators' configuration and dataset updates)."""

LLAMA3_EFFECTIVE = 0.90
"""Llama 3, section 3.3.4: effective training time (time spent on useful training over
elapsed time) was "higher than 90%" over the 54 days."""

LLAMA3_PARAMS, LLAMA3_STORAGE_BPS = 405e9, 2e12
"""Llama 3: the 405B model; its checkpoints go to Tectonic, "2 TB/s sustainable throughput"
(section 3.3.1, which also gives 1 MB to 4 GB of model state per GPU)."""

RSC_MTTF_1K_S, RSC_MTTF_16K_S, RSC_GPUS = 7.9 * 3600.0, 1.8 * 3600.0, (1024, 16384)
"""Meta's RSC study ("Revisiting Reliability in Large-Scale Machine Learning Research
Clusters", Kokolis et al., HPCA 2025, arXiv 2410.21680): mean time to failure of a job on
1,024 GPUs, 7.9 h (observed), and on 16,384 GPUs, 1.8 h (projected by its fitted model)."""

TRN1_CHIPS = 16
"""Trainium chips per trn1.32xlarge: 64 nodes hold 1,024 chips, 1,024 nodes 16,384. Comparing
them with RSC's GPU counts assumes a chip (and its share of the host) fails as often as an
A100 there: an assumption, no per-chip failure figure for Trainium being public."""

SYNC_SAVE_7B_S, ASYNC_SAVE_7B_S = 148.8, 6.3
"""Seconds a 7B checkpoint blocks training, synchronous vs asynchronous DCP save (PyTorch blog
"Reducing checkpointing times", via shared/reference/performance-anchors.md; docs/benchmarks.md's
checkpoint section measures the same mechanism locally; the earlier figures these defaults
were checked against, 8.12 s vs 2.27 s for 1.5 GiB, are in docs/benchmark-history.md)."""

NEAREST_PUBLISHED_GRAPH_LOAD_S = 40.0
"""The nearest published figure for `ClusterTimes.compile_cache_load_s`: an AWS maintainer
measured about 40 s to load Llama-2 7B on a trn1.32xlarge at tp 32 with a pre-populated
compilation cache, weights included (github.com/aws-neuron/transformers-neuronx issue 80).
That is inference: one forward graph, where training loads forward, backward and optimizer
graphs. So it is a lower bound for training, not an estimate of it."""

HLAT_STEP_S = 1024 * 4096 / (64 * 25_000)
"""Derived: the paper's step (1,024 sequences of 4,096 tokens) at about 25k tokens/s per
trn1.32xlarge (Llama2-7B on NxD, performance-anchors.md) on 64 nodes: 2.62 s."""

NXD_CHECKPOINT_STEPS = 1000
"""NxD's Llama pretraining example saves every 1,000 steps (shared/reference/neuron-eks.md)."""

_OPERATOR, _FT = OperatorSettings(), FaultToleranceSpec()


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultCost:
    """What one fault of a kind costs, in seconds."""

    detection_s: float
    """From the fault until the operator acts on it."""
    recovery_s: float
    """From then until the new gang's first training step."""


@dataclass(frozen=True)
class ClusterTimes:
    """The parts of a fault's cost on EKS with trn1.32xlarge nodes; `fault_costs` adds them up.
    Defaults: the operator's own defaults where it sets the time, the recovery figures of
    docs/benchmark-history.md section 5 where the local cluster measured the same mechanism,
    named assumptions elsewhere."""

    step_s: float = HLAT_STEP_S
    """Seconds per training step: the learned heartbeat timeout is a multiple of it."""
    crash_detection_s: float = 0.3
    """A failed pod is a watch event: measured on the local cluster (benchmarks section 5)."""
    node_monitor_grace_s: float = 40.0
    """Node lifecycle controller's grace before NotReady: 40 s by default on EKS (benchmarks
    section 5; the local rig uses 16 s and detects in 19.8 s)."""
    resync_s: float = _OPERATOR.resync_seconds
    """Operator resync: a lost node (found by polling node conditions) waits half of it on
    average; a hang does not (the operator's next pass is due when the first timeout runs out)."""
    heartbeat_floor_s: float = _OPERATOR.min_heartbeat_timeout_seconds
    """Floor of the learned heartbeat timeout (OperatorSettings)."""
    heartbeat_period_s: float = _OPERATOR.heartbeat_period_seconds
    """Lease renewal period, added to every heartbeat timeout (OperatorSettings)."""
    safety_factor: float = _FT.heartbeat.safety_factor
    """Learned timeout = step time x this (the spec's default)."""
    backoff_s: float = _FT.backoff.delay_seconds(0)
    """The restart's backoff, counted from the detection (reconcile): none, since a fault in
    steady training follows progress (BackoffSpec.delay_seconds)."""
    termination_grace_s: float = _OPERATOR.termination_grace_seconds
    """Assumption: a hung worker does not exit on SIGTERM, so its pod ends at the grace period."""
    force_delete_s: float = _OPERATOR.force_delete_after_seconds
    """Pods on a lost node stay Terminating until the operator force-deletes them."""
    process_start_s: float = 17.6
    """A gang's cold start on the local cluster, apply to first step (benchmarks section 5)."""
    compile_cache_load_s: float = 180.0
    """Assumption, no public figure found for training: loading the compiled graphs from the
    node's local Neuron persistent cache (where the paper keeps it) onto its 32 NeuronCores.
    The nearest published figure is `NEAREST_PUBLISHED_GRAPH_LOAD_S`."""
    checkpoint_load_s: float = SYNC_SAVE_7B_S
    """Assumption: reading a 7B checkpoint takes about as long as a synchronous save of it."""
    node_replacement_s: float = 0.0
    """Extra wait for a node to replace a lost one; 0 assumes a spare with a warm cache."""
    in_place_restart_s: float = 0.8
    """An in-place restart (restartStrategy InPlace: the launcher starts a new trainer in the
    same pod) from the end of the backoff to the first step, less the graph and state loads:
    measured on the local cluster, trainer SIGKILLed, 2.0 s fault -> next step less 0.2 s
    detection and the rig's 1 s backoff (benchmarks section 5; the hang case gives 0.9 s)."""
    spare_start_s: float = 1.8
    """A lost node's ranks restarting on a warm spare (spareNodes), from the end of the backoff
    to the first step, less the loads: measured on the local cluster, 18.9 s fault -> next step
    less 16.1 s detection and the 1 s backoff (benchmarks section 5)."""

    def heartbeat_timeout_s(self) -> float:
        learned = max(self.heartbeat_floor_s, self.safety_factor * self.step_s)
        return learned + self.heartbeat_period_s

    def gang_start_s(self) -> float:
        return self.process_start_s + self.compile_cache_load_s + self.checkpoint_load_s

    def fault_costs(self) -> dict[FaultKind, FaultCost]:
        start, poll = self.gang_start_s(), self.resync_s / 2
        return {
            "crash": FaultCost(self.crash_detection_s, self.backoff_s + start),
            "hang": FaultCost(self.heartbeat_timeout_s(),
                              max(self.backoff_s, self.termination_grace_s) + start),
            "node_lost": FaultCost(self.node_monitor_grace_s + poll,
                                   max(self.backoff_s, self.force_delete_s)
                                   + self.node_replacement_s + start),
        }

    def in_place_costs(self, load_s: Mapping[FaultKind, float],
                       node_lost_detection_s: float | None = None) -> dict[FaultKind, FaultCost]:
        """Per kind, with in-place restarts (what in-memory snapshots need): detection, then the
        backoff, the measured restart (in place for a crash or hang; on a warm spare for a lost
        node, which waits for no force-delete), the compiled graphs' load and `load_s[kind]`,
        the load of the state it resumes from. `node_lost_detection_s`: None for today's
        (node monitor grace + half a resync)."""
        detect = self.node_monitor_grace_s + self.resync_s / 2
        if node_lost_detection_s is not None:
            detect = node_lost_detection_s
        graphs = self.backoff_s + self.compile_cache_load_s
        return {
            "crash": FaultCost(self.crash_detection_s,
                               graphs + self.in_place_restart_s + load_s["crash"]),
            "hang": FaultCost(self.heartbeat_timeout_s(),
                              graphs + self.in_place_restart_s + load_s["hang"]),
            "node_lost": FaultCost(detect, graphs + self.spare_start_s + load_s["node_lost"]),
        }


@dataclass(frozen=True)
class People:
    """Who restarts the job when nothing restarts it automatically. Assumptions throughout."""

    response_s: float = 2 * HOUR
    """Mean (exponential) time from a fault in working hours to the restart: someone notices,
    looks and resubmits."""
    work_start_h: float = 9.0
    """Working hours start (local time, every day: weekends are not modelled, optimistically)."""
    work_end_h: float = 18.0
    """Working hours end; a fault after it waits for the next start. 0-24: on call round the clock."""

    def __post_init__(self) -> None:
        _check(self.response_s >= 0, "response_s", "must be >= 0")
        _check(0 <= self.work_start_h < self.work_end_h <= 24, "work_start_h/work_end_h",
               "need 0 <= start < end <= 24")

    def wait_s(self, hour: float) -> float:
        """Seconds until working hours, for a fault at `hour` (0-24)."""
        if self.work_start_h <= hour < self.work_end_h:
            return 0.0
        return ((self.work_start_h - hour) % 24) * HOUR


@dataclass(frozen=True)
class Scenario:
    """One job: its size, how long it runs, how it fails and who restarts it."""

    nodes: int = 64
    duration_s: float = 28 * DAY
    node_mtbf_s: float = math.inf
    """Mean running seconds between faults of one node (inf: no faults)."""
    shares: Mapping[FaultKind, float] = field(default_factory=lambda: dict(LLAMA3_SHARES))
    """Fraction of faults of each kind (normalised)."""
    costs: Mapping[FaultKind, FaultCost] = field(
        default_factory=lambda: ClusterTimes().fault_costs())
    auto_recovery: bool = True
    people: People = field(default_factory=People)
    start_hour: float = 9.0
    """Local time of day at which the job starts."""

    def __post_init__(self) -> None:
        _check(self.nodes > 0, "nodes", "must be > 0")
        _check(self.duration_s > 0, "duration_s", "must be > 0")
        _check(self.node_mtbf_s > 0, "node_mtbf_s", "must be > 0")
        _check(set(self.shares) == set(KINDS) and all(v >= 0 for v in self.shares.values())
               and sum(self.shares.values()) > 0, "shares", f"need one value >= 0 per {KINDS}")
        _check(all(c.detection_s >= 0 and c.recovery_s >= 0 for c in self.costs.values())
               and set(self.costs) == set(KINDS), "costs", "need seconds >= 0 for each kind")

    @property
    def job_rate(self) -> float:
        """Faults per running second of the whole gang."""
        return self.nodes / self.node_mtbf_s

    def mean_down_s(self) -> float:
        """Expected down seconds per fault with automatic recovery (weighted by kind)."""
        total = sum(self.shares.values())
        return sum(self.shares[k] / total * (self.costs[k].detection_s + self.costs[k].recovery_s)
                   for k in KINDS)


@dataclass(frozen=True)
class Checkpointing:
    """When and how the trainer saves."""

    interval_s: float
    """Training seconds between two saves."""
    block_s: float
    """Seconds a save blocks training (sync: all of it; async: the copy to host memory)."""
    complete_s: float
    """Seconds from a save's start until it can be resumed from (sync: block_s)."""

    def __post_init__(self) -> None:
        _check(self.interval_s > 0, "interval_s", "must be > 0")
        _check(0 <= self.block_s <= self.complete_s, "block_s/complete_s",
               "need 0 <= block_s <= complete_s")

    @property
    def blocking_s(self) -> float:
        """Seconds blocked per save: an async save also waits for the previous one's write."""
        return max(self.block_s, self.complete_s - self.interval_s)


def sync_saves(interval_s: float, block_s: float = SYNC_SAVE_7B_S) -> Checkpointing:
    return Checkpointing(interval_s, block_s, block_s)


def async_saves(interval_s: float, block_s: float = ASYNC_SAVE_7B_S,
                complete_s: float = SYNC_SAVE_7B_S) -> Checkpointing:
    return Checkpointing(interval_s, block_s, max(block_s, complete_s))


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


# --- fault rates -------------------------------------------------------------------------------

Rate = Literal["hlat", "llama3", "llama3-hw", "rsc-1k", "rsc-16k"]


def llama3_node_mtbf_s(hardware_only: bool = False) -> float:
    """Mean seconds between unexpected interruptions per host in Llama 3's snapshot."""
    faults = LLAMA3_UNEXPECTED * (LLAMA3_HARDWARE if hardware_only else 1.0)
    return LLAMA3_DAYS * DAY * LLAMA3_HOSTS / faults


def rsc_node_mtbf_s(gpus: int) -> float:
    """A node's mean running seconds between faults from RSC's job MTTF at `gpus` (1,024 or
    16,384), TRN1_CHIPS accelerators a node. The two imply different per-node rates: 7.9 h x 64
    nodes = 506 h, 1.8 h x 1,024 nodes = 1,843 h (RSC's fit grows slower than linearly with
    the job's size). Each is used at its own size: the 1,024-GPU one for 64 trn1 nodes, the
    16,384-GPU one for 1,024 nodes."""
    mttf = dict(zip(RSC_GPUS, (RSC_MTTF_1K_S, RSC_MTTF_16K_S), strict=True))
    _check(gpus in mttf, "gpus", f"RSC publishes {RSC_GPUS}, not {gpus}")
    return mttf[gpus] * gpus / TRN1_CHIPS


def fitted_node_mtbf_s(scenario: Scenario, target_uptime: float = PAPER_UPTIME_WITH) -> float:
    """The node MTBF at which the expected uptime with recovery is `target_uptime`: with faults
    at rate r per running second and D down seconds each, uptime = 1 / (1 + r D). A fitted input,
    not a prediction: it depends on the assumed D as much as on the target."""
    _check(0 < target_uptime < 1, "target_uptime", "must be between 0 and 1")
    rate = (1 / target_uptime - 1) / scenario.mean_down_s()
    return scenario.nodes / rate


def node_mtbf_for(rate: Rate, scenario: Scenario, target_uptime: float) -> float:
    """A node's MTBF by `rate`; the hlat fit is made for the paper's 64 nodes, so that another
    gang size keeps the per-node rate."""
    if rate == "hlat":
        return fitted_node_mtbf_s(replace(scenario, nodes=PAPER_NODES), target_uptime)
    if rate in ("rsc-1k", "rsc-16k"):
        return rsc_node_mtbf_s(RSC_GPUS[rate == "rsc-16k"])
    return llama3_node_mtbf_s(hardware_only=rate == "llama3-hw")


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): training seconds between saves = sqrt(2 C M)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher-order estimate: sqrt(2CM) (1 + x/3 + x^2/9) - C, x = sqrt(C / 2M),
    for C < 2M; M otherwise."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = math.sqrt(cost_s / (2 * mtbf_s))
    return young_interval(cost_s, mtbf_s) * (1 + x / 3 + x * x / 9) - cost_s


# --- simulation --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timelines:
    """Where the faults fell in each run. Independent of checkpointing, so every interval of a
    sweep is evaluated on the same faults (common random numbers)."""

    duration_s: float
    faulted_up: Floats
    """Running seconds of each attempt that ended in a fault (all runs)."""
    faulted_run: Ints
    """The run of each of them."""
    faulted_kind: Ints
    """The kind of the fault that ended each of them (index into KINDS)."""
    final_up: Floats
    """Per run: running seconds of the attempt still running at the end."""
    down: Floats
    """Per run: seconds between a fault and the next gang's first step."""
    faults: Ints
    """Per run and kind (KINDS order): faults."""


def _arrivals(rng: np.random.Generator, rate: float, shares: Floats, horizon: float
              ) -> tuple[Floats, Ints]:
    """Running seconds between faults and their kinds, until they cover `horizon`."""
    block = int(rate * horizon + 6 * math.sqrt(rate * horizon) + 10)
    gaps: list[Floats] = []
    kinds: list[Ints] = []
    while sum(float(g.sum()) for g in gaps) < horizon:
        gaps.append(rng.exponential(1 / rate, block))
        kinds.append(rng.choice(len(KINDS), size=block, p=shares).astype(np.int64))
    return np.concatenate(gaps), np.concatenate(kinds)


def _run(scenario: Scenario, seed: int, run: int
         ) -> tuple[Floats, float, float, Ints, Ints]:
    """One run: (running seconds of the faulted attempts, of the final one, down seconds,
    faults per kind, the kind of each fault)."""
    end, rate = scenario.duration_s, scenario.job_rate
    if rate == 0:
        return (np.zeros(0), end, 0.0, np.zeros(len(KINDS), dtype=np.int64),
                np.zeros(0, dtype=np.int64))
    shares = np.array([scenario.shares[k] for k in KINDS])
    gaps, kinds = _arrivals(np.random.default_rng([seed, run, 0]), rate,
                            shares / shares.sum(), end)
    recovery = np.array([scenario.costs[k].recovery_s for k in KINDS])[kinds]
    if scenario.auto_recovery:
        down = np.array([scenario.costs[k].detection_s for k in KINDS])[kinds] + recovery
    else:
        responses = np.random.default_rng([seed, run, 1]).exponential(
            scenario.people.response_s, len(gaps))
        down, t = np.zeros(len(gaps)), 0.0
        for i in range(len(gaps)):
            t += gaps[i]
            if t >= end:
                break
            hour = (scenario.start_hour + t / HOUR) % 24
            down[i] = scenario.people.wait_s(hour) + responses[i] + recovery[i]
            t += down[i]
    fault_at = np.cumsum(gaps) + np.concatenate(([0.0], np.cumsum(down)[:-1]))
    n = int(np.searchsorted(fault_at, end))
    down_in = np.minimum(down[:n], end - fault_at[:n])
    final_up = end - (fault_at[n - 1] + down[n - 1]) if n else end
    counts = np.bincount(kinds[:n], minlength=len(KINDS)).astype(np.int64)
    return gaps[:n], max(0.0, float(final_up)), float(down_in.sum()), counts, kinds[:n]


def simulate(scenario: Scenario, runs: int, seed: int) -> Timelines:
    """`runs` independent runs of `scenario`; run i draws from seed (seed, i)."""
    _check(runs > 0, "runs", "must be > 0")
    parts = [_run(scenario, seed, i) for i in range(runs)]
    return Timelines(
        duration_s=scenario.duration_s,
        faulted_up=np.concatenate([p[0] for p in parts]),
        faulted_run=np.concatenate([np.full(len(p[0]), i, dtype=np.int64)
                                    for i, p in enumerate(parts)]),
        faulted_kind=np.concatenate([p[4] for p in parts]).astype(np.int64),
        final_up=np.array([p[1] for p in parts]),
        down=np.array([p[2] for p in parts]),
        faults=np.array([p[3] for p in parts], dtype=np.int64).reshape(runs, len(KINDS)),
    )


def attempt_work(up: Floats, ckpt: Checkpointing) -> tuple[Floats, Floats, Floats]:
    """For attempts that ran `up` seconds from a restore: (training seconds, seconds blocked by
    saves, training seconds covered by a complete save)."""
    tau, block = ckpt.interval_s, ckpt.blocking_s
    cycle = tau + block
    cycles = np.floor(up / cycle)
    rest = up - cycles * cycle
    trained = cycles * tau + np.minimum(rest, tau)
    blocked = cycles * block + np.maximum(rest - tau, 0.0)
    complete = np.maximum(np.floor((up + block - ckpt.complete_s) / cycle), 0.0)
    return trained, blocked, np.minimum(complete * tau, trained)


@dataclass(frozen=True)
class Figures:
    """Per-run figures of a scenario under one checkpointing."""

    uptime: Floats
    goodput: Floats
    lost_work_s: Floats
    blocking_s: Floats
    down_s: Floats
    faults: Ints


def evaluate(tl: Timelines, ckpt: Checkpointing) -> Figures:
    runs = len(tl.final_up)
    trained, blocked, saved = attempt_work(tl.faulted_up, ckpt)
    _, final_blocked, _ = attempt_work(tl.final_up, ckpt)

    def per_run(values: Floats) -> Floats:
        return np.bincount(tl.faulted_run, weights=values, minlength=runs).astype(np.float64)

    up = per_run(tl.faulted_up) + tl.final_up
    lost = per_run(trained - saved)
    blocking = per_run(blocked) + final_blocked
    wall = up + tl.down
    return Figures(up / wall, (up - blocking - lost) / wall, lost, blocking, tl.down, tl.faults)


def sweep(tl: Timelines, intervals: Floats, saves: Callable[[float], Checkpointing]) -> Floats:
    """Mean goodput at each checkpoint interval, on the same faults."""
    return np.array([float(evaluate(tl, saves(float(t))).goodput.mean()) for t in intervals])


def best_interval(intervals: Floats, goodput: Floats) -> float:
    """The interval of highest goodput: the vertex of a parabola through the best grid point and
    its neighbours (in log interval), which smooths the Monte Carlo noise of a flat maximum."""
    i = int(np.argmax(goodput))
    lo, hi = max(0, i - 3), min(len(intervals), i + 4)
    x, y = np.log(intervals[lo:hi]), goodput[lo:hi]
    if len(x) >= 3:
        a, b, _ = np.polyfit(x, y, 2)
        if a < 0 and x[0] <= -b / (2 * a) <= x[-1]:
            return float(math.exp(-b / (2 * a)))
    return float(intervals[i])


# --- recovery paths: in-memory snapshots and peer replicas (issue 34) ---------------------------
# With checkpoint.memoryInterval every rank writes its state to its pod's /dev/shm every N steps
# (docs/trainer.md); the launcher holds it, so an in-place restart after a crash or a hang
# resumes from it with nothing read from storage and at most the steps since it lost. A lost
# node takes its memory; with checkpoint.memoryReplicas its launcher's copies on the next node
# (hlat_trainer.replica) are fetched back by the spare or new pod that takes its ranks
# (`Snapshots.peer`), and its peers report it within about 2 s (hlat_trainer.peers;
# `RecoveryPath.node_lost_detection_s`). Without copies the whole gang resumes from the durable
# checkpoint. Training progress is counted in training seconds from the
# start; durable saves and snapshots are taken at multiples of their intervals of it (the
# trainer saves at steps that are multiples of checkpoint.interval and memoryInterval), so a
# restore from memory may leave the newest durable checkpoint behind it.

Source = Literal["memory", "peer", "durable"]
SOURCES: tuple[Source, ...] = ("memory", "peer", "durable")
_EPS = 1e-9

PAPER_TP, PAPER_DP, PAPER_RANKS_PER_NODE = 8, 256, 32
"""The paper's 7B layout on 64 trn1.32xlarge (examples/pretrainjob-7b-trn1.yaml): tensor 8,
32 ranks a node, so 256 data-parallel ranks; ZeRO-1, bf16 with stochastic rounding."""


def paper_7b_rank_bytes() -> tuple[float, float, float]:
    """Per rank at the paper's 7B layout (`hlat_api.memory`): the state an asynchronous save
    copies to host memory (the weights and the rank's ZeRO-1 optimizer shard), an in-memory
    snapshot's (its 1/dp of both: the weights are kept once per dp group), and the weights a
    restore from snapshots gathers back over the dp group."""
    dims = ModelSpec(preset="7b").dims()
    b = bytes_per_param("bf16-sr", False, True)
    params = params_per_rank(dims, PAPER_TP)
    staged = params * (b.weight + b.optimizer / PAPER_DP)
    snapshot = snapshot_bytes_per_rank(dims, tp=PAPER_TP, dp=PAPER_DP, precision="bf16-sr",
                                       zero1=True)
    return staged, snapshot, params * b.weight


EFA_NODE_BYTES_S = 800e9 / 8 * 0.5
"""A trn1.32xlarge's EFA, 800 Gb/s a node (Neuron's Trn1 architecture page), at half its line
rate for a collective: the efficiency is an assumption."""
_STAGED, _SNAPSHOT, _WEIGHTS = paper_7b_rank_bytes()

SNAPSHOT_7B_S = ASYNC_SAVE_7B_S * _SNAPSHOT / _STAGED
"""Seconds a snapshot blocks training at the paper's 7B: what an asynchronous save blocks for
its copy to host memory (6.3 s), scaled by the bytes a snapshot copies instead (each rank's 1/dp
of the weights and its optimizer shard: 1/52 of the staged state): 0.12 s. Derived; nothing
measured it on trn1 (the local cluster's job is tiny)."""

SNAPSHOT_LOAD_7B_S = (SNAPSHOT_7B_S + PAPER_RANKS_PER_NODE * _WEIGHTS * (PAPER_DP - 1) / PAPER_DP
                      / EFA_NODE_BYTES_S)
"""Seconds an in-place restart takes to load the snapshot: its copy from /dev/shm (as long as
the copy out) and the all-gather that makes each rank's weights whole again, a node receiving
its 32 ranks' weights but their own slices over EFA (`EFA_NODE_BYTES_S`): 1.1 s. Derived."""

PEER_LOAD_S = (PAPER_RANKS_PER_NODE * _SNAPSHOT / (2.5 * 2**30) + SNAPSHOT_LOAD_7B_S)
"""Seconds a lost node's replacement takes to pull its ranks' snapshots from its peer (1 GiB a
node at the paper's 7B) at an effective 2.5 GiB/s (assumed) and load them as above: 1.5 s. The
pull is built (hlat_trainer.replica: one TCP stream per rank, SHA-256 checked); its rate at this
size is not measured (the rig's tiny job: 9.2 MiB in 0.04 s over loopback veths)."""


@dataclass(frozen=True)
class Snapshots:
    """In-memory snapshots (checkpoint.memoryInterval) and, with `peer`, a replica of each on
    a peer node (checkpoint.memoryReplicas)."""

    interval_s: float
    """Training seconds between two snapshots (memoryInterval x the step time)."""
    block_s: float = SNAPSHOT_7B_S
    """Seconds a snapshot blocks training (`SNAPSHOT_7B_S`)."""
    load_s: float = SNAPSHOT_LOAD_7B_S
    """Seconds an in-place restart takes to load the snapshot onto the devices
    (`SNAPSHOT_LOAD_7B_S`)."""
    peer: bool = False
    """Each snapshot is also on a peer node when it stops blocking (checkpoint.memoryReplicas:
    the launcher copies it in the background; its cost to the steps is not modelled), so a
    lost node's replacement resumes from it."""
    peer_load_s: float = PEER_LOAD_S
    """Seconds a lost node's replacement takes to fetch and load its peer's replica."""

    def __post_init__(self) -> None:
        _check(self.interval_s > 0, "interval_s", "must be > 0")
        _check(self.block_s >= 0, "block_s", "must be >= 0")
        _check(self.load_s >= 0, "load_s", "must be >= 0")
        _check(self.peer_load_s >= 0, "peer_load_s", "must be >= 0")

    @property
    def overhead(self) -> float:
        """Wall seconds per training second that snapshots add (spread over the steps)."""
        return self.block_s / self.interval_s


@dataclass(frozen=True)
class RecoveryPath:
    """Where an in-place restart resumes from per fault kind, and what that costs. No
    snapshots: every restart reads the durable checkpoint (the baseline)."""

    name: str
    snapshots: Snapshots | None = None
    node_lost_detection_s: float | None = None
    """From a node's loss until the operator acts: None for today's (node monitor grace + half
    a resync); the peers' report (hlat_trainer.peers) measured 1.0-2.0 s on the rig, 5 s is
    issue 34's bound."""

    def __post_init__(self) -> None:
        _check(self.node_lost_detection_s is None or self.node_lost_detection_s >= 0,
               "node_lost_detection_s", "must be >= 0")

    def source(self, kind: FaultKind) -> Source:
        """The state a restart after a fault of `kind` resumes from: its own node's memory
        after a crash or a hang (the launcher and /dev/shm outlive the trainer), a peer's
        replica after a node loss when there is one, the durable checkpoint otherwise."""
        if self.snapshots is None:
            return "durable"
        if kind != "node_lost":
            return "memory"
        return "peer" if self.snapshots.peer else "durable"

    def costs(self, times: ClusterTimes) -> dict[FaultKind, FaultCost]:
        """Per kind: detection and recovery with in-place restarts, the state's load being a
        durable checkpoint's read from storage, a snapshot's from memory or a replica's from
        the peer."""
        snap = self.snapshots
        load = {"durable": times.checkpoint_load_s,
                "memory": snap.load_s if snap else math.nan,
                "peer": snap.peer_load_s if snap else math.nan}
        return times.in_place_costs({k: load[self.source(k)] for k in KINDS},
                                    self.node_lost_detection_s)


@dataclass(frozen=True)
class PathFigures(Figures):
    """Figures of a recovery path; blocking_s counts snapshots' blocking too."""

    snapshot_blocking_s: Floats
    """Per run: seconds snapshots blocked training."""
    restores: Ints
    """Per run and source (SOURCES order): restarts that resumed from it. A restart from
    memory falls back to the durable checkpoint when that is newer."""


def _padded(tl: Timelines) -> tuple[Floats, Ints, npt.NDArray[np.bool_]]:
    """The faulted attempts as (runs x most faults of a run) arrays, and which cells hold one."""
    runs = len(tl.final_up)
    counts = np.bincount(tl.faulted_run, minlength=runs)
    width = int(counts.max()) if len(tl.faulted_run) else 0
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    col = np.arange(len(tl.faulted_run)) - starts[tl.faulted_run]
    up, kind = np.zeros((runs, width)), np.zeros((runs, width), dtype=np.int64)
    valid = np.zeros((runs, width), dtype=bool)
    up[tl.faulted_run, col], kind[tl.faulted_run, col] = tl.faulted_up, tl.faulted_kind
    valid[tl.faulted_run, col] = True
    return up, kind, valid


def _advance(start: Floats, up: Floats, ckpt: Checkpointing, slow: float
             ) -> tuple[Floats, Floats, Floats]:
    """Attempts that resumed at progress `start` and ran `up` seconds: (training seconds,
    seconds blocked by durable saves, progress of the newest complete durable save they made,
    NaN where none). Durable saves at multiples of the interval of progress; a training second
    takes `slow` wall seconds (snapshots)."""
    tau, block = ckpt.interval_s, ckpt.blocking_s
    first = (np.floor(start / tau + _EPS) + 1) * tau
    reach = (first - start) * slow
    cycle = tau * slow + block
    started = np.where(up >= reach, np.floor((up - reach) / cycle) + 1, 0.0)
    last = reach + np.maximum(started - 1, 0.0) * cycle
    blocked = np.where(started > 0, (started - 1) * block + np.minimum(block, up - last), 0.0)
    complete = np.where(up >= reach + ckpt.complete_s,
                        np.floor((up - reach - ckpt.complete_s) / cycle) + 1, 0.0)
    durable = np.where(complete > 0, first + (complete - 1) * tau, np.nan)
    return (up - blocked) / slow, blocked, durable


def evaluate_path(tl: Timelines, ckpt: Checkpointing, path: RecoveryPath) -> PathFigures:
    """Per-run figures of `path` on timelines simulated with its costs (`path.costs`). Each
    fault loses the progress since the state its restart resumes from (`path.source`): the
    newest snapshot, or the newest complete durable save when that is newer or the source is
    durable; the durable checkpoint is tracked across attempts, so a durable restore after a
    restore from memory goes back past it. Goodput = progress at the end / wall seconds."""
    up, kind, valid = _padded(tl)
    runs = len(tl.final_up)
    snap = path.snapshots
    slow = 1.0 + (snap.overhead if snap else 0.0)
    source = np.array([SOURCES.index(path.source(k)) for k in KINDS])
    durable_at = SOURCES.index("durable")
    at, durable = np.zeros(runs), np.zeros(runs)
    lost, blocked, snapped = np.zeros(runs), np.zeros(runs), np.zeros(runs)
    restores = np.zeros((runs, len(SOURCES)), dtype=np.int64)
    for i in range(up.shape[1]):
        ok = valid[:, i]
        trained, blocking, saved = _advance(at, up[:, i], ckpt, slow)
        reached = at + trained
        durable_now = np.where(np.isnan(saved), durable, saved)
        newest = (np.floor(reached / snap.interval_s + _EPS) * snap.interval_s if snap
                  else durable_now)
        src = source[kind[:, i]]
        from_durable = (src == durable_at) | (newest < durable_now - 1e-6)
        resume = np.where(from_durable, durable_now, newest)
        lost += np.where(ok, reached - resume, 0.0)
        blocked += np.where(ok, blocking, 0.0)
        snapped += np.where(ok, trained * (slow - 1), 0.0)
        used = np.where(from_durable, durable_at, src)
        np.add.at(restores, (np.flatnonzero(ok), used[ok]), 1)
        at, durable = np.where(ok, resume, at), np.where(ok, durable_now, durable)
    trained, blocking, _ = _advance(at, tl.final_up, ckpt, slow)
    snapped += trained * (slow - 1)
    ran = np.bincount(tl.faulted_run, weights=tl.faulted_up, minlength=runs) + tl.final_up
    wall = ran + tl.down
    return PathFigures(
        uptime=ran / wall, goodput=(at + trained) / wall, lost_work_s=lost,
        blocking_s=blocked + blocking + snapped, down_s=tl.down, faults=tl.faults,
        snapshot_blocking_s=snapped, restores=restores)


def snapshot_interval_s(block_s: float, mtbf_s: float, step_s: float,
                        durable_interval_s: float) -> float:
    """The snapshot interval to use: Daly's for the snapshot's blocking and the mean running
    seconds between the faults it serves, as a whole number of steps that divides the durable
    interval's (so each durable save's step is also a snapshot's), the nearest in log."""
    steps = max(1, round(durable_interval_s / step_s))
    divisors = [d for d in range(1, steps + 1) if steps % d == 0]
    target = max(daly_interval(block_s, mtbf_s) / step_s, 1.0)
    return min(divisors, key=lambda d: abs(math.log(d / target))) * step_s


# --- fail-slow nodes (stragglers) --------------------------------------------------------------
# A fail-slow node fails nothing: a synchronous gang runs at its pace until it recovers or the
# operator moves its rank to a spare (spec.faultTolerance.stragglers, action Replace). Falcon
# ("Pinpointing and Mitigating Stragglers for Large-Scale Hybrid-Parallel Training", Wu et al.,
# USENIX ATC'25, arXiv 2410.12588) characterised them on a production cluster of over 10,000
# GPUs; it publishes shares of jobs that met one, not rates per node, so a per-node rate is
# derived from them below, two ways. The losses of overlapping fail-slows are added (a gang
# slowed by two nodes at once runs at the slower one's pace: an overestimate, small while the
# slowed time is a small share of the run).

FALCON_SCALE_SLOWDOWN = 1.3459
"""Falcon Table 1: the mean job completion time slowdown of the 27 large jobs (512-1,024 GPUs)
of a one-month trace (July 2024), 16 of which met a fail-slow."""

FALCON_SCALE_MEAN_S = 72 * 60.0
"""Falcon section 3.4: "the mean fail-slow duration is 72 minutes" (at scale)."""

FALCON_PROBES = (43, 107, 4, 5 * HOUR)
"""Falcon section 3.3: 43 of 107 probe jobs on 4 nodes (8 A100 each), about 5 hours long each,
met a fail-slow (42 of them network congestion)."""

FALCON_PROBE_MEAN_S = 24 * 60.0
"""Falcon section 3.3: the probe jobs' (communication) fail-slows lasted "about 24 minutes"."""

FALCON_MITIGATED = 0.601
"""Falcon's abstract: on injected fail-slows, its multi-level mitigation removed 60.1% of the
slowdown (Table 7, 64 H800 GPUs)."""


@dataclass(frozen=True)
class FailSlow:
    """Fail-slow nodes: how often, how long, how slow."""

    node_mtbs_s: float
    """Mean seconds between the fail-slows of one node."""
    mean_s: float = FALCON_SCALE_MEAN_S
    """Mean duration (exponential: Falcon reports tens of seconds to nearly ten hours)."""
    factor: float = 1.5
    """The gang's step time while one lasts, x its healthy step time. Assumption: Falcon gives
    no per-event distribution; its cases range from a GPU 20% slower to congestion leaving 10%
    of the throughput."""

    def __post_init__(self) -> None:
        _check(self.node_mtbs_s > 0, "node_mtbs_s", "must be > 0")
        _check(self.mean_s > 0, "mean_s", "must be > 0")
        _check(self.factor > 1, "factor", "must be > 1 (a fail-slow slows)")

    @property
    def lost_per_event_s(self) -> float:
        """Mean training seconds lost to one fail-slow left alone."""
        return self.mean_s * (1 - 1 / self.factor)


def falcon_fitted_mtbs_s(nodes: int, mean_s: float = FALCON_SCALE_MEAN_S,
                         factor: float = 1.5) -> float:
    """The node rate at which a job of `nodes` left alone is slowed by Falcon's at-scale mean
    (1.3459x): with fail-slows at rate r per second each losing L seconds, a job's wall time is
    its work / (1 - r L). A fitted input, like `fitted_node_mtbf_s`."""
    lost = 1 - 1 / FALCON_SCALE_SLOWDOWN
    rate = lost / FailSlow(1.0, mean_s, factor).lost_per_event_s
    return nodes / rate


def falcon_probe_mtbs_s() -> float:
    """The node rate implied by Falcon's probe jobs: P(at least one in a job) = 43/107 over 4
    nodes x 5 h, with independent Poisson arrivals per node."""
    slowed, jobs, nodes, seconds = FALCON_PROBES
    return nodes * seconds / -math.log(1 - slowed / jobs)


@dataclass(frozen=True)
class Replace:
    """What moving a slow node's rank to a warm spare costs (action Replace)."""

    detection_s: float
    """From the start of a fail-slow until it is flagged (the straggler window, plus a
    heartbeat period for the medians to move)."""
    checkpoint_interval_s: float
    """The move waits for the next complete checkpoint: uniform in [0, this)."""
    move_s: float
    """The in-place restart onto the spare, from the checkpoint to the first step."""

    def worth_it(self, slow: FailSlow) -> bool:
        """Whether moving pays on average: durations are exponential (memoryless), so a
        fail-slow still on when flagged lasts `mean_s` more on average."""
        return slow.lost_per_event_s > self.move_s


def fail_slow_lost(nodes: int, duration_s: float, slow: FailSlow, runs: int, seed: int,
                   replace_: Replace | None = None) -> Floats:
    """Per run: the share of the job's `duration_s` lost to fail-slows (training seconds not
    done, and the moves' restarts), left alone or moved off at the next checkpoint when that
    pays (`Replace.worth_it`). Seeded; both policies meet the same fail-slows."""
    _check(runs > 0, "runs", "must be > 0")
    out = np.zeros(runs)
    move = replace_ is not None and replace_.worth_it(slow)
    for run in range(runs):
        rng = np.random.default_rng([seed, run, 2])
        count = rng.poisson(nodes * duration_s / slow.node_mtbs_s)
        lasts = rng.exponential(slow.mean_s, count)
        waits = rng.uniform(0, 1, count)
        slowed = lasts
        moved = np.zeros(count, dtype=bool)
        if move and replace_ is not None:
            at = replace_.detection_s + waits * replace_.checkpoint_interval_s
            moved = lasts > at
            slowed = np.where(moved, at, lasts)
        lost = slowed * (1 - 1 / slow.factor) + moved * (replace_.move_s if replace_ else 0.0)
        out[run] = min(float(lost.sum()) / duration_s, 1.0)
    return out


# --- node losses without replacement capacity (elastic runs) -----------------------------------
# A lost node with no spare and no free node leaves the gang short until capacity returns
# (an EC2 replacement, a capacity block's repaired host). Without elasticity the whole gang
# waits; an elastic job (issue 29, spec.elastic) restarts on a smaller data-parallel degree
# after its wait, trains there, and grows back at the first checkpoint after the node returns.
# The global batch is kept, so the smaller size must divide it (`PretrainJobSpec.sizes`): for
# the paper's 7B layout on 64 nodes the largest is 32. Losses of overlapping events are added
# (an overestimate, small while losses are rare next to the run).


@dataclass(frozen=True)
class NodeLoss:
    """Faults that take one node away until capacity replaces it, and what a restart costs."""

    node_mtbf_s: float
    """Mean running seconds between such losses, per node."""
    replacement_s: float
    """From a loss until a node can take the rank again (fixed, not drawn)."""
    detection_s: float = ClusterTimes().fault_costs()["node_lost"].detection_s
    """From the loss until the operator acts on it (node_lost's detection)."""
    restart_s: float = ClusterTimes().gang_start_s()
    """A gang's start from a checkpoint to its first step (cold: compile cache and load)."""
    checkpoint_interval_s: float = NXD_CHECKPOINT_STEPS * HLAT_STEP_S
    """Training seconds between complete checkpoints: a loss loses half of one on average
    (without snapshots), a grow-back waits for the next one (uniform)."""
    snapshot_interval_s: float | None = None
    """Training seconds between in-memory snapshots, each copied to a peer node
    (checkpoint.memoryInterval, memoryReplicas 1): the lost node's ranks are held there, so
    the restart, at the smaller size (the old world's snapshots staged and resharded) or on
    the replacement (its ranks' copies fetched back), loses the work since the last snapshot,
    not since the last checkpoint. None: no snapshots."""

    def __post_init__(self) -> None:
        _check(self.node_mtbf_s > 0, "node_mtbf_s", "must be > 0")
        _check(self.replacement_s >= 0, "replacement_s", "must be >= 0")
        _check(self.detection_s >= 0 and self.restart_s >= 0, "detection_s/restart_s",
               "must be >= 0")
        _check(self.checkpoint_interval_s > 0, "checkpoint_interval_s", "must be > 0")
        _check(self.snapshot_interval_s is None or self.snapshot_interval_s > 0,
               "snapshot_interval_s", "must be > 0")

    @property
    def lost_span_s(self) -> float:
        """A loss loses the work since the newest state kept: uniform over this."""
        return (self.checkpoint_interval_s if self.snapshot_interval_s is None
                else min(self.snapshot_interval_s, self.checkpoint_interval_s))


@dataclass(frozen=True)
class Elastic:
    """How an elastic job rides out a loss: the size it shrinks to, after how long."""

    size: int
    """Nodes it trains on while short: the largest size below `nodes` that keeps the global
    batch (`PretrainJobSpec.sizes`) and is at least minNodes."""
    wait_s: float = 0.0
    """spec.elastic.waitSeconds: how long it waits for a spare or a replacement first."""
    speed: float | None = None
    """Its steps per second at `size`, relative to the whole gang's (`PretrainJobSpec.speed_at`:
    where the data-parallel degree does not divide the micro-batches, a step waits for the
    ranks that train one more); None: size / nodes, as when it divides them."""
    asked_write_s: float | None = None
    """Growing back waits for a checkpoint asked for once the replacement is there (what the
    operator does): seen within a heartbeat period (`heartbeat_s`, uniform), then written whole
    in this many seconds. None: it waits for the next periodic checkpoint (uniform over the
    interval, in steps at the smaller size)."""
    heartbeat_s: float = 10.0

    def __post_init__(self) -> None:
        _check(self.size > 0, "size", "must be > 0")
        _check(self.wait_s >= 0, "wait_s", "must be >= 0")
        _check(self.speed is None or 0 < self.speed <= 1, "speed", "must be in (0, 1]")
        _check(self.asked_write_s is None or self.asked_write_s >= 0, "asked_write_s",
               "must be >= 0")


@dataclass(frozen=True)
class NodeLossRuns:
    """Per run, two figures of the same losses."""

    capacity: Floats
    """Node-seconds of training that count over node-seconds asked for (nodes x duration)."""
    goodput: Floats
    """The share of the duration the job trained work that counts, at whatever size (the
    job's goodput ratio: time at a reduced size is productive, as status.goodput counts it;
    time down and work recomputed are not)."""


def node_loss_runs(nodes: int, duration_s: float, loss: NodeLoss, runs: int, seed: int,
                   elastic: Elastic | None = None) -> NodeLossRuns:
    """Per run, capacity and goodput. Per loss, without elasticity: the gang is down from the
    loss until the replacement and a restart, and recomputes the work since the last
    checkpoint (or snapshot: `NodeLoss.snapshot_interval_s`). Elastic, when the replacement takes longer than detection + wait: down for
    detection, wait and a restart; then short by (nodes - size) nodes until the replacement
    is there and a checkpoint is complete (the next periodic one, or one asked for:
    `Elastic.asked_write_s`); then a planned restart (the whole gang, no work lost). Seeded;
    both policies meet the same losses."""
    _check(runs > 0, "runs", "must be > 0")
    _check(nodes > 0 and duration_s > 0, "nodes/duration_s", "must be > 0")
    if elastic is not None:
        _check(elastic.size < nodes, "size", f"must be below nodes ({nodes})")
    capacity, goodput = np.zeros(runs), np.zeros(runs)
    for run in range(runs):
        rng = np.random.default_rng([seed, run, 3])
        count = rng.poisson(nodes * duration_s / loss.node_mtbf_s)
        recomputed = rng.uniform(0, loss.lost_span_s, count)
        drawn = rng.uniform(0, 1, count)
        whole = max(loss.detection_s, loss.replacement_s) + loss.restart_s  # gang seconds down
        down = recomputed + whole  # seconds the gang trains nothing that counts
        lost = nodes * down  # node-seconds
        if elastic is not None and loss.replacement_s > loss.detection_s + elastic.wait_s:
            shrunk_at = loss.detection_s + elastic.wait_s + loss.restart_s
            # while short, a step takes 1/speed as long: the next periodic checkpoint is that
            # much further away in wall time, and the gang does `speed` of its work
            speed = elastic.speed if elastic.speed is not None else elastic.size / nodes
            to_checkpoint = (drawn * loss.checkpoint_interval_s / speed
                             if elastic.asked_write_s is None
                             else drawn * elastic.heartbeat_s + elastic.asked_write_s)
            short = max(loss.replacement_s - shrunk_at, 0.0) + to_checkpoint
            down = recomputed + shrunk_at + loss.restart_s
            lost = nodes * (down + (1 - speed) * short)
        capacity[run] = max(0.0, 1 - float(lost.sum()) / (nodes * duration_s))
        goodput[run] = max(0.0, 1 - float(down.sum()) / duration_s)
    return NodeLossRuns(capacity, goodput)


def node_loss_capacity(nodes: int, duration_s: float, loss: NodeLoss, runs: int, seed: int,
                       elastic: Elastic | None = None) -> Floats:
    """Per run: the capacity fraction (`node_loss_runs`)."""
    return node_loss_runs(nodes, duration_s, loss, runs, seed, elastic).capacity
