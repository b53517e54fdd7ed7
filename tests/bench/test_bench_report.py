"""bench/report.py: the Markdown table and the goal verdict that `make bench` writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import report


def test_table_renders_header_separator_and_rows() -> None:
    text = report.table(["a", "b"], [[1, "x"], ["2.5", None]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | None |"]


@pytest.mark.parametrize("row", [["only one"], ["one", "two", "three"], []])
def test_table_rejects_a_ragged_row(row: list[str]) -> None:
    with pytest.raises(ValueError, match="cells"):
        report.table(["a", "b"], [["fine", "row"], row])


def test_verdict_met_only_when_every_figure_holds() -> None:
    def at_most(v: float) -> bool:
        return v <= 1.05

    assert report.verdict("t", {"median": 0.2, "fastest": 1.05}, at_most).met
    assert not report.verdict("t", {"median": 0.2, "fastest": 1.06}, at_most).met
    assert not report.verdict("t", {"median": 1.2, "fastest": 0.9}, at_most).met


@pytest.mark.parametrize("figures", [
    {"median": math.nan},
    {"median": 0.5, "fastest": math.nan},
    {"median": math.nan, "fastest": 0.5},
    {},
])
def test_verdict_is_never_met_on_nan_or_nothing(figures: dict[str, float]) -> None:
    # a predicate that NaN would pass (not (nan > 1) is True): the verdict must still refuse
    assert not report.verdict("t", figures, lambda v: not v > 1).met


def test_verdict_shows_every_figure() -> None:
    goal = report.verdict("ratio <= 1", {"median": 0.25, "fastest round": 0.5},
                          lambda v: v <= 1, "{:.2f}x")
    assert goal.figures == "0.25x median, 0.50x fastest round"
    assert goal.line() == "ratio <= 1: **met** (0.25x median, 0.50x fastest round)"


def test_emit_is_a_no_op_alone_and_round_trips_through_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = report.Section("k", "Title", "cmd", "body",
                             [report.Goal("g", "1", True)], [("alt", "images/x.png")])
    monkeypatch.delenv(report.REPORT_DIR_ENV, raising=False)
    assert report.emit(section) is None
    monkeypatch.setenv(report.REPORT_DIR_ENV, str(tmp_path / "out"))
    path = report.emit(section)
    assert path == tmp_path / "out" / "k.json"
    assert report.load(path) == section
