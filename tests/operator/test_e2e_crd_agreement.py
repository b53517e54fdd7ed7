"""The CRD and the pydantic model agree on drawn specs (hypothesis, the real API server).

A file must never mean two things: what `hlat-train --config` accepts locally, the API server
admits, and what the operator reads back from the server (after the schema's defaults and
the server's own decoding) is the same job. For every drawn spec (test_properties' strategy:
a valid job with fields replaced by wrong, empty, huge, non-finite or missing values):
- the API server refuses it (dry run, strict field validation, as `kubectl apply` does)
  only if the model refuses it too;
- when the server admits it, the model reads the raw file and the stored object alike: both
  refused, or both admitted as equal specs.
The CRD cannot express every rule (memory per device, exactly one of steps and tokens), so
"server admits, model refuses" is allowed: the operator then marks the job InvalidSpec.
"""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from test_properties import specs

from hlat_api.manifest import InvalidSpecError, parse_spec
from hlat_api.spec import PretrainJobSpec
from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import GROUP, PLURAL, VERSION

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _model(raw: dict[str, Any]) -> PretrainJobSpec | InvalidSpecError:
    try:
        return parse_spec(copy.deepcopy(raw))
    except InvalidSpecError as err:
        return err


def _finite(value: Any) -> bool:
    """JSON has no NaN or infinity: the client cannot send them (the model refuses them)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def test_the_crd_and_the_model_agree_on_every_drawn_spec(
        cluster: Cluster, crd: None, namespace: str) -> None:
    custom = client.CustomObjectsApi(cluster.admin_api())
    seen: Counter[str] = Counter()

    @settings(max_examples=400, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(specs())
    def check(raw: dict[str, Any]) -> None:
        local = _model(raw)
        if not _finite(raw):
            assert isinstance(local, InvalidSpecError)
            event("non-finite: refused by the model, unsendable")
            seen["non-finite"] += 1
            return
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PretrainJob",
                "metadata": {"name": "drawn"}, "spec": copy.deepcopy(raw)}
        try:
            stored: Any = custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, body, dry_run="All",
                field_validation="Strict")
        except ApiException as err:
            assert err.status in (400, 422), err.body
            assert isinstance(local, InvalidSpecError), (
                f"the API server refuses what the model admits: "
                f"{json.loads(err.body or '{}').get('message')}")
            event("refused by both")
            seen["refused by both"] += 1
            return
        server = _model(stored["spec"])
        if isinstance(local, InvalidSpecError):
            assert isinstance(server, InvalidSpecError), (
                f"the model refuses the file ({local}) but admits the object the server "
                f"stored from it: {stored['spec']}")
            event("admitted by the server, refused by the model (InvalidSpec)")
            seen["admitted by the server, refused by the model"] += 1
            return
        assert isinstance(server, PretrainJobSpec), (
            f"the model admits the file but refuses the stored object: {server}")
        assert server == local, "the server's defaults or decoding changed the job"
        event("admitted by both, the same job")
        seen["admitted by both, the same job"] += 1

    check()
    print(dict(seen))
    # every outcome drawn, each many times: a server that refused nothing (or everything)
    # would not pass for agreement
    assert seen["refused by both"] >= 100 and seen["admitted by both, the same job"] >= 15, seen
    assert seen["admitted by the server, refused by the model"] >= 3, seen
