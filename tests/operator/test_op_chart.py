"""The Helm chart, checked without Helm: values documented and typed, generated files current,
templates referring only to values that exist, RBAC covering what the operator does."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from hlat_operator import dashboards

CHART = Path(__file__).resolve().parents[2] / "charts" / "hlat"
TYPES: dict[str, Any] = {
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
    "array": list,
    "object": dict,
}


def values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return loaded


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "hlat"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])


def test_every_values_key_has_a_comment() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^\s*([A-Za-z]\w*):", line)
        if not m:
            continue
        above = lines[i - 1].strip() if i else ""
        documented = above.startswith("#") or " # " in line
        assert documented, f"values.yaml:{i + 1}: {m.group(1)} has no comment"


def _check(schema: dict[str, Any], value: Any, path: str, defs: dict[str, Any]) -> None:
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    if "type" in schema:
        assert isinstance(value, TYPES[schema["type"]]), f"{path}: not {schema['type']}"
    if "enum" in schema:
        assert value in schema["enum"], path
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: {set(value) - set(props)} not in schema"
        for key, sub in value.items():
            if key in props:
                _check(props[key], sub, f"{path}.{key}", defs)


def test_values_match_their_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    v = values()
    _check(schema, v, "values", schema["definitions"])
    # `global` is Helm's: a parent chart's shared values reach a dependency under it
    assert set(schema["properties"]) - {"global"} == set(v), "schema and values.yaml: same keys"


def test_templates_use_only_values_that_exist() -> None:
    v = values()
    for template in (CHART / "templates").glob("*"):
        for ref in re.findall(r"\.Values((?:\.\w+)+)", template.read_text()):
            node: Any = v
            for part in ref.strip(".").split("."):
                assert isinstance(node, dict) and part in node, f"{template.name}: .Values{ref}"
                node = node[part]


def test_helpers_truncate_names_to_63() -> None:
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for name in ("hlat.name", "hlat.fullname", "hlat.chart"):
        assert f'define "{name}"' in helpers
    assert helpers.count("trunc 63") >= 4


def test_dashboard_and_its_configmap_are_current() -> None:
    for path, text in dashboards.outputs(CHART).items():
        assert path.read_text() == text, "run: python -m hlat_operator.dashboards --write"
    assert {p.stem for p in (CHART / "dashboards").glob("*.json")} == set(dashboards.DASHBOARDS)
    template = (CHART / dashboards.TEMPLATE_FILE).read_text()
    assert "do not edit" in template.splitlines()[0]
    assert v_label() == ("grafana_dashboard", "1")


def v_label() -> tuple[str, str]:
    d = values()["dashboards"]
    return d["label"], d["labelValue"]


def test_dashboards_show_what_operators_ask_for() -> None:
    exprs = " ".join(expr for _, _, expr in dashboards.queries())
    for metric in (
        "hlat_jobs", "hlat_job_uptime_ratio", "hlat_job_restarts_total",
        "hlat_job_time_to_recover_seconds_bucket", "hlat_job_lost_steps", "hlat_train_loss",
        "hlat_train_grad_norm", "hlat_train_grad_spikes_total", "hlat_train_lr",
        "hlat_train_tokens_per_second", "hlat_train_mfu", "hlat_train_step_seconds",
        "hlat_train_data_wait_seconds", "hlat_train_checkpoint_blocking_seconds",
        "hlat_job_checkpoint_age_seconds", "hlat_job_worker_heartbeat_age_seconds",
        "neuroncore_utilization_ratio", "neuron_runtime_memory_used_bytes",
    ):
        assert metric in exprs, metric
    for uid in dashboards.DASHBOARDS:
        board = json.loads((CHART / dashboards.dashboard_file(uid)).read_text())
        assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
        assert {v["name"] for v in board["templating"]["list"]} >= {"datasource", "namespace"}


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b([a-z_][a-z0-9_]*)(?=\{|\[)", expr))
    return {n for n in names if n not in {"by", "sum", "avg", "increase", "rate"}}


def test_every_queried_metric_is_exposed_by_its_source() -> None:
    """Operator metrics by the operator's registry, trainer metrics by the trainer's, and the
    hardware panels only by neuron-monitor's published names (no Trainium here to scrape)."""
    from opfakes import World
    from prometheus_client import generate_latest

    from hlat_operator.metrics import OperatorMetrics
    from hlat_trainer.metrics import TrainMetrics

    metrics = OperatorMetrics()
    metrics.observe("default", "tiny", World().step())  # a job seen once: its series exist
    exposed = metrics.render().decode()
    exposed += generate_latest(TrainMetrics().registry).decode()
    for _, panel, expr in dashboards.queries():
        for name in _metric_names(expr):
            if panel.hardware:
                assert name in dashboards.NEURON_MONITOR_METRICS | dashboards.KUBE_STATE_METRICS, name
                continue
            base = re.sub(r"_bucket$", "", name)  # a histogram's TYPE names its base
            assert f"# TYPE {base} " in exposed, name


def test_the_job_dashboard_shows_evaluation_results_beside_the_loss_and_against_tokens() -> None:
    """The committed job dashboard: "Evaluation results" beside the loss panel, the selected
    job's hlat_job_evaluation per metric; an XY chart, one per selected job, of the same against
    hlat_job_evaluation_tokens (the x field is the tokens query's legend, the queries joined on
    time); and every label those queries select on or name in a legend is one the operator's
    series carry."""
    from dataclasses import replace

    from opfakes import World

    from hlat_api.status import Evaluation
    from hlat_operator.metrics import OperatorMetrics

    board = json.loads((CHART / dashboards.dashboard_file("hlat-job")).read_text())
    by_title = {p["title"]: p for p in board["panels"]}
    loss, results = by_title["Training and validation loss"], by_title["Evaluation results"]
    xy = by_title["Evaluation results by tokens trained"]
    assert results["gridPos"]["y"] == loss["gridPos"]["y"]  # beside it
    assert results["gridPos"]["x"] == loss["gridPos"]["x"] + loss["gridPos"]["w"]
    job = '{namespace=~"$namespace", pretrainjob=~"$pretrainjob"}'
    assert [(t["expr"], t["legendFormat"]) for t in results["targets"]] == [
        (f"hlat_job_evaluation{job}", "{{pretrainjob}} {{metric}}")]
    assert results["type"] == "timeseries"
    assert (xy["type"], xy["repeat"]) == ("xychart", "pretrainjob")
    assert xy["transformations"] == [
        {"id": "joinByField", "options": {"byField": "Time", "mode": "outer"}}]
    legends = {t["expr"]: t["legendFormat"] for t in xy["targets"]}
    assert legends == {f"hlat_job_evaluation_tokens{job}": "tokens",
                       f"hlat_job_evaluation{job}": "{{metric}}"}
    assert xy["options"]["seriesMapping"] == "auto"
    assert xy["options"]["dims"]["x"] == legends[f"hlat_job_evaluation_tokens{job}"]

    metrics = OperatorMetrics()
    d = World().step()
    evaluation = Evaluation(step=100, tokens=1e5, job="tiny-eval-100", phase="Succeeded",
                            results={"eval_loss": 2.5})
    metrics.observe("default", "tiny", replace(d, status=d.status.model_copy(
        update={"evaluations": [evaluation]})))
    exported = {s.name: set(s.labels) for m in metrics.registry.collect() for s in m.samples}
    for panel in (results, xy):
        for target in panel["targets"]:
            name = target["expr"].split("{")[0]
            used = set(re.findall(r"(\w+)=~", target["expr"]))
            used |= set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
            assert used <= exported[name], (name, used)


def test_deployment_has_a_liveness_probe_and_runs_as_non_root() -> None:
    text = (CHART / "templates" / "deployment.yaml").read_text()
    assert "livenessProbe" in text and "/healthz" in text
    assert values()["podSecurityContext"]["runAsNonRoot"] is True
    assert "type: Recreate" in text
