"""What README.md and docs/testbed.md say about setting up the local cluster is what the code
does: the Go they ask for is the newest the pinned modules need (the builds run with
GOTOOLCHAIN=local, so an older Go stops), and every `hlat-cluster up` line that counts nodes
counts what that command starts. Both were wrong once (Go 1.25; "3 nodes" for a default of 2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hlat_testbed import build, cli

ROOT = Path(__file__).parents[2]
DOCS = (ROOT / "README.md", ROOT / "docs" / "testbed.md")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_readme_asks_for_the_go_the_pinned_modules_need(
        monkeypatch: pytest.MonkeyPatch) -> None:
    wrappers = sorted((ROOT / "testbed").glob("*/go.mod"))
    assert {w.parent.name for w in wrappers} >= {"k8s", "prometheus", "helm"}
    directives = [re.search(r"^go (\S+)$", w.read_text(), re.M) for w in wrappers]
    needed = max(_version(d.group(1)) for d in directives if d)
    readme = (ROOT / "README.md").read_text()
    asked = re.search(r"Go (\d+\.\d+(?:\.\d+)?) or newer", readme)
    assert asked, "README.md does not say which Go to install"
    assert _version(asked.group(1)) == needed
    monkeypatch.delenv("GOTOOLCHAIN", raising=False)
    assert build._go_env()["GOTOOLCHAIN"] == "local"  # why an older Go stops instead of fetching
    assert "GOTOOLCHAIN=local" in readme
    hint = re.search(r"install Go >= (\S+) ", Path(build.__file__).read_text())
    assert hint and _version(hint.group(1)) == needed


def test_every_hlat_cluster_up_line_counts_the_nodes_it_starts() -> None:
    default = cli._parser().parse_args(["up"]).nodes
    checked = 0
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            if "hlat-cluster up" not in line or "#" not in line:
                continue
            command, comment = line.split("#", 1)
            given = re.search(r"--nodes (\d+)", command)
            for said in re.findall(r"(\d+) nodes", comment):
                assert int(said) == (int(given.group(1)) if given else default), (doc, line)
                checked += 1
            for said in re.findall(r"default (\d+)", comment):
                assert int(said) == default, (doc, line)
                checked += 1
    assert checked >= 3
