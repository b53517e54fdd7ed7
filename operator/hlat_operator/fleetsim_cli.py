"""The fleet simulator's report and command line (`hlat-fleet-sim`): the four scenarios of
`hlat_operator.fleetsim` (automatic recovery or by hand x sync or async saves) and the
goodput-best checkpoint interval, by sweep and by Young/Daly, as a table, JSON or a plot."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from hlat_operator.fleetsim import (
    ASYNC_SAVE_7B_S,
    DAY,
    HOUR,
    KINDS,
    LLAMA3_SHARES,
    NXD_CHECKPOINT_STEPS,
    PAPER_UPTIME_WITH,
    SYNC_SAVE_7B_S,
    Checkpointing,
    ClusterTimes,
    FaultCost,
    FaultKind,
    Figures,
    Floats,
    People,
    Scenario,
    _check,
    async_saves,
    best_interval,
    daly_interval,
    evaluate,
    node_mtbf_for,
    simulate,
    sweep,
    sync_saves,
    young_interval,
)

# --- report ------------------------------------------------------------------------------------


def _stat(values: Floats) -> dict[str, float]:
    return {"mean": float(values.mean()), "std": float(values.std()),
            "p5": float(np.percentile(values, 5)), "p95": float(np.percentile(values, 95))}


def _scenario_figures(name: str, auto: bool, mode: str, fig: Figures) -> dict[str, Any]:
    return {
        "name": name, "auto_recovery": auto, "checkpoint": mode,
        "uptime": _stat(fig.uptime), "goodput": _stat(fig.goodput),
        "faults": {k: float(fig.faults[:, i].mean()) for i, k in enumerate(KINDS)},
        "lost_work_s": _stat(fig.lost_work_s), "down_s": _stat(fig.down_s),
        "checkpoint_blocking_s": _stat(fig.blocking_s),
    }


def fleet_report(scenario: Scenario, interval_s: float, sync_block_s: float = SYNC_SAVE_7B_S,
                 async_block_s: float = ASYNC_SAVE_7B_S, async_complete_s: float = SYNC_SAVE_7B_S,
                 runs: int = 200, seed: int = 0, sweep_points: int = 61) -> dict[str, Any]:
    """Every figure of the CLI and the bench, JSON-ready: the four scenarios (automatic recovery
    or by hand x sync or async saves) and, with recovery, the interval that maximises goodput."""
    _check(sync_block_s > 0 and async_block_s > 0, "sync_block_s/async_block_s", "must be > 0")
    saves: dict[str, Callable[[float], Checkpointing]] = {
        "sync": lambda t: sync_saves(t, sync_block_s),
        "async": lambda t: async_saves(t, async_block_s, async_complete_s),
    }
    timelines = {ok: simulate(replace(scenario, auto_recovery=ok), runs, seed)
                 for ok in (True, False)}
    scenarios = [
        _scenario_figures(f"{'recovery' if ok else 'by hand'}, {mode}", ok, mode,
                          evaluate(timelines[ok], saves[mode](interval_s)))
        for ok in (True, False) for mode in saves
    ]
    mtbf = 1 / scenario.job_rate if scenario.job_rate else math.inf
    finite = math.isfinite(mtbf)
    report: dict[str, Any] = {
        "runs": runs, "seed": seed, "scenarios": scenarios,
        "inputs": {
            "nodes": scenario.nodes, "duration_s": scenario.duration_s,
            "node_mtbf_s": scenario.node_mtbf_s if finite else None,
            "job_mtbf_s": mtbf if finite else None,
            "shares": {k: v / sum(scenario.shares.values()) for k, v in scenario.shares.items()},
            "costs": {k: asdict(c) for k, c in scenario.costs.items()},
            "people": asdict(scenario.people), "start_hour": scenario.start_hour,
            "checkpoint_interval_s": interval_s, "sync_block_s": sync_block_s,
            "async_block_s": async_block_s, "async_complete_s": async_complete_s,
        },
        "optimum": {}, "sweep": {},
    }
    if finite:
        lo = max(1.0, min(60.0, daly_interval(async_block_s, mtbf) / 4))
        grid = np.geomspace(lo, max(8 * young_interval(sync_block_s, mtbf), 4 * lo), sweep_points)
        report["sweep"]["interval_s"] = grid.tolist()
        for mode, make in saves.items():
            cost = (sync_block_s if mode == "sync" else async_block_s)
            curve = sweep(timelines[True], grid, make)
            best = best_interval(grid, curve)
            daly = daly_interval(cost, mtbf)
            report["sweep"][mode] = curve.tolist()
            report["optimum"][mode] = {
                "blocking_s": cost, "young_s": young_interval(cost, mtbf), "daly_s": daly,
                "sweep_s": best, "sweep_over_daly": best / daly,
                "sweep_over_young": best / young_interval(cost, mtbf),
                "goodput_at_sweep": float(evaluate(timelines[True], make(best)).goodput.mean()),
                "goodput_at_daly": float(evaluate(timelines[True], make(daly)).goodput.mean()),
            }
    return report


def format_table(report: dict[str, Any]) -> str:
    i = report["inputs"]
    mtbf = ("no faults" if i["job_mtbf_s"] is None else
            f"node MTBF {i['node_mtbf_s'] / HOUR:,.0f} h, job MTBF {i['job_mtbf_s'] / HOUR:.2f} h")
    lines = [
        f"{i['nodes']} nodes, {i['duration_s'] / DAY:g} days, {report['runs']} runs "
        f"(seed {report['seed']}); {mtbf}",
        "per fault (s)   share  detection  recovery",
        *(f"  {k:<12}{i['shares'][k]:>7.1%}{c['detection_s']:>11.1f}{c['recovery_s']:>10.1f}"
          for k, c in i["costs"].items()),
        f"checkpoint every {i['checkpoint_interval_s']:.0f} s; sync blocks "
        f"{i['sync_block_s']:g} s; async blocks {i['async_block_s']:g} s, complete after "
        f"{i['async_complete_s']:g} s",
        "",
        f"{'scenario':<18}{'uptime % [p5-p95]':>22}{'goodput % [p5-p95]':>22}"
        f"{'faults c/h/n':>15}{'lost h':>8}{'down h':>8}",
    ]
    for s in report["scenarios"]:
        up, gp, f = s["uptime"], s["goodput"], s["faults"]
        lines.append(
            f"{s['name']:<18}{_pct(up):>22}{_pct(gp):>22}"
            f"{f['crash']:>7.1f}/{f['hang']:.1f}/{f['node_lost']:.1f}"
            f"{s['lost_work_s']['mean'] / HOUR:>8.2f}{s['down_s']['mean'] / HOUR:>8.2f}")
    if report["optimum"]:
        lines += ["", "interval maximising goodput, with recovery (s): "
                  "Young, Daly, sweep, sweep/Daly, goodput at sweep / at Daly"]
        for mode, o in report["optimum"].items():
            lines.append(
                f"  {mode:<6} C={o['blocking_s']:<6g}{o['young_s']:>8.0f}{o['daly_s']:>8.0f}"
                f"{o['sweep_s']:>8.0f}{o['sweep_over_daly']:>8.2f}"
                f"{100 * o['goodput_at_sweep']:>10.2f}% / {100 * o['goodput_at_daly']:.2f}%")
    return "\n".join(lines)


def _pct(stat: dict[str, float]) -> str:
    return f"{100 * stat['mean']:.2f} [{100 * stat['p5']:.2f}-{100 * stat['p95']:.2f}]"


def plot_sweep(report: dict[str, Any], path: str) -> None:
    """Goodput vs checkpoint interval (with recovery), sync and async, optima marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.array(report["sweep"]["interval_s"]) / 60
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, colour in (("sync", "tab:blue"), ("async", "tab:orange")):
        o = report["optimum"][mode]
        ax.plot(grid, 100 * np.array(report["sweep"][mode]), color=colour,
                label=f"{mode} saves (blocking {o['blocking_s']:g} s)")
        ax.axvline(o["daly_s"] / 60, color=colour, linestyle="--", linewidth=1,
                   label=f"Young/Daly {o['young_s'] / 60:.1f}/{o['daly_s'] / 60:.1f} min")
        ax.plot(o["sweep_s"] / 60, 100 * o["goodput_at_sweep"], "o", color=colour,
                label=f"sweep optimum {o['sweep_s'] / 60:.1f} min")
    i = report["inputs"]
    ax.axvline(i["checkpoint_interval_s"] / 60, color="grey", linestyle=":",
               label=f"interval of the table ({i['checkpoint_interval_s'] / 60:.1f} min)")
    ax.set(xscale="log", xlabel="checkpoint interval (minutes of training)", ylabel="goodput (%)",
           title=f"{i['nodes']} nodes, {i['duration_s'] / DAY:g} days, job MTBF "
                 f"{i['job_mtbf_s'] / HOUR:.1f} h, automatic recovery ({report['runs']} runs)")
    peaks = [100 * max(report["sweep"][m]) for m in ("sync", "async")]
    ax.set_ylim(min(peaks) - 4, max(peaks) + 0.5)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- CLI ---------------------------------------------------------------------------------------


def _number(kind: type[float] | type[int], low: float, strict: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, "
                                             f"got {text}")
        return value
    return parse


def _kind_seconds(text: str) -> tuple[FaultKind, float]:
    kind, _, seconds = text.partition("=")
    for k in KINDS:
        if k == kind and seconds:
            return k, _number(float, 0, False)(seconds)
    raise argparse.ArgumentTypeError(f"expected KIND=SECONDS with KIND one of {KINDS}: {text!r}")


def build_parser() -> argparse.ArgumentParser:
    pos, nonneg = _number(float, 0, True), _number(float, 0, False)
    d, shares = ClusterTimes(), " ".join(f"{LLAMA3_SHARES[k]:.3f}" for k in KINDS)
    p = argparse.ArgumentParser(
        prog="hlat-fleet-sim", description="Simulate uptime and goodput of a pretraining job "
        "under faults, with vs without automatic recovery and sync vs async saves, and the "
        "checkpoint interval that maximises goodput (sweep vs Young/Daly).",
        epilog="Defaults and their sources: docs/benchmarks.md, the fleet simulator's section.")
    p.add_argument("--nodes", type=_number(int, 0, True), default=64, help="gang size (64)")
    p.add_argument("--days", type=pos, default=28.0, help="job duration (28)")
    p.add_argument("--rate", choices=["hlat", "llama3", "llama3-hw", "rsc-1k", "rsc-16k"],
                   default="hlat",
                   help="fault rate: fitted so the uptime with recovery is --target-uptime "
                        "(hlat, the default), or Llama 3's 419 unexpected interruptions per "
                        "2,048 hosts in 54 days (llama3; llama3-hw: the 78%% hardware ones), "
                        "or RSC's job MTTF at 16 chips a node: 7.9 h on 1,024 GPUs (rsc-1k, "
                        "506 h a node) or 1.8 h on 16,384 (rsc-16k, 1,843 h a node)")
    p.add_argument("--node-mtbf-hours", type=pos, default=None,
                   help="running hours between faults of one node; overrides --rate")
    p.add_argument("--target-uptime", type=pos, default=PAPER_UPTIME_WITH,
                   help=f"what --rate hlat fits ({PAPER_UPTIME_WITH}, Table 1)")
    p.add_argument("--shares", type=nonneg, nargs=3, metavar=("CRASH", "HANG", "NODE_LOST"),
                   default=[LLAMA3_SHARES[k] for k in KINDS],
                   help=f"fault kinds' shares ({shares}: Llama 3's Table 5)")
    p.add_argument("--step-seconds", type=pos, default=d.step_s,
                   help=f"training step, sets the heartbeat timeout ({d.step_s:.2f})")
    p.add_argument("--node-monitor-grace", type=nonneg, default=d.node_monitor_grace_s,
                   help=f"seconds before a silent node is NotReady ({d.node_monitor_grace_s:g})")
    p.add_argument("--compile-cache-load", type=nonneg, default=d.compile_cache_load_s,
                   help=f"seconds a new gang loads its compiled graphs "
                        f"({d.compile_cache_load_s:g}, assumed)")
    p.add_argument("--checkpoint-load", type=nonneg, default=d.checkpoint_load_s,
                   help=f"seconds a new gang loads the checkpoint ({d.checkpoint_load_s:g})")
    p.add_argument("--node-replacement", type=nonneg, default=d.node_replacement_s,
                   help="extra seconds until a lost node is replaced (0: a spare is ready)")
    p.add_argument("--detection", type=_kind_seconds, action="append", default=[],
                   metavar="KIND=S", help="set a kind's detection seconds (repeatable)")
    p.add_argument("--recovery", type=_kind_seconds, action="append", default=[],
                   metavar="KIND=S", help="set a kind's recovery seconds (repeatable)")
    p.add_argument("--interval", type=pos, default=None,
                   help=f"training seconds between saves ({NXD_CHECKPOINT_STEPS} steps)")
    p.add_argument("--sync-block", type=pos, default=SYNC_SAVE_7B_S,
                   help=f"seconds a synchronous save blocks training ({SYNC_SAVE_7B_S:g})")
    p.add_argument("--async-block", type=pos, default=ASYNC_SAVE_7B_S,
                   help=f"seconds an asynchronous save blocks training ({ASYNC_SAVE_7B_S:g})")
    p.add_argument("--async-complete", type=nonneg, default=SYNC_SAVE_7B_S,
                   help=f"seconds from an async save's start until it is complete "
                        f"({SYNC_SAVE_7B_S:g})")
    p.add_argument("--response-hours", type=nonneg, default=2.0,
                   help="without recovery: mean hours for a person to restart the job (2)")
    p.add_argument("--work-hours", type=nonneg, nargs=2, default=[9.0, 18.0],
                   metavar=("START", "END"),
                   help="when people respond (9 18); later faults wait; 0 24: round the clock")
    p.add_argument("--start-hour", type=nonneg, default=9.0, help="time of day the job starts (9)")
    p.add_argument("--runs", type=_number(int, 0, True), default=200,
                   help="Monte Carlo repetitions (200)")
    p.add_argument("--seed", type=_number(int, 0, False), default=0, help="random seed (0)")
    p.add_argument("--sweep-points", type=_number(int, 3, False), default=61,
                   help="checkpoint intervals in the sweep (61)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write goodput vs interval as a PNG")
    return p


def scenario_from_args(a: argparse.Namespace) -> Scenario:
    times = ClusterTimes(step_s=a.step_seconds, node_monitor_grace_s=a.node_monitor_grace,
                         compile_cache_load_s=a.compile_cache_load,
                         checkpoint_load_s=a.checkpoint_load,
                         node_replacement_s=a.node_replacement)
    costs = dict(times.fault_costs())
    for kind, seconds in a.detection:
        costs[kind] = FaultCost(seconds, costs[kind].recovery_s)
    for kind, seconds in a.recovery:
        costs[kind] = FaultCost(costs[kind].detection_s, seconds)
    base = Scenario(nodes=a.nodes, duration_s=a.days * DAY,
                    shares=dict(zip(KINDS, a.shares, strict=True)), costs=costs,
                    people=People(a.response_hours * HOUR, *a.work_hours),
                    start_hour=a.start_hour % 24)
    mtbf = (a.node_mtbf_hours * HOUR if a.node_mtbf_hours is not None
            else node_mtbf_for(a.rate, base, a.target_uptime))
    return replace(base, node_mtbf_s=mtbf)


_FLAGS = {"work_start_h/work_end_h": "--work-hours", "target_uptime": "--target-uptime",
          "shares": "--shares", "response_s": "--response-hours"}
"""The flag behind a field whose check only the model can make."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        scenario = scenario_from_args(a)
        interval = a.interval or NXD_CHECKPOINT_STEPS * a.step_seconds
        report = fleet_report(scenario, interval, a.sync_block, a.async_block, a.async_complete,
                              a.runs, a.seed, a.sweep_points)
    except ValueError as err:
        name, _, what = str(err).partition(": ")
        parser.error(f"{_FLAGS.get(name, name)}: {what}")
    report["inputs"]["rate"] = "node-mtbf-hours" if a.node_mtbf_hours else a.rate
    if a.plot:
        if not report["optimum"]:
            parser.error("--plot: no faults, nothing to sweep")
        plot_sweep(report, a.plot)
    print(json.dumps(report, indent=2) if a.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
