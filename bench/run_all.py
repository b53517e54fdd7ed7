"""`make bench`: run every benchmark in bench/, then write docs/benchmarks.md from what they measured.

Each benchmark runs as a subprocess with `HLAT_BENCH_REPORT_DIR` pointing at a fresh report
directory (runs/bench-report/, wiped at the start): it writes its section there
(`report.emit`), and its stdout and stderr go both to the console and to `<key>.log` there.
Then docs/benchmarks.md is assembled: the machine, a summary of every goal, and the sections
in the order below. A benchmark that failed or wrote no section gets its section anyway, with
its exit code and the end of its log; one left out by `--only` is marked as not run.

    .venv/bin/python bench/run_all.py --data data/sample [--only model,loader] [--no-doc]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import report

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REPORT_DIR = REPO / "runs" / "bench-report"
DOC = REPO / "docs" / "benchmarks.md"
HISTORY = "benchmark-history.md"
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class Bench:
    key: str
    """The section's key: the script's name without `bench_` and `.py`."""
    title: str
    """The section's title when the benchmark wrote none (failed, not run)."""
    args: tuple[str, ...]
    """The script (in bench/) and its arguments."""

    @property
    def command(self) -> str:
        return shlex.join([".venv/bin/python", f"bench/{self.args[0]}", *self.args[1:]])


def benches(data: str | None) -> list[Bench]:
    """Every benchmark, in the document's order."""
    with_data = ("--data", data) if data else ()
    return [
        # both sizes in one process: tiny (batch 4, 20 timed rounds), small (batch 2, 8 rounds)
        Bench("model", "Our decoder vs HF `transformers` LlamaForCausalLM (training tokens/s, "
              "CPU, fp32)",
              ("bench_model.py", "--size", "tiny", "small")),
        Bench("optimizer", "Stochastic-rounding AdamW vs torch AdamW with fp32 master weights",
              ("bench_optimizer.py",)),
        Bench("loader", "Data loader tokens/s on one core vs what the trainer consumes",
              ("bench_loader.py", *with_data)),
        Bench("checkpoint", "Checkpoints: training time lost, synchronous vs asynchronous",
              ("bench_checkpoint.py", *with_data)),
        # needs root: it runs the local cluster
        Bench("recovery", "Time from a fault to the next training step, per fault kind and "
              "restart strategy (local cluster)",
              ("bench_recovery.py",)),
        # a sweep of injected slowdowns on the same local cluster (about 12 minutes)
        Bench("stragglers", "Straggler detection: precision and recall over injected "
              "slowdowns (local cluster)", ("bench_stragglers.py",)),
        # 500 jobs on simulated nodes, same local cluster
        Bench("operator_scale", "The operator at 500 jobs", ("bench_operator_scale.py",)),
        # simulated: writes docs/images/fleet-goodput.png
        Bench("fleet", "Fleet simulator: uptime and goodput over four weeks vs the paper's "
              "Table 1", ("bench_fleet.py",)),
        # needs a CUDA device; without one it shows the recorded GPU run, marked as such
        Bench("gpu", "On a GPU: MFU of a 1B LLaMA in bf16-SR, and AdamWSR's Triton kernel",
              ("bench_gpu.py", "--compile")),
        # the paper's precision, beta2 and spike-length findings: docs/images/fidelity-*.png;
        # a sample of its own (training documents and a held-out set, which make's has not)
        Bench("fidelity", "The paper's precision findings at small scale",
              ("bench_fidelity.py",)),
        # torchrun, 2 ranks: the agreement on a checkpoint asked for, on vs off
        Bench("ondemand", "Checkpoints asked for at a stop: the per-step agreement's cost",
              ("bench_ondemand.py",)),
    ]


@dataclass(frozen=True)
class Outcome:
    """How one benchmark's run went."""

    returncode: int
    seconds: float
    log_tail: str
    """The last lines of its stdout and stderr."""


@dataclass(frozen=True)
class Machine:
    cpu: str
    vcpus: int
    ram_gib: float
    python: str
    torch: str
    commit: str
    dirty: bool
    date: str
    load_start: float
    load_end: float
    wall_s: float


# --- the document: a pure function of the sections, the outcomes and the machine -------------


def failed_section(bench: Bench, outcome: Outcome, emitted: bool) -> report.Section:
    what = (f"**Failed** in this `make bench`: exit code {outcome.returncode} after "
            f"{outcome.seconds:.0f} s" if outcome.returncode != 0 else
            f"**Wrote no section** in this `make bench` (exit code 0 after "
            f"{outcome.seconds:.0f} s)")
    note = (" It wrote a section before failing; its figures are left out." if emitted
            and outcome.returncode != 0 else "")
    tail = outcome.log_tail.rstrip() or "(empty)"
    body = (f"{what}.{note} The last {LOG_TAIL_LINES} lines of its log:\n\n"
            f"```\n{tail}\n```")
    return report.Section(bench.key, bench.title, bench.command, body)


def not_run_section(bench: Bench) -> report.Section:
    return report.Section(bench.key, bench.title, bench.command,
                          "Not run in this `make bench` (`--only` left it out): no figures.")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def assemble(order: Sequence[Bench], sections: Mapping[str, report.Section],
             outcomes: Mapping[str, Outcome], machine: Machine) -> str:
    """docs/benchmarks.md. `outcomes`: the benchmarks that ran (others are marked not run);
    `sections`: what they wrote, by key (a benchmark that failed or wrote none gets its
    failure instead)."""
    parts: list[report.Section] = []
    summary: list[list[str]] = []
    for i, bench in enumerate(order, start=1):
        outcome = outcomes.get(bench.key)
        if outcome is None:
            section, state = not_run_section(bench), "not run"
        elif outcome.returncode != 0 or bench.key not in sections:
            section = failed_section(bench, outcome, bench.key in sections)
            state = (f"failed (exit code {outcome.returncode})" if outcome.returncode
                     else "wrote no section")
        else:
            section, state = sections[bench.key], ""
        section = replace(section, title=f"{i}. {section.title}")
        parts.append(section)
        name = f"{i}. {bench.key}"
        if state:
            summary.append([name, "-", "-", f"**{state}**"])
        for goal in section.goals:
            summary.append([name, _cell(goal.text), _cell(goal.figures),
                            "**met**" if goal.met else "**not met**"])
    dirty = " with uncommitted changes" if machine.dirty else ""
    met = sum(row[-1] == "**met**" for row in summary)
    goals = sum(row[-1] in ("**met**", "**not met**") for row in summary)
    head = f"""# Benchmarks

Written by `make bench` (`bench/run_all.py`) from the figures of one run: do not edit by hand,
run it again. Figures and analyses of earlier runs, written by hand before, are in
[the benchmark history]({HISTORY}). Each benchmark measures against a baseline in the same run,
side by side; a goal measured over rounds is met only when it holds on both the median and
the fastest round. Each benchmark can be run alone with the command under its heading.

**Machine:** {machine.cpu}, {machine.vcpus} vCPUs, {machine.ram_gib:.1f} GiB RAM; Python
{machine.python}, torch {machine.torch}. **Code:** commit `{machine.commit}`{dirty}.
**Run:** {machine.date}, {machine.wall_s / 60:.1f} min in all; load average (1 min)
{machine.load_start:.2f} at the start, {machine.load_end:.2f} at the end.

## Goals

{goals} goals, {met} met.

{report.table(["section", "goal", "this run", "result"], summary)}
"""
    return head + "".join("\n" + p.markdown() for p in parts)


# --- running the benchmarks -------------------------------------------------------------------


def run(bench: Bench, out: Path) -> Outcome:
    """Run one benchmark, its output to the console and to out/<key>.log."""
    env = {**os.environ, report.REPORT_DIR_ENV: str(out), "PYTHONUNBUFFERED": "1"}
    log_path = out / f"{bench.key}.log"
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, str(HERE / bench.args[0]), *bench.args[1:]],
                                cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    lines = log_path.read_text(errors="replace").splitlines()
    return Outcome(code, time.monotonic() - start, "\n".join(lines[-LOG_TAIL_LINES:]))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine_facts(load_start: float, wall_s: float, date: str, commit: str,
                  dirty: bool) -> Machine:
    cpu = platform.processor() or platform.machine()
    ram = 0.0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) / 2**20
    except OSError:
        pass
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return Machine(cpu, os.cpu_count() or 0, ram, platform.python_version(), torch,
                   commit or "unknown", dirty, date, load_start, os.getloadavg()[0], wall_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="sample dataset directory (hlat-data sample --out DIR)")
    p.add_argument("--only", help="comma-separated keys to run (the others are marked not run)")
    p.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--doc", type=Path, help="where to write the document (default: "
                   "docs/benchmarks.md when every benchmark runs; with --only, only the "
                   "report directory's copy, so a partial run does not replace the doc)")
    p.add_argument("--report-dir", type=Path, default=REPORT_DIR,
                   help="sections and logs of this run (wiped at the start)")
    a = p.parse_args()
    order = benches(a.data)
    keys = [b.key for b in order]
    only = [k for k in (a.only or "").split(",") if k] or keys
    unknown = sorted(set(only) - set(keys))
    if unknown:
        p.error(f"--only: unknown key(s) {', '.join(unknown)} (known: {', '.join(keys)})")

    date = report.now()
    load_start, start = os.getloadavg()[0], time.monotonic()
    commit, dirty = _git("rev-parse", "--short", "HEAD"), bool(_git("status", "--porcelain"))
    shutil.rmtree(a.report_dir, ignore_errors=True)
    a.report_dir.mkdir(parents=True)
    outcomes: dict[str, Outcome] = {}
    for bench in order:
        if bench.key not in only:
            continue
        print(f"\n=== {bench.key}: {bench.command}", flush=True)
        outcomes[bench.key] = run(bench, a.report_dir)
    sections = {s.key: s for s in map(report.load, sorted(a.report_dir.glob("*.json")))}
    machine = machine_facts(load_start, time.monotonic() - start, date, commit, dirty)
    doc = assemble(order, sections, outcomes, machine)
    (a.report_dir / "benchmarks.md").write_text(doc)
    failed = [k for k, o in outcomes.items() if o.returncode != 0 or k not in sections]
    print(f"\nsections and logs: {a.report_dir}")
    if a.doc is None and not a.only:
        a.doc = DOC
    if not a.no_doc and a.doc is not None:
        a.doc.parent.mkdir(parents=True, exist_ok=True)
        a.doc.write_text(doc)
        print(f"wrote {a.doc}")
    if failed:
        print(f"failed or wrote no section: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
