"""What `make bench` writes into docs/benchmarks.md: each benchmark's section, as Markdown.

A benchmark builds its section from the figures it measured in this run (never from figures
typed in) and hands it to `emit`. `bench/run_all.py` points every benchmark at one directory
(`HLAT_BENCH_REPORT_DIR`), then assembles docs/benchmarks.md from the sections there, in its
own order, under a header that names the machine. Run alone, a benchmark only prints.

A goal is judged by `verdict`: met only when every figure it is given (the median and the
fastest round, say) meets it, so a noisy run cannot pass on its luckiest number.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPORT_DIR_ENV = "HLAT_BENCH_REPORT_DIR"
DOCS = Path(__file__).resolve().parents[1] / "docs"
"""Where docs/benchmarks.md lives: image paths of a section are relative to it."""


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table; cells are str()-ed (format numbers before passing them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row!r} has {len(row)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Goal:
    """One goal of an issue and how this run measured against it."""

    text: str
    """The goal as the issue states it, e.g. "SR AdamW step time <= 1.05x torch AdamW"."""
    figures: str
    """What this run measured, e.g. "0.19x median, 0.20x fastest round"."""
    met: bool

    def line(self) -> str:
        return f"{self.text}: **{'met' if self.met else 'not met'}** ({self.figures})"


def verdict(text: str, figures: dict[str, float], holds: Callable[[float], bool],
            fmt: str = "{:.3g}") -> Goal:
    """Goal `text` is met only when `holds` is true for every figure (e.g. median and
    fastest); NaN (not measured) never holds."""
    shown = ", ".join(f"{fmt.format(v)} {k}" for k, v in figures.items())
    met = bool(figures) and all(v == v and holds(v) for v in figures.values())
    return Goal(text, shown, met)


@dataclass
class Section:
    key: str
    """File name and order key (run_all's list), e.g. "optimizer"."""
    title: str
    command: str
    """How to run this benchmark alone."""
    body: str
    """Markdown: what was run, the tables, notes on reading them."""
    goals: list[Goal] = field(default_factory=list)
    images: list[tuple[str, str]] = field(default_factory=list)
    """(alt text, path relative to docs/), e.g. ("loss by precision", "images/x.png")."""

    def markdown(self) -> str:
        parts = [f"## {self.title}", f"`{self.command}`", self.body.strip()]
        if self.goals:
            parts.append("\n".join(f"- {g.line()}" for g in self.goals))
        parts += [f"![{alt}]({path})" for alt, path in self.images]
        return "\n\n".join(parts) + "\n"


def emit(section: Section) -> Path | None:
    """Write the section where run_all collects them (nothing when run alone)."""
    where = os.environ.get(REPORT_DIR_ENV)
    if not where:
        return None
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{section.key}.json"
    data = asdict(section)
    path.write_text(json.dumps(data, indent=1))
    return path


def load(path: Path) -> Section:
    data = json.loads(path.read_text())
    data["goals"] = [Goal(**g) for g in data.get("goals", [])]
    data["images"] = [tuple(i) for i in data.get("images", [])]
    return Section(**data)


# --- helpers the benchmarks share ----------------------------------------------------------


def command(argv: Sequence[str] | None = None) -> str:
    """The command line that reproduces this run, from the repository root: the script's own
    arguments as it was given them (run_all's included)."""
    args = list(sys.argv if argv is None else argv)
    return shlex.join([".venv/bin/python", f"bench/{Path(args[0]).name}", *args[1:]])


def now() -> str:
    """The date and time of the run, with its time zone."""
    return datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def spread(values: Sequence[float]) -> float:
    """Interquartile range over the median: how far the rounds scatter (NaN under 2 values)."""
    if len(values) < 2:
        return math.nan
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / statistics.median(values)


def image(path: Path) -> str:
    """An image's path as docs/benchmarks.md links it: relative to docs/ when it is inside."""
    path = path.resolve()
    return str(path.relative_to(DOCS)) if path.is_relative_to(DOCS) else str(path)


def pct(value: float, digits: int = 1) -> str:
    return f"{100 * value:.{digits}f}%"
