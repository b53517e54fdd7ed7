"""Render the spec's and the status's field documentation as Markdown (docs/api.md), from the models themselves.

`python -m hlat_api.reference > docs/api.md`; a test fails when the file is stale, so the
reference can never drift from the schema. Besides each field's type, default (a default
factory's value too, e.g. `neuron.compilerFlags`) and description, it lists the rules that span
several fields (`train`: exactly one of steps or tokens, ...): each validator's docstring, with
the fields its errors name read from its source, so a rule added without a docstring fails
the generator rather than going undocumented.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
from collections.abc import Callable
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from hlat_api.spec import _CHECKS, PretrainJobSpec
from hlat_api.status import PretrainJobStatus

HEADER = """# PretrainJob spec reference

Generated from `hlat_api.spec` by `python -m hlat_api.reference > docs/api.md`; do not edit.
Fields are camelCase in YAML. A manifest looks like `examples/pretrainjob-tiny.yaml`.

Validation is strict and the same on the cluster (the CRD's schema and CEL rules, then the
operator) and locally (`hlat-train --config`): camelCase names only, a quoted `"2"` is not a
number nor `"false"` a boolean, NaN and infinities are refused, strings are non-empty and
bounded, the backend must be one the instance type runs, processes per node at most its
NeuronCores or GPUs, and sections left out get their defaults before the cross-field rules
run (so the default `warmupSteps` of 2000 is refused for a 60-step run). Every error names
the field.

| field | type | default | description |
|---|---|---|---|
"""


def _type_name(annotation: Any) -> str:
    """`int`, `float or "auto"`, `"fp32" | "mixed" | ...`, `list of Toleration`; None dropped."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f'"{a}"' for a in args)
    if origin in (Union, UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin in (list, tuple, dict):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    if info.json_schema_extra is not None and not isinstance(info.json_schema_extra, dict):
        return "from the spec"  # a default the spec computes (no schema default)
    if info.default_factory is not None:
        made = info.default_factory()
        return "" if isinstance(made, BaseModel) else f"`{json.dumps(made)}`"
    return f"`{json.dumps(info.default)}`"


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        ann = info.annotation
        # a section (`BackoffSpec`), or an optional one (`TopologySpec | None`)
        nested = next((a for a in (ann, *get_args(ann))
                       if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is not None and nested is not ann and get_origin(ann) not in (Union, UnionType):
            nested = None  # `list[Toleration]`: a list, not a section
        desc = (info.description or "").replace("\n", " ")
        type_name = "object" if nested else _type_name(ann)
        out.append(f"| `{key}` | {type_name} | {_default(info)} | {desc} |")
        if nested is not None:
            out.extend(rows(nested, key + "."))
    return out


RULES_HEADER = """
## Rules across fields

Checked after every section has its defaults (each section's own rules first); an error
names the field it is about: those listed, read from the rule's source.

| fields | rule |
|---|---|
"""


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """The model and every model nested in it, depth first, each once."""
    out = [model]
    for info in model.model_fields.values():
        for ann in (info.annotation, *get_args(info.annotation)):  # `PodTemplate | None` too
            if isinstance(ann, type) and issubclass(ann, BaseModel) and ann not in out:
                out += [m for m in _models(ann) if m not in out]
    return out


def _error_fields(func: Callable[..., object]) -> list[str]:
    """The field paths a rule's errors name: the string literal each `raise SomeError(...)`
    (a SpecError) gives first, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    fields: list[str] = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args
                and isinstance(node.exc.args[0], ast.Constant)
                and isinstance(node.exc.args[0].value, str)
                and node.exc.args[0].value not in fields):
            fields.append(node.exc.args[0].value)
    return fields


def _rules(model: type[BaseModel]) -> list[Callable[..., object]]:
    """Each nested model's own after-validators, then the spec's cross-field checks."""
    funcs: list[Callable[..., object]] = []
    for m in _models(model)[1:]:
        for deco in m.__pydantic_decorators__.model_validators.values():
            if deco.info.mode == "after":
                funcs.append(deco.func)
    return [*funcs, *_CHECKS]


def rule_rows(model: type[BaseModel] = PretrainJobSpec) -> list[str]:
    out = []
    for func in _rules(model):
        doc = inspect.getdoc(func)
        if not doc:
            raise TypeError(f"{func.__qualname__} validates the spec but has no docstring "
                            "saying what it checks (docs/api.md lists them)")
        fields = ", ".join(f"`{f}`" for f in _error_fields(func)) or "(named in the rule)"
        out.append(f"| {fields} | {' '.join(doc.split())} |")
    return out


STATUS_HEADER = """
# PretrainJob status reference

Written by the operator only (`hlat_api.status`); `kubectl get pj -o yaml` shows it.

| field | type | default | description |
|---|---|---|---|
"""


def render() -> str:
    return (HEADER + "\n".join(rows(PretrainJobSpec)) + "\n" + RULES_HEADER
            + "\n".join(rule_rows()) + "\n" + STATUS_HEADER
            + "\n".join(rows(PretrainJobStatus)) + "\n")


if __name__ == "__main__":
    sys.stdout.write(render())
