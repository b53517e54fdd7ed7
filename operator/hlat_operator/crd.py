"""The PretrainJob CustomResourceDefinition, generated from the hlat_api models.

`python -m hlat_operator.crd > crds/pretrainjob.yaml` writes it (`--write` writes it and the Helm
chart's copy, charts/hlat/files/pretrainjob-crd.yaml); a test fails when either is stale, so the API server's schema can never drift from the pydantic model the operator and the
trainer validate with.

Pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3.0 schema.
The conversion: inline every `$ref`; `anyOf [X, null]` becomes X with `nullable: true`;
numeric `exclusiveMinimum: v` becomes `minimum: v, exclusiveMinimum: true`; a fixed-length
tuple becomes an array with `items` and min/maxItems; `const` becomes a one-value enum;
`additionalProperties: false` is dropped (the API server prunes unknown fields instead, and
structural schemas forbid it next to `properties`); "a number or 'auto'" is
`x-kubernetes-int-or-string` plus a CEL rule. Descriptions and defaults come along, so
`kubectl explain pj.spec.faultTolerance` prints the model's docstrings.

The CEL rules check the cross-field rules the API server can see without the preset tables
(the rest stays in the pydantic validator, reported as InvalidSpec by the operator). Each
rule is a few comparisons of scalar fields, so its cost is constant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from hlat_api import labels
from hlat_api.manifest import API_GROUP, API_VERSION, KIND
from hlat_api.presets import HYPERPOD_INSTANCE_TYPES, INSTANCE_TYPES, canonical_instance_type
from hlat_api.spec import (
    BACKENDS_BY_ACCELERATOR,
    MAX_PROCESSES_PER_NODE,
    PretrainJobSpec,
    accelerator,
)
from hlat_api.status import PretrainJobStatus

PLURAL = "pretrainjobs"
SINGULAR = "pretrainjob"
SHORT_NAMES = ["pj"]
CRD_NAME = f"{PLURAL}.{API_GROUP}"

Schema = dict[str, Any]

_DROP = {"title", "additionalProperties", "$defs", "discriminator"}


def _resolve(node: Schema, defs: dict[str, Schema]) -> Schema:
    ref = node.get("$ref")
    if ref is None:
        return node
    target = defs[ref.rsplit("/", 1)[-1]]
    merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return _resolve(merged, defs)


def _int_or_auto(node: Schema, defs: dict[str, Schema], with_defaults: bool) -> Schema | None:
    """`number > 0 | "auto"` (or `| "auto" | "off"`, and `| None`, nullable): the only unions
    of the spec that are not `X | None`."""
    options = [o for o in node["anyOf"] if o.get("type") != "null"]
    words = [w for o in options for w in ([o["const"]] if "const" in o else o.get("enum", []))]
    if not words or len(options) != 2:
        return None
    out: Schema = {"x-kubernetes-int-or-string": True}
    if len(options) != len(node["anyOf"]):
        out["nullable"] = True
    allowed = " || ".join(f"self == '{w}'" for w in words)
    out["x-kubernetes-validations"] = [
        {
            "rule": f"type(self) == string ? {allowed} : self > 0",
            "message": "must be a positive whole number or " + " or ".join(
                f"'{w}'" for w in words),
        }
    ]
    _copy_doc(node, out, with_defaults)
    return out


def _copy_doc(src: Schema, dst: Schema, with_defaults: bool) -> None:
    if "description" in src:
        dst["description"] = src["description"]
    if with_defaults and src.get("default") is not None:
        dst["default"] = src["default"]


def structural(node: Schema, defs: dict[str, Schema], with_defaults: bool = True) -> Schema:
    """Convert one pydantic JSON-Schema node (and its children) to a structural schema."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        special = _int_or_auto(node, defs, with_defaults)
        if special is not None:
            return special
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']} structurally")
        inner = structural(options[0], defs, with_defaults)
        inner["nullable"] = True
        _copy_doc(node, inner, with_defaults)
        return inner
    out: Schema = {}
    for key, value in node.items():
        if key in _DROP or key in ("prefixItems", "anyOf"):
            continue
        if key == "default" and (not with_defaults or value is None):
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound], out[key] = value, True
        elif key == "properties":
            out[key] = {k: structural(v, defs, with_defaults) for k, v in value.items()}
        elif key == "items":
            out[key] = structural(value, defs, with_defaults)
        else:
            out[key] = value
    if "prefixItems" in node:  # a fixed-length tuple of one item type
        items = [structural(i, defs, with_defaults) for i in node["prefixItems"]]
        if any(i != items[0] for i in items):
            raise ValueError("tuples of mixed item schemas are not structural")
        out["items"] = items[0]
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):  # a map, e.g. nodeSelector
        out["additionalProperties"] = structural(extra, defs, with_defaults)
    if (
        node.get("type") == "object"
        and "properties" not in out
        and "additionalProperties" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


_ALL_NAMES = [*INSTANCE_TYPES, *HYPERPOD_INSTANCE_TYPES]
"""Every name `instanceType` takes (HyperPod's `ml.` names too: a CEL map lookup of a missing
key fails the whole object)."""


def _max_processes(instance: str) -> int:
    info = INSTANCE_TYPES[instance]
    return info.ranks_per_node if accelerator(instance) != "cpu" else MAX_PROCESSES_PER_NODE


def _cel_map(values: dict[str, int]) -> str:
    return "{" + ", ".join(f"'{k}': {v}" for k, v in values.items()) + "}"


def _cel_map_of_lists(values: dict[str, list[str]]) -> str:
    return "{" + ", ".join(f"'{k}': [{', '.join(repr(x) for x in v)}]"
                           for k, v in values.items()) + "}"


def _rule(
    rule: str, message: str, field_path: str | None = None, reason: str | None = None
) -> Schema:
    out: Schema = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


# Rules per schema node (path of property names from spec). Defaults are applied before
# validation, but `has()` guards keep a rule meaningful when a field was explicitly nulled, and
# parallelism.tensor has no schema default (its default depends on the model and instance
# type, filled in by the pydantic model), so every rule on it is guarded.
SPEC_RULES: dict[tuple[str, ...], list[Schema]] = {
    (): [
        _rule(
            "!has(self.model) || !has(self.model.heads) || !has(self.parallelism) || !has(self.parallelism.tensor) || "
            "self.model.heads % self.parallelism.tensor == 0",
            "parallelism.tensor must divide model.heads (each tensor-parallel rank owns whole heads)",
            ".parallelism.tensor",
        ),
        _rule(
            "!has(self.model) || !has(self.model.kvHeads) || !has(self.parallelism) || !has(self.parallelism.tensor) || "
            "self.model.kvHeads % self.parallelism.tensor == 0 || "
            "self.parallelism.tensor % self.model.kvHeads == 0",
            "parallelism.tensor must divide model.kvHeads (each tensor-parallel rank owns whole "
            "key/value heads) or be a multiple of it (each kv head replicated on tensor / "
            "kvHeads ranks)",
            ".parallelism.tensor",
        ),
        _rule(
            "!has(self.model) || !has(self.model.maxSeqLen) || !has(self.data) || "
            "self.data.seqLen <= self.model.maxSeqLen",
            "data.seqLen must not exceed model.maxSeqLen",
            ".data.seqLen",
        ),
        _rule(
            "!has(self.processesPerNode) || !has(self.parallelism) || !has(self.parallelism.tensor) || "
            "self.parallelism.tensor <= self.processesPerNode",
            "parallelism.tensor must not exceed processesPerNode: tensor parallelism stays "
            "within a node",
            ".parallelism.tensor",
        ),
        _rule(
            "!has(self.processesPerNode) || !has(self.parallelism) || !has(self.parallelism.tensor) || "
            "(self.nodes * self.processesPerNode) % self.parallelism.tensor == 0",
            "nodes x processesPerNode must be divisible by parallelism.tensor",
            ".nodes",
        ),
        _rule(
            "!has(self.train) || !has(self.train.steps) || !has(self.optimizer) || "
            "self.optimizer.warmupSteps <= self.train.steps",
            "optimizer.warmupSteps must not exceed train.steps",
            ".optimizer.warmupSteps",
        ),
        _rule(
            "!has(self.backend) || self.backend == 'auto' || self.backend in "
            + _cel_map_of_lists({t: list(BACKENDS_BY_ACCELERATOR[accelerator(
                canonical_instance_type(t))]) for t in _ALL_NAMES}) + "[self.instanceType]",
            "backend cannot run on instanceType: neuron-xla or neuron-native on trn*, cuda on "
            "p5.48xlarge, cpu on cpu (or auto)",
            ".backend",
        ),
        _rule(
            "!has(self.processesPerNode) || self.processesPerNode <= "
            + _cel_map({t: _max_processes(canonical_instance_type(t)) for t in _ALL_NAMES})
            + "[self.instanceType]",
            "processesPerNode must not exceed the instance type's devices (NeuronCores or "
            "GPUs: trn1.2xlarge 2, trn1(n).32xlarge 32, trn2(u).48xlarge 64, p5.48xlarge 8)",
            ".processesPerNode",
        ),
    ],
    ("model",): [
        _rule(
            "!has(self.heads) || !has(self.kvHeads) || self.heads % self.kvHeads == 0",
            "model.heads must be a multiple of model.kvHeads",
            ".kvHeads",
        ),
        _rule(
            "!has(self.hiddenSize) || !has(self.heads) || self.hiddenSize % self.heads == 0",
            "model.hiddenSize must be divisible by model.heads",
            ".hiddenSize",
        ),
    ],
    ("parallelism",): [
        _rule(
            "self.pipeline == 1",
            "pipeline parallelism is not supported yet: set parallelism.pipeline to 1",
            ".pipeline",
        ),
    ],
    ("optimizer",): [
        _rule("self.minLr <= self.lr", "optimizer.minLr must not exceed optimizer.lr", ".minLr"),
    ],
    ("train",): [
        _rule(
            "has(self.steps) != has(self.tokens)",
            "give exactly one of train.steps or train.tokens",
            ".steps",
        ),
    ],
    ("faultTolerance", "backoff"): [
        _rule(
            "self.initialSeconds <= self.maxSeconds",
            "faultTolerance.backoff.initialSeconds must not exceed maxSeconds",
            ".initialSeconds",
        ),
    ],
}

ROOT_RULES = [
    _rule(
        f"size(self.metadata.name) <= {labels.MAX_JOB_NAME}",
        f"a PretrainJob name must be at most {labels.MAX_JOB_NAME} characters "
        "(worker hostnames <name>-<rank> must fit a DNS label)",
        # no fieldPath: the API server accepts only paths into the declared schema, and
        # metadata.name is not declared in it (the message names the field)
    ),
]


def _add_rules(schema: Schema, rules: dict[tuple[str, ...], list[Schema]]) -> None:
    for path, node_rules in rules.items():
        node = schema
        for part in path:
            node = node["properties"][part]
        node.setdefault("x-kubernetes-validations", []).extend(node_rules)


REQUIRED_SECTIONS = ("train",)
"""Sections with no valid default (the run's length is the user's to give)."""


def _filled(node: Schema) -> dict[str, Any]:
    """What the API server makes of `{}` at this object: its properties' defaults, nested
    sections filled the same way."""
    out: dict[str, Any] = {}
    for key, child in node.get("properties", {}).items():
        if "default" in child:
            out[key] = child["default"]
    return out


def _default_sections(schema: Schema, model: type[BaseModel]) -> None:
    """A default on every section whose model has defaults for all its fields: the API server
    applies nested defaults only where the parent exists, so without it an omitted section
    would skip its own defaults and every CEL rule guarded by it (the default warmupSteps of
    2000 would pass for a 60-step job). The default is the filled object, not `{}`: the API
    server checks a default against the rules as it stands."""
    for name, info in model.model_fields.items():
        nested = info.annotation
        if info.default_factory is None or not (
                isinstance(nested, type) and issubclass(nested, BaseModel)):
            continue
        key = info.alias or name
        node = schema["properties"][key]
        _default_sections(node, nested)
        if key in REQUIRED_SECTIONS:
            schema.setdefault("required", []).append(key)
        else:
            node["default"] = _filled(node)


def spec_schema() -> Schema:
    raw = PretrainJobSpec.model_json_schema(by_alias=True)
    schema = structural(raw, raw.get("$defs", {}))
    _default_sections(schema, PretrainJobSpec)
    _add_rules(schema, SPEC_RULES)
    return schema


def status_schema() -> Schema:
    """Status without defaults: the operator always writes it whole, and a defaulted status
    would claim progress that never happened."""
    raw = PretrainJobStatus.model_json_schema(by_alias=True)
    schema = structural(raw, raw.get("$defs", {}), with_defaults=False)
    schema["description"] = (
        "Written by the operator only: phase, conditions, restarts, progress, uptime, goodput."
    )
    return schema


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Why", "type": "string", "jsonPath": ".status.reason",
     "description": "Why the job is in its phase (its condition's reason: Queued, "
     "EvictedByKueue, TopologyUnavailable, ...)."},
    {"name": "Nodes", "type": "string", "jsonPath": ".status.size.text",
     "description": "Nodes trained on / spec.nodes (fewer while an elastic job is short)"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary",
     "description": "Step / total steps (percent)."},
    {"name": "Loss", "type": "string", "jsonPath": ".status.progress.lossText",
     "description": "Loss of the latest step, 4 significant digits."},
    {"name": "Val Loss", "type": "string", "jsonPath": ".status.progress.validationLossText",
     "description": "Latest held-out validation loss (spec.eval), 4 significant digits."},
    {
        "name": "Goodput",
        "type": "number",
        "jsonPath": ".status.goodput.ratio",
        "description": "Productive training seconds over wall seconds since the first gang "
        "(suspended time excluded).",
    },
    {
        "name": "Uptime",
        "type": "number",
        "jsonPath": ".status.uptime.ratio",
        "description": "Running seconds over running + down seconds since the first start "
        "(the HLAT paper's measure).",
    },
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts.total"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt", "priority": 1},
    {"name": "Reason", "type": "string", "jsonPath": ".status.lastFailure.reason", "priority": 1},
    {"name": "ETA", "type": "number", "jsonPath": ".status.progress.etaSeconds", "priority": 1,
     "description": "Seconds to the last step at the recent step time."},
]


def build_crd() -> dict[str, Any]:
    root: Schema = {
        "type": "object",
        "description": (PretrainJobSpec.__doc__ or "").strip()
        + " An LLM pretraining job on a gang of nodes, restarted from its latest complete "
        "checkpoint after faults.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": ROOT_RULES,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {labels.NAME: labels.APP_NAME},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["all", "hlat"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = (
    "# Generated by `python -m hlat_operator.crd > crds/pretrainjob.yaml` from the hlat_api\n"
    "# models: do not edit (tests/operator/test_crd.py fails when this file is stale).\n"
)


CHART_COPY = (
    Path(__file__).resolve().parents[2] / "charts" / "hlat" / "files" / "pretrainjob-crd.yaml"
)
REPO_COPY = Path(__file__).resolve().parents[2] / "crds" / "pretrainjob.yaml"


def render(helm: bool = False) -> str:
    """The CRD as YAML; the chart's copy is kept on `helm uninstall` (deleting a CRD deletes
    every PretrainJob with it)."""
    crd = build_crd()
    if helm:
        crd["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
    header = HEADER.replace("> crds/pretrainjob.yaml", "--write") if helm else HEADER
    return header + yaml.safe_dump(crd, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print (or --write) the PretrainJob CRD.")
    parser.add_argument(
        "--write", action="store_true", help=f"write {REPO_COPY.name} and the chart's copy"
    )
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(render())
        return
    for path, text in ((REPO_COPY, render()), (CHART_COPY, render(helm=True))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
