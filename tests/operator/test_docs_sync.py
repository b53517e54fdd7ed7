"""docs/operator.md and the chart's NOTES.txt say what the code does: the reason table lists every
reason the operator can set, the metrics table every metric it serves with its exact labels,
the badput `cause` label values are the status's keys, the fault matrix's benchmark figures are
the latest `make bench` run's, and NOTES.txt names the dashboards the chart ships and the
columns `kubectl get pj` prints. Each was wrong once; a query or a command written from the
docs then found nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from opfakes import World, raw_spec
from prometheus_client.metrics import MetricWrapperBase

from hlat_api.labels import Reason
from hlat_api.status import Badput, Goodput
from hlat_operator.crd import PRINTER_COLUMNS
from hlat_operator.dashboards import DASHBOARDS
from hlat_operator.metrics import OperatorMetrics

ROOT = Path(__file__).parents[2]
OPERATOR_DOC = (ROOT / "docs" / "operator.md").read_text()
CHART = ROOT / "charts" / "hlat"


def _section(doc: str, start: str, end: str) -> str:
    return doc[doc.index(start):doc.index(end, doc.index(start))]


def _table_rows(text: str) -> list[list[str]]:
    """The cells of a Markdown table's body rows (header and rule dropped)."""
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[1:]
            if not row.startswith("|---")]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_reason_table_lists_every_reason_the_operator_can_set() -> None:
    table = _section(OPERATOR_DOC, "## Phases, conditions, reasons", "## Fault matrix")
    documented = {name for row in _table_rows(table) for name in _ticked(row[0])}
    assert documented == {str(r) for r in Reason}, (
        f"missing: {sorted({str(r) for r in Reason} - documented)}, "
        f"not a Reason: {sorted(documented - {str(r) for r in Reason})}")


def _served() -> dict[str, tuple[str, frozenset[str]]]:
    """Exposed name -> (type, label names), from the operator's own registry."""
    m = OperatorMetrics()
    out = {}
    for metric in vars(m).values():
        if isinstance(metric, MetricWrapperBase):
            # prometheus_client keeps a metric's type and label names private; the exposition
            # (generate_latest) shows labels only of series that exist yet
            kind = metric._type
            name = metric._name + ("_total" if kind == "counter" else "")
            out[name] = (kind, frozenset(metric._labelnames))
    return out


def test_the_metrics_table_lists_every_metric_with_its_type_and_labels() -> None:
    table = _section(OPERATOR_DOC, "## Metrics", "## Monitoring")
    documented = {}
    for row in _table_rows(table):
        (name,), kind, labels = _ticked(row[0]), row[1], frozenset(_ticked(row[2]))
        documented[name] = (kind, labels)
    assert documented == _served()


def test_badput_cause_label_values_are_the_status_s_keys() -> None:
    """A PromQL query written from the status (or the docs' goodput table) finds the series:
    `cause="dataWait"` as `status.goodput.badputSeconds.dataWait`."""
    m = OperatorMetrics()
    d = World(raw_spec()).step()
    status = d.status.model_copy(update={"goodput": Goodput(
        wall_seconds=30, badput_seconds=Badput(data_wait=5, final_checkpoint=3))})
    m.observe("default", "tiny", replace(d, status=status))
    series = [s for family in m.registry.collect() if family.name == "hlat_job_badput_seconds"
              for s in family.samples if s.name.endswith("_total")]
    keys = set(Badput().model_dump(by_alias=True)) - {"unreported"}
    assert {s.labels["cause"] for s in series} == keys
    seconds = {s.labels["cause"]: s.value for s in series}
    assert seconds["dataWait"] == 5 and seconds["finalCheckpoint"] == 3
    goodput_table = _section(OPERATOR_DOC, "| cause | what | measured by |", "Every second")
    assert {_ticked(row[0])[0] for row in _table_rows(goodput_table)} == keys | {"unreported"}


_BENCH_CASES = {
    # fault matrix row (its first cell starts so) -> docs/benchmarks.md section 5 (fault, strategy)
    "worker SIGKILLed": ("worker SIGKILLed", "RecreateGang"),
    "worker frozen": ("worker hung, timeout 8 s", "RecreateGang"),
    "node lost |": ("node down", "RecreateGang"),
    "trainer SIGKILLed, `restartStrategy: InPlace`": ("trainer SIGKILLed", "InPlace"),
    "trainer frozen": ("trainer hung, timeout 8 s", "InPlace"),
    "node lost, InPlace (only": ("node down", "InPlace"),
    "node lost, InPlace with a warm spare (": ("node down, a warm spare", "InPlace+spare"),
    "trainer SIGKILLed, InPlace with in-memory snapshots": (
        "trainer SIGKILLed, snapshots in memory every step", "InPlace+memory"),
    "node lost, InPlace with a warm spare and snapshots": (
        "node down, a warm spare, snapshots and their copies in memory every step",
        "InPlace+spare+memory"),
}


def test_the_fault_matrix_s_benchmark_figures_are_the_latest_runs() -> None:
    bench_doc = (ROOT / "docs" / "benchmarks.md").read_text()
    bench = {(row[0], row[1]): row[4].split(" / ")[0] + " s" for row in _table_rows(
        _section(bench_doc, "## 5. Time from a fault", "## 6."))}
    matrix = [line for line in _section(OPERATOR_DOC, "## Fault matrix", "### Restart strategies")
              .splitlines() if line.startswith("| ")]
    marked = [line for line in matrix if "(b" in line.split(" | ")[2]]
    assert len(marked) == len(_BENCH_CASES), "a (b) row without a benchmark case, or one lost"
    for start, case in _BENCH_CASES.items():
        (row,) = [line for line in matrix if line[2:].startswith(start)]
        figure = row.split(" | ")[2]
        assert figure.startswith(bench[case] + " (b"), (
            f"{start}: the matrix says {figure!r}, docs/benchmarks.md {bench[case]!r}")


def _notes_as_rendered(helm: Path, tmp_path: Path) -> str:
    """NOTES.txt as `helm install` would print it: `helm template` skips NOTES.txt, so a copy of
    the chart renders its text through a named template into a ConfigMap-free document."""
    chart = tmp_path / "hlat"
    shutil.copytree(CHART, chart)
    notes = chart / "templates" / "NOTES.txt"
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "hlat.notes" -}}\n' + notes.read_text() + "\n{{- end -}}\n")
    notes.unlink()
    (chart / "templates" / "notes.yaml").write_text(
        'notes: {{ include "hlat.notes" . | toJson }}\n')
    out = subprocess.run([str(helm), "template", "hlat", str(chart), "-n", "hlat-system", "--set",
                          "image.repository=registry.example/hlat-operator",
                          "--show-only", "templates/notes.yaml"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return str(yaml.safe_load(out)["notes"])


@pytest.mark.slow
def test_notes_name_the_shipped_dashboards_and_the_columns_kubectl_prints(
        helm: Path, tmp_path: Path) -> None:
    notes = _notes_as_rendered(helm, tmp_path)
    shipped = sorted(p.stem for p in (CHART / "dashboards").glob("*.json"))
    assert shipped == sorted(DASHBOARDS)
    prose = " ".join(notes.split())
    for uid, (title, *_) in DASHBOARDS.items():
        assert f'"{title}" (uid {uid}' in prose, f"NOTES.txt does not name dashboard {uid}"
    assert "ConfigMap hlat-dashboards in namespace hlat-system" in prose
    lines = notes.splitlines()
    (get,) = [line for line in lines if "kubectl get pj -w" in line]
    (wide,) = [line for line in lines if "kubectl get pj -o wide" in line]
    default = [c["name"] for c in PRINTER_COLUMNS if not c.get("priority")]
    extra = [c["name"] for c in PRINTER_COLUMNS if c.get("priority")]
    assert [c.strip() for c in get.split("#", 1)[1].split(",")] == default
    assert [w for w in extra if w in wide.split("#", 1)[1]] == extra
