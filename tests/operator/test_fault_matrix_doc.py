"""docs/operator.md's fault matrix names, for each fault, the end-to-end test that shows it:
each named test exists in the named module (a renamed or deleted test makes the doc a lie)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_every_test_the_fault_matrix_names_exists() -> None:
    doc = (ROOT / "docs" / "operator.md").read_text()
    table = doc[doc.index("## Fault matrix"):doc.index("## Heartbeats")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "test_" in line]
    assert len(rows) >= 15
    for row in rows:
        cell = row.rstrip(" |").rsplit(" | ", 1)[1]
        match = re.match(r"(test_e2e_\w+)(?: `(test_\w+)`)?$", cell)
        assert match, f"no test named in: {row}"
        source = (ROOT / "tests" / "operator" / f"{match.group(1)}.py").read_text()
        if match.group(2):
            assert f"def {match.group(2)}(" in source, f"{match.group(2)} not in {match.group(1)}"
