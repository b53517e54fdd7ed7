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
    template = (CHART / dashboards.TEMPLATE_FILE).read_text()
    assert "do not edit" in template.splitlines()[0]
    assert v_label() == ("grafana_dashboard", "1")


def v_label() -> tuple[str, str]:
    d = values()["dashboards"]
    return d["label"], d["labelValue"]


def test_dashboard_shows_what_operators_ask_for() -> None:
    board = json.loads((CHART / dashboards.DASHBOARD_FILE).read_text())
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for metric in (
        "hlat_job_uptime_ratio",
        "hlat_job_restarts_total",
        "hlat_train_loss",
        "hlat_train_tokens_per_second",
        "hlat_train_mfu",
        "hlat_job_heartbeat_age_seconds",
    ):
        assert metric in exprs
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_operator_metrics_used_by_the_dashboard_exist() -> None:
    from hlat_operator.metrics import OperatorMetrics

    exposed = OperatorMetrics().render().decode()
    board = json.loads((CHART / dashboards.DASHBOARD_FILE).read_text())
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for name in set(re.findall(r"\b(hlat_job\w*|hlat_jobs)\b", exprs)):
        base = re.sub(r"_bucket$", "", name)
        assert f"# TYPE {base} " in exposed, name


def test_deployment_has_a_liveness_probe_and_runs_as_non_root() -> None:
    text = (CHART / "templates" / "deployment.yaml").read_text()
    assert "livenessProbe" in text and "/healthz" in text
    assert values()["podSecurityContext"]["runAsNonRoot"] is True
    assert "type: Recreate" in text
