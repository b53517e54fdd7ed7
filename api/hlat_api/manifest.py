"""Reading a PretrainJob from YAML/JSON, applying `--set` overrides, and explaining errors.

`hlat-train --config FILE` takes either a whole PretrainJob manifest (its `spec` is used, its
`metadata.name` names the job) or a bare spec. Overrides use the YAML's camelCase paths
(`train.steps=40`); a path that is not a field of the schema is an error that lists the keys
that exist there, so a typo never goes unnoticed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from hlat_api.errors import SpecError
from hlat_api.spec import PretrainJobSpec

_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Loader(yaml.SafeLoader):
    """YAML as kubectl reads it (sigs.k8s.io/yaml, YAML 1.1 like PyYAML) in the one place
    they differ for a spec: a float written without a dot, `3e-4`, is a number there and a
    string in PyYAML (which, read strictly, would be refused)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


API_GROUP = "hlat.dev"
API_VERSION = "v1alpha1"
KIND = "PretrainJob"


class InvalidSpecError(ValueError):
    """One or more problems, each `(camelCase field path, reason)`."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "spec") -> None:
        self.problems = problems
        lines = "\n".join(f"  {field}: {reason}" for field, reason in problems)
        super().__init__(f"invalid {source}:\n{lines}")


@dataclass(frozen=True)
class Job:
    name: str
    spec: PretrainJobSpec


def explain(err: ValidationError) -> list[tuple[str, str]]:
    """Turn pydantic's errors into (field path, reason) pairs a user can act on."""
    problems: dict[str, list[str]] = {}
    for e in err.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, SpecError):
            problems.setdefault(f"spec.{cause.field}", []).append(cause.reason)
            continue
        # union members appear in `loc` as tags like "literal['auto']": not field names
        loc = [str(p) for p in e["loc"] if isinstance(p, int) or _FIELD.match(str(p))]
        reason = e["msg"]
        if e["type"] not in ("missing", "extra_forbidden"):
            got = repr(e["input"])
            reason += f" (got {got if len(got) <= 80 else got[:60] + '...'})"
        if e["type"] == "extra_forbidden":
            reason = "unknown field: check its spelling (fields are camelCase)"
        problems.setdefault(".".join(["spec", *loc]), []).append(reason)
    return [(path, " or ".join(reasons)) for path, reasons in problems.items()]


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, directly or as the element of a list (`tolerations`)."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        if get_origin(candidate) is list:
            return _nested_model(get_args(candidate)[0])
    return None


def _types(annotation: Any) -> set[Any]:
    """The plain types a field's annotation is made of (unions and Annotated unwrapped)."""
    args = get_args(annotation)
    if not args or get_origin(annotation) in (list, dict):
        return {get_origin(annotation) or annotation}
    return set().union(*(_types(a) for a in args if not hasattr(a, "metadata")))


_SAFE_INTEGER = 2**53 - 1
"""The largest float the API server's OpenAPI validation takes as an integer (go-openapi's
IsFloat64AJSONInteger)."""


def as_server_decodes(raw: Any, model: type[BaseModel] = PretrainJobSpec) -> Any:
    """`raw` as the API server stores it, where it differs from strict validation: a null for
    a field that is not nullable in the CRD (its type does not admit None) is pruned before
    defaulting, so `nodes:` with no value means the default; and a whole number written as a
    float (`nodes: 2.0`) is an integer, up to 2^53 - 1. Without this a file would mean one thing to
    `hlat-train --config` and another on the cluster."""
    if isinstance(raw, list):
        return [as_server_decodes(item, model) for item in raw]
    if not isinstance(raw, Mapping):
        return raw
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        info = fields.get(key)
        if info is None:  # unknown: left for validation to name
            out[key] = value
            continue
        types = _types(info.annotation)
        if value is None and type(None) not in types:
            continue
        if isinstance(value, float) and value.is_integer() and abs(value) <= _SAFE_INTEGER and (
                int in types and float not in types):
            value = int(value)
        nested = _nested_model(info.annotation)
        out[key] = as_server_decodes(value, nested) if nested is not None else value
    return out


def parse_spec(raw: Mapping[str, Any], source: str = "spec") -> PretrainJobSpec:
    """A manifest's spec as the API server reads it: camelCase names only (a snake_case key is
    an unknown field, not a second spelling), strict types; nulls and whole floats read as the
    server reads them (`as_server_decodes`)."""
    try:
        return PretrainJobSpec.model_validate(as_server_decodes(raw), by_alias=True, by_name=False)
    except ValidationError as err:
        raise InvalidSpecError(explain(err), source) from err


def _field_aliases(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """camelCase key -> nested model class (None for a leaf); an optional section (`eval:
    EvalSpec | None`) is its model's."""
    out: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        ann = info.annotation
        options = get_args(ann) if get_origin(ann) in (Union, UnionType) else (ann,)
        models = [a for a in options if isinstance(a, type) and issubclass(a, BaseModel)]
        out[info.alias or name] = models[0] if len(models) == 1 else None
    return out


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a raw spec dict, in place."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise InvalidSpecError([(f"--set {item}", "expected key.path=value")], "--set")
        parts = key.split(".")
        model: type[BaseModel] | None = PretrainJobSpec
        node = raw
        for i, part in enumerate(parts):
            if model is None:
                raise InvalidSpecError([(key, f"{'.'.join(parts[:i])} has no sub-keys")], "--set")
            fields = _field_aliases(model)
            if part not in fields:
                known = ", ".join(sorted(fields))
                where = ".".join(parts[:i]) or "spec"
                raise InvalidSpecError([(key, f"unknown key {part!r}; {where} has: {known}")], "--set")
            if i == len(parts) - 1:
                node[part] = load_yaml(text) if text else None
            else:
                child = node.get(part)
                node = node.setdefault(part, {}) if not isinstance(child, dict) else child
                model = fields[part]
    return raw


def load_job(path: str | Path, overrides: Iterable[str] = (), name: str | None = None) -> Job:
    """Read a PretrainJob manifest or a bare spec from YAML/JSON and validate it."""
    path = Path(path)
    try:
        doc = load_yaml(path.read_text())
    except FileNotFoundError:
        raise InvalidSpecError([(str(path), "file not found")], "config") from None
    except yaml.YAMLError as err:
        raise InvalidSpecError([(str(path), f"not valid YAML: {err}")], "config") from err
    if not isinstance(doc, dict):
        raise InvalidSpecError([(str(path), "expected a mapping (a PretrainJob or its spec)")])
    if "spec" in doc or doc.get("kind") == KIND:
        if doc.get("kind", KIND) != KIND:
            raise InvalidSpecError([("kind", f"expected {KIND}, got {doc.get('kind')!r}")])
        raw = dict(doc.get("spec") or {})
        name = name or (doc.get("metadata") or {}).get("name")
    else:
        raw = dict(doc)
    raw = apply_overrides(raw, overrides)
    return Job(name=name or path.stem, spec=parse_spec(raw, str(path)))
