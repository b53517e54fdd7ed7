"""Property tests (hypothesis): whatever a user writes, validation answers with fields, and
whatever validation admits, the operator runs without crashing, one gang at a time.

Specs are drawn from a small valid job with any of its fields replaced by values of the right
type, the wrong type, out of range, empty, huge or missing; faults are drawn from the kinds the
operator meets (a worker failing, a node going down, a hang, an operator pass lost).
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from opfakes import World, raw_spec

from hlat_api.manifest import InvalidSpecError, parse_spec

DROP = object()

FIELDS = [
    "nodes", "instanceType", "processesPerNode", "backend", "precision", "image",
    "model.preset", "model.hiddenSize", "model.heads", "model.kvHeads", "model.layers",
    "parallelism.tensor", "parallelism.zero1", "optimizer.lr", "optimizer.minLr",
    "optimizer.warmupSteps", "optimizer.betas", "data.path", "data.tokenizer", "data.seqLen",
    "train.globalBatch", "train.microBatch", "train.steps", "train.tokens",
    "checkpoint.interval", "checkpoint.keep", "checkpoint.async", "storage.mountPath",
    "storage.claimName", "faultTolerance.maxRestarts", "faultTolerance.backoff.initialSeconds",
    "faultTolerance.heartbeat.timeoutSeconds", "faultTolerance.noProgressRestarts",
    "activeDeadlineSeconds", "suspend",
]

VALUES = st.one_of(
    st.integers(min_value=-3, max_value=5000), st.integers(min_value=-10**12, max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from(["", "auto", "tiny", "7b", "cpu", "trn1.32xlarge", "p5.48xlarge", "bytes",
                     "/fsx/data", "fsx", "neuron-xla", "cuda", "fp32", "bf16-sr", "2", "false",
                     "x" * 5000]),
    st.lists(st.floats(min_value=-1, max_value=2), max_size=3),
    st.just(DROP),
)


def _put(spec: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = spec
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    if value is DROP:
        node.pop(leaf, None)
    else:
        node[leaf] = value


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    spec = raw_spec(**{"optimizer.warmupSteps": 5})
    for path in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        _put(spec, path, draw(VALUES))
    return spec


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_validation_names_a_field_or_admits(raw: dict[str, Any]) -> None:
    try:
        spec = parse_spec(copy.deepcopy(raw))
    except InvalidSpecError as err:
        assert err.problems
        assert all(path.startswith("spec") and reason for path, reason in err.problems)
        return
    # admitted: what the operator and the trainer compute from it is defined
    assert spec.world_size >= 1 and spec.total_steps >= 1 and spec.grad_accum_steps >= 1
    assert spec.optimizer.warmup_steps <= spec.total_steps


FAULTS = st.lists(st.tuples(st.integers(min_value=0, max_value=60),
                            st.sampled_from(["fail", "node", "hang", "skip", "finish"])),
                  max_size=4)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(), FAULTS)
def test_the_operator_runs_anything_admitted_one_gang_at_a_time(
        raw: dict[str, Any], faults: list[tuple[int, str]]) -> None:
    try:
        parse_spec(copy.deepcopy(raw))
    except InvalidSpecError:
        w = World(raw)
        w.run(5)
        assert w.status.phase == "Failed" and not w.pods  # refused, nothing started
        event("refused")
        return
    event("admitted")
    w = World(raw)
    script = dict(faults)
    hung = False
    for t in range(90):
        what = script.get(t)
        live = [p for p in w.pods.values() if p.phase == "Running" and not p.terminating]
        if what == "fail" and live:
            w.fail(live[0].rank or 0)
        elif what == "node" and live and live[0].node:
            w.node_down(live[0].node)
        elif what == "hang":
            hung = True
        elif what == "finish":
            w.succeed_all()
        w.schedule()
        if not hung:
            w.beat(t)
        if what != "skip":
            w.step()
        w.advance(1)
        # never two gangs: no pod of a new attempt while one of an old one is not gone
        attempts = {p.attempt for p in w.pods.values() if not p.finished}
        assert len(attempts) <= 1, f"two gangs: {attempts}"
    assert w.status.phase in ("Pending", "Running", "Restarting", "Suspended", "Succeeded",
                              "Failed")
    g = w.status.goodput
    parts = g.productive_seconds + sum(g.badput_seconds.model_dump().values())
    assert abs(parts - g.wall_seconds) < 0.05 or g.current is not None
