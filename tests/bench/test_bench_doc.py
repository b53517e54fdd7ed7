"""bench/run_all.py's assembly of docs/benchmarks.md (a pure function of the sections, the
benchmarks' outcomes and the machine): nothing is left out silently."""

from __future__ import annotations

import re

import report
import run_all

ORDER = [
    run_all.Bench("alpha", "Alpha bench", ("bench_alpha.py", "--rounds", "3")),
    run_all.Bench("beta", "Beta bench", ("bench_beta.py",)),
    run_all.Bench("gamma", "Gamma bench", ("bench_gamma.py",)),
    run_all.Bench("delta", "Delta bench", ("bench_delta.py",)),
]
MACHINE = run_all.Machine("AMD EPYC", 2, 23.5, "3.11.7", "2.15.0", "abc1234", True,
                          "2026-11-26 02:00 UTC", 1.5, 2.5, 600.0)
LOG = "\n".join(f"log line {i}" for i in range(30)) + "\nTraceback: boom"


def doc() -> str:
    sections = {
        "alpha": report.Section("alpha", "Alpha measured", "cmd alpha", "alpha body", [
            report.verdict("alpha ratio <= 1", {"median": 0.5, "fastest": 0.7}, lambda v: v <= 1),
            report.verdict("alpha memory <= 0.75", {"bytes": 0.9}, lambda v: v <= 0.75),
        ]),
        # beta failed after writing a section: its figures must not pass for this run's
        "beta": report.Section("beta", "Beta measured", "cmd beta", "beta body",
                               [report.Goal("beta goal", "1", True)]),
    }
    outcomes = {
        "alpha": run_all.Outcome(0, 10.0, "ok"),
        "beta": run_all.Outcome(3, 12.0, "\n".join(LOG.splitlines()[-run_all.LOG_TAIL_LINES:])),
        "delta": run_all.Outcome(0, 1.0, "finished"),  # exit 0, but wrote no section
    }
    return run_all.assemble(ORDER, sections, outcomes, MACHINE)


def section_of(text: str, number: int) -> str:
    parts = re.split(r"^## ", text, flags=re.M)
    found = [p for p in parts if p.startswith(f"{number}. ")]
    assert len(found) == 1, f"section {number} missing or repeated"
    return found[0]


def test_every_bench_has_its_section_in_order() -> None:
    text = doc()
    titles = re.findall(r"^## (\d+)\. (.*)$", text, flags=re.M)
    assert titles == [("1", "Alpha measured"), ("2", "Beta bench"), ("3", "Gamma bench"),
                      ("4", "Delta bench")]


def test_a_failed_bench_shows_its_exit_code_and_log_tail() -> None:
    beta = section_of(doc(), 2)
    assert "exit code 3" in beta
    assert "`.venv/bin/python bench/bench_beta.py`" in beta
    block = re.search(r"```\n(.*?)\n```", beta, flags=re.S)
    assert block is not None
    assert block.group(1).splitlines() == LOG.splitlines()[-run_all.LOG_TAIL_LINES:]
    assert "beta body" not in beta  # the figures of a failed run are not shown as results


def test_a_bench_that_wrote_no_section_is_not_omitted() -> None:
    delta = section_of(doc(), 4)
    assert "no section" in delta
    assert "finished" in delta


def test_not_run_benches_are_marked() -> None:
    text = doc()
    gamma = section_of(text, 3)
    assert "Not run in this `make bench`" in gamma
    assert "`.venv/bin/python bench/bench_gamma.py`" in gamma
    assert re.search(r"^\| 3\. gamma \| - \| - \| \*\*not run\*\* \|$", text, flags=re.M)


def test_summary_lists_every_goal_with_its_verdict() -> None:
    text = doc()
    summary = text[text.index("## Goals"):text.index("## 1. ")]
    rows = [line for line in summary.splitlines() if line.startswith("| ")][1:]
    assert rows == [
        "| 1. alpha | alpha ratio <= 1 | 0.5 median, 0.7 fastest | **met** |",
        "| 1. alpha | alpha memory <= 0.75 | 0.9 bytes | **not met** |",
        "| 2. beta | - | - | **failed (exit code 3)** |",
        "| 3. gamma | - | - | **not run** |",
        "| 4. delta | - | - | **wrote no section** |",
    ]
    assert "2 goals, 1 met." in summary


def test_header_names_the_machine_and_the_history() -> None:
    head = doc().split("## Goals")[0]
    for fact in ("AMD EPYC", "2 vCPUs", "23.5 GiB", "3.11.7", "torch 2.15.0", "abc1234",
                 "uncommitted changes", "2026-11-26 02:00 UTC", "1.50", "2.50", "10.0 min",
                 "(benchmark-history.md)"):
        assert fact in head, fact


def test_a_pipe_in_a_goal_does_not_break_the_summary_table() -> None:
    sections = {"alpha": report.Section("alpha", "A", "c", "b",
                                        [report.Goal("x | y", "1 | 2", False)])}
    text = run_all.assemble(ORDER[:1], sections, {"alpha": run_all.Outcome(0, 1.0, "")},
                            MACHINE)
    assert "| 1. alpha | x \\| y | 1 \\| 2 | **not met** |" in text
