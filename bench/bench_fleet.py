"""Uptime and goodput over four weeks on 64 trn1.32xlarge, with vs without automatic recovery and
sync vs async saves, simulated (hlat_operator.fleetsim) and set against the paper's Table 1.

The fault rate is fitted so that the uptime with recovery is Table 1's 98.81% (a fitted input,
not a prediction); the uptime without recovery then follows from the assumed human response, and
is the figure to compare. Also shown: the same job at Llama 3's fault rate, the restart time by
hand that Table 1 implies, and the checkpoint interval that maximises goodput (sweep vs
Young/Daly). Writes the goodput-vs-interval plot to docs/images/fleet-goodput.png.

    .venv/bin/python bench/bench_fleet.py [--runs 1000] [--seed 0] [--plot PATH]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from hlat_operator import fleetsim as fs
from hlat_operator import fleetsim_cli as cli

PLOT = Path(__file__).resolve().parents[1] / "docs" / "images" / "fleet-goodput.png"


def uptime_of(report: dict[str, Any], name: str) -> float:
    return float(next(s for s in report["scenarios"] if s["name"] == name)["uptime"]["mean"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=PLOT)
    a = p.parse_args()
    base = fs.Scenario()
    fitted = replace(base, node_mtbf_s=fs.fitted_node_mtbf_s(base, fs.PAPER_UPTIME_WITH))
    interval = fs.NXD_CHECKPOINT_STEPS * fs.HLAT_STEP_S
    report = cli.fleet_report(fitted, interval, runs=a.runs, seed=a.seed)
    report["inputs"]["rate"] = "hlat"
    print(cli.format_table(report))

    with_, without = uptime_of(report, "recovery, async"), uptime_of(report, "by hand, async")
    on_call = cli.fleet_report(replace(fitted, people=fs.People(work_start_h=0, work_end_h=24)),
                              interval, runs=a.runs, seed=a.seed, sweep_points=3)
    llama = cli.fleet_report(replace(base, node_mtbf_s=fs.llama3_node_mtbf_s()), interval,
                            runs=a.runs, seed=a.seed, sweep_points=3)
    rate = fitted.job_rate
    implied_h = (1 / fs.PAPER_UPTIME_WITHOUT - 1) / rate / fs.HOUR
    by_hand = next(s for s in report["scenarios"] if s["name"] == "by hand, async")
    per_fault_h = by_hand["down_s"]["mean"] / sum(by_hand["faults"].values()) / fs.HOUR
    print("\nvs the paper's Table 1 (uptime; ratio = simulated / paper)")
    rows = [
        ("with recovery (fitted to it)", with_, fs.PAPER_UPTIME_WITH),
        ("without: people 09-18, 2 h mean", without, fs.PAPER_UPTIME_WITHOUT),
        ("without: people on call 24 h", uptime_of(on_call, "by hand, async"),
         fs.PAPER_UPTIME_WITHOUT),
        ("Llama 3 rate, with recovery", uptime_of(llama, "recovery, async"), fs.PAPER_UPTIME_WITH),
        ("Llama 3 rate, people 09-18", uptime_of(llama, "by hand, async"),
         fs.PAPER_UPTIME_WITHOUT),
    ]
    for label, sim, paper in rows:
        print(f"  {label:<34}{100 * sim:>8.2f}%  vs {100 * paper:.2f}%  ratio {sim / paper:.3f}")
    print(f"  fitted node MTBF {fitted.node_mtbf_s / fs.HOUR:,.0f} h vs Llama 3's "
          f"{fs.llama3_node_mtbf_s() / fs.HOUR:,.0f} h per host: "
          f"{fs.llama3_node_mtbf_s() / fitted.node_mtbf_s:.1f}x the fault rate")
    print(f"  Table 1 implies {implied_h:.2f} h down per fault without recovery at the fitted "
          f"rate; the 09-18 model gives {per_fault_h:.2f} h")
    goodput = {s["name"]: s["goodput"]["mean"] for s in report["scenarios"]}
    print(f"  goodput async / sync with recovery at {interval:.0f} s: "
          f"{goodput['recovery, async'] / goodput['recovery, sync']:.3f}x")
    a.plot.parent.mkdir(parents=True, exist_ok=True)
    cli.plot_sweep(report, str(a.plot))
    print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
