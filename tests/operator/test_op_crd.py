"""The generated CRD: current, structural, documented, and its CEL rules agree with pydantic.

No API server here, so the CEL rules are checked with a tiny evaluator for the subset they use
(`has`, field access, arithmetic, comparisons, `!`/`&&`/`||`, `size`), after applying the
schema's defaults the way the API server does before validating.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from opfakes import raw_spec
from pydantic import ValidationError

from hlat_api.spec import PretrainJobSpec
from hlat_operator import crd

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"$ref", "anyOf", "oneOf", "allOf", "not", "const", "prefixItems", "title", "$defs"}


def test_crd_yaml_is_current() -> None:
    path = ROOT / "crds" / "pretrainjob.yaml"
    assert path.read_text() == crd.render(), "run: python -m hlat_operator.crd --write"
    chart = ROOT / "charts" / "hlat" / "files" / "pretrainjob-crd.yaml"
    assert chart.read_text() == crd.render(helm=True), "run: python -m hlat_operator.crd --write"


def test_crd_identity() -> None:
    c = crd.build_crd()
    spec = c["spec"]
    assert c["metadata"]["name"] == "pretrainjobs.hlat.dev"
    assert spec["names"]["kind"] == "PretrainJob" and spec["names"]["shortNames"] == ["pj"]
    assert spec["scope"] == "Namespaced"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    cols = [col["name"] for col in version["additionalPrinterColumns"]]
    assert cols[:10] == ["Phase", "Why", "Nodes", "Progress", "Loss", "Val Loss", "Goodput",
                         "Uptime", "Restarts", "Age"]


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, child in (node.get("properties") or {}).items():
        out += _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


@functools.cache
def _crd() -> dict[str, Any]:
    return crd.build_crd()


def _root() -> dict[str, Any]:
    schema: dict[str, Any] = _crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_schema_is_structural() -> None:
    for path, node in _walk(_root()):
        assert not FORBIDDEN & node.keys(), f"{path}: {FORBIDDEN & node.keys()}"
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path} has no type"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(key, True) is True, f"{path}: {key} must be boolean in OpenAPI v3.0"
        # the API server owns metadata's schema
        if node.get("type") == "object" and "properties" not in node and path != ".metadata":
            assert "additionalProperties" in node or node.get(
                "x-kubernetes-preserve-unknown-fields"
            )


def test_every_spec_field_is_in_the_schema_with_a_description() -> None:
    spec = _root()["properties"]["spec"]
    assert set(spec["properties"]) == {
        f.alias or n for n, f in PretrainJobSpec.model_fields.items()
    }
    for path, node in _walk(spec, "spec"):
        if path.startswith(("spec.scheduling.tolerations[].", "spec.evaluation.tolerations[].")) or path.endswith(("[]", "{}")):
            continue  # the Kubernetes Toleration's own fields; list items and map values
        assert node.get("description"), f"{path} has no description"


def test_schema_defaults_are_the_models_defaults() -> None:
    spec = _root()["properties"]["spec"]["properties"]
    assert spec["nodes"]["default"] == 1
    assert spec["optimizer"]["properties"]["betas"]["default"] == [0.9, 0.95]
    assert spec["checkpoint"]["properties"]["async"]["default"] is True
    status = _root()["properties"]["status"]
    assert all("default" not in n for _, n in _walk(status)), "status is never defaulted"


def test_printer_columns_point_at_schema_fields() -> None:
    root = _root()
    for col in crd.PRINTER_COLUMNS:
        parts = col["jsonPath"].lstrip(".").split(".")
        if parts[0] == "metadata":
            continue
        node = root
        for part in parts:
            node = node["properties"][part]
        assert node.get("type") == col["type"] or col["type"] == "date", col


# --- CEL rules ---------------------------------------------------------------------------------


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _apply_defaults(sub, value[name])
    return value


class _Obj(dict[str, Any]):
    def __getattr__(self, name: str) -> Any:
        return _wrap(self[name])


def _wrap(value: Any) -> Any:
    return _Obj(value) if isinstance(value, dict) else value


def _cel(rule: str, obj: dict[str, Any]) -> bool:
    expr = re.sub(r"has\(self\.([\w.]+)\)", r"_has(self, '\1')", rule)
    expr = expr.replace("&&", " and ").replace("||", " or ")
    expr = re.sub(r"!(?!=)", " not ", expr).replace("size(", "len(")
    expr = re.sub(r"\b(\d+) % ", r"\1 % ", expr)

    def _has(node: Any, path: str) -> bool:
        for part in path.split("."):
            if not isinstance(node, dict) or node.get(part) is None:
                return False
            node = node[part]
        return True

    return bool(eval(expr, {"_has": _has, "len": len}, {"self": _wrap(obj)}))


def _violations(spec: dict[str, Any]) -> list[str]:
    root = _root()
    spec_schema = root["properties"]["spec"]
    obj = _apply_defaults(spec_schema, copy.deepcopy(spec))
    failed = []
    for path, node in _walk(spec_schema):
        value: Any = obj
        for part in path.strip(".").split(".") if path else []:
            value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, dict):
            continue
        for rule in node.get("x-kubernetes-validations", []):
            if not _cel(rule["rule"], value):
                failed.append(f"spec{path}{rule.get('fieldPath', '')}: {rule['message']}")
    return failed


def test_valid_specs_pass_every_rule() -> None:
    assert _violations(raw_spec()) == []
    example = yaml.safe_load((ROOT / "examples" / "pretrainjob-tiny.yaml").read_text())
    assert _violations(example["spec"]) == []
    assert (
        _violations(
            raw_spec(
                **{"model": {"preset": "70b"}, "parallelism": {"tensor": 8}, "processesPerNode": 8}
            )
        )
        == []
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"optimizer.minLr": 0.1}, "spec.optimizer.minLr"),
        ({"train.tokens": 1e6}, "spec.train.steps"),
        ({"train.steps": None}, "spec.train.steps"),
        ({"parallelism.pipeline": 2}, "spec.parallelism.pipeline"),
        ({"model.heads": 6, "model.kvHeads": 4}, "spec.model.kvHeads"),
        ({"model.hiddenSize": 130, "model.heads": 4}, "spec.model.hiddenSize"),
        (
            {"model.heads": 6, "model.kvHeads": 2, "parallelism.tensor": 4, "processesPerNode": 4},
            "spec.parallelism.tensor",
        ),
        ({"model.maxSeqLen": 64}, "spec.data.seqLen"),
        ({"parallelism.tensor": 2}, "spec.parallelism.tensor"),
        ({"processesPerNode": 3, "nodes": 1, "parallelism.tensor": 2}, "spec.nodes"),
        ({"optimizer.warmupSteps": 500}, "spec.optimizer.warmupSteps"),
        (
            {"faultTolerance.backoff.initialSeconds": 100},
            "spec.faultTolerance.backoff.initialSeconds",
        ),
    ],
)
def test_cel_rejects_with_the_field_and_pydantic_agrees(
    overrides: dict[str, Any], field: str
) -> None:
    spec = raw_spec(**overrides)
    failed = _violations(spec)
    assert any(v.startswith(field + ":") for v in failed), failed
    with pytest.raises(ValidationError):
        PretrainJobSpec.model_validate(spec)


def test_heartbeat_timeout_accepts_seconds_or_auto() -> None:
    node = _root()["properties"]["spec"]["properties"]["faultTolerance"]["properties"]["heartbeat"]
    timeout = node["properties"]["timeoutSeconds"]
    assert timeout["x-kubernetes-int-or-string"] is True and timeout["default"] == "auto"
    (rule,) = timeout["x-kubernetes-validations"]
    assert "'auto'" in rule["rule"]


def test_job_names_are_limited_so_hostnames_fit_a_dns_label() -> None:
    (rule,) = _root()["x-kubernetes-validations"]
    assert "metadata.name" in rule["rule"] and "52" in rule["rule"]
