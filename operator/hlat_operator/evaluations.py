"""Evaluation jobs on durable checkpoints (spec.evaluation): which checkpoint gets one, and what
a finished one said. Pure: no I/O, no clock.

Each chosen checkpoint gets a Kubernetes Job (`builders.build_evaluation_job`). Its evaluator
writes one JSON object of numbers to its terminationMessagePath (`RESULT_PATH`); the kubelet
puts the file's first 4 KiB in the container's terminated state, where the operator reads it.
A Job that fails (its retries spent, or its deadline passed) is reported and never touches
the training.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hlat_api import PretrainJobSpec, labels
from hlat_api.spec import evaluation_due
from hlat_api.status import Evaluation

RESULT_PATH = "/hlat-eval/result.json"
"""The evaluator's HLAT_EVAL_RESULT and its container's terminationMessagePath."""
MAX_RESULT_BYTES = 4096
"""What the kubelet reads of a termination message file."""

JobState = Literal["Active", "Succeeded", "Failed"]


@dataclass(frozen=True)
class ObservedEvaluation:
    """An evaluation Job as the pass saw it."""

    step: int
    name: str
    state: JobState
    message: str | None = None
    """Succeeded: its evaluator's termination message (the result). Failed: why (the last
    pod's termination message, else the Job's Failed condition)."""


EVALUATOR = "evaluator"
"""The evaluator's container in an evaluation Job's pod (builders.build_evaluation_job)."""


def _condition(raw: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for cond in (raw.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return dict(cond)
    return None


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == EVALUATOR:
            return dict((status.get("state") or {}).get("terminated") or {})
    return {}


def watched(body: Mapping[str, Any]) -> bool:
    """Whether a pass reads the evaluation Jobs of this raw PretrainJob: it asks for them, or
    its status has one running (spec.evaluation removed meanwhile)."""
    if (body.get("spec") or {}).get("evaluation") is not None:
        return True
    return any(e.get("phase") == "Running"
               for e in (body.get("status") or {}).get("evaluations") or [])


def observe_jobs(jobs: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
                 ) -> dict[int, ObservedEvaluation]:
    """The evaluation Jobs of a PretrainJob by checkpoint step, from raw batch/v1 Jobs and
    their pods (both labelled `hlat.dev/step`). A Job is done once the Job controller set its
    Complete or Failed condition: the result is the Succeeded pod's termination message; the
    failure, the Failed condition with the newest failed pod's message (with
    FallbackToLogsOnError, its log's tail)."""
    by_step: dict[int, list[Mapping[str, Any]]] = {}
    for pod in pods:
        step = ((pod.get("metadata") or {}).get("labels") or {}).get(labels.STEP)
        if step is not None and step.isdigit():
            by_step.setdefault(int(step), []).append(pod)
    out: dict[int, ObservedEvaluation] = {}
    for job in jobs:
        meta = job.get("metadata") or {}
        step = (meta.get("labels") or {}).get(labels.STEP)
        if step is None or not step.isdigit() or meta.get("deletionTimestamp"):
            continue
        mine = sorted(by_step.get(int(step), []),
                      key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp")))
        if _condition(job, "Complete") is not None:
            done = [p for p in mine if (p.get("status") or {}).get("phase") == "Succeeded"]
            message = _terminated(done[-1]).get("message") if done else None
            out[int(step)] = ObservedEvaluation(int(step), meta.get("name", ""), "Succeeded",
                                                message)
        elif (failed := _condition(job, "Failed")) is not None:
            why = ": ".join(str(v) for v in (failed.get("reason"), failed.get("message")) if v)
            last = [p for p in mine if (p.get("status") or {}).get("phase") == "Failed"]
            term = _terminated(last[-1]) if last else {}
            tail = term.get("message") or term.get("reason")
            if tail:
                code = term.get("exitCode")
                why += f"; its last try exited {code}: {str(tail).strip()[-600:]}"
            out[int(step)] = ObservedEvaluation(int(step), meta.get("name", ""), "Failed",
                                                why or "the Job failed")
        else:
            out[int(step)] = ObservedEvaluation(int(step), meta.get("name", ""), "Active")
    return out


def parse_results(message: str | None) -> dict[str, float]:
    """The evaluator's numbers by name; ValueError saying what is wrong with it."""
    if not message:
        raise ValueError(f"the evaluator wrote nothing to {RESULT_PATH} (HLAT_EVAL_RESULT)")
    try:
        doc = json.loads(message)
    except ValueError as err:
        raise ValueError(f"its result is not JSON ({err}); the kubelet keeps the first "
                         f"{MAX_RESULT_BYTES} bytes of it") from err
    if not isinstance(doc, dict):
        raise ValueError("its result is not a JSON object of numbers by name")
    out = {str(k): float(v) for k, v in doc.items()
           if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
    if not out:
        raise ValueError("its result holds no finite number")
    return out


@dataclass(frozen=True)
class Plan:
    """What a pass does about evaluations: the status entries after it, the steps to start an
    evaluation of, the entries that finished in it."""

    entries: list[Evaluation]
    start: tuple[int, ...] = ()
    finished: tuple[Evaluation, ...] = ()


def plan(spec: PretrainJobSpec, job: str, entries: Iterable[Evaluation],
         seen: Mapping[int, ObservedEvaluation] | None, latest: int | None,
         from_start: bool = False) -> Plan:
    """Bring `entries` (status.evaluations) up to date with the Jobs `seen` (None: not read),
    and start one on each due checkpoint after the newest evaluated, up to the `latest`
    complete one (`job`: the PretrainJob's name). Checkpoints come faster than passes see them
    (a small model saves several a second); the trainer holds every due one until its Job
    takes over (hlat_api.layout.hold_ahead), so none is skipped. The first evaluations of a
    job are of every due checkpoint when it had spec.evaluation `from_start` (its trainers held
    them all), else of the newest due checkpoint alone (a spec that gained spec.evaluation: the
    older ones were not held)."""
    out = list(entries)
    finished: list[Evaluation] = []
    if seen is not None:
        settled = max((e.step for e in out), default=-1)
        for step in sorted(s for s in seen if s > settled):  # created, then status lost
            out.append(Evaluation(step=step, tokens=step * spec.tokens_per_step,
                                  job=seen[step].name))
        out, finished = settle(out, seen)
    ev = spec.evaluation
    start: list[int] = []
    if ev is not None and seen is not None and latest is not None:
        newest = max((e.step for e in out), default=0)
        period = ev.every * spec.checkpoint.interval
        first = ((newest // period + 1) * period if out or from_start
                 else max(period, latest // period * period))
        start = list(range(first, latest + 1, period))
        if evaluation_due(spec, latest) and latest not in start and latest > newest:
            start.append(latest)  # the last checkpoint, whatever its step
        start = start[-ev.keep:]
    for step in start:
        out.append(Evaluation(step=step, tokens=step * spec.tokens_per_step,
                              job=labels.evaluation_job_name(job, step)))
    keep = ev.keep if ev is not None else len(out)
    return Plan(out[-keep:] if keep else [], tuple(start), tuple(finished))


def settle(entries: Iterable[Evaluation], seen: Mapping[int, ObservedEvaluation]
           ) -> tuple[list[Evaluation], list[Evaluation]]:
    """`entries` brought up to date with the Jobs seen: (all of them; those that finished
    now). A Running entry whose Job is not there failed: its creation was refused (a Warning
    event says why) or someone deleted it."""
    out: list[Evaluation] = []
    finished: list[Evaluation] = []
    for entry in entries:
        job = seen.get(entry.step)
        if entry.phase != "Running" or (job is not None and job.state == "Active"):
            out.append(entry)
            continue
        if job is None:
            done = entry.model_copy(update={
                "phase": "Failed",
                "message": f"its Job {entry.job} is not there: its creation failed (the "
                           "EvaluationFailed event before this one says why) or it was "
                           "deleted"})
        elif job.state == "Succeeded":
            try:
                done = entry.model_copy(update={"phase": "Succeeded",
                                                "results": parse_results(job.message)})
            except ValueError as err:
                done = entry.model_copy(update={"phase": "Failed", "message": str(err)})
        else:
            done = entry.model_copy(update={"phase": "Failed",
                                            "message": job.message or "the Job failed"})
        out.append(done)
        finished.append(done)
    return out, finished
