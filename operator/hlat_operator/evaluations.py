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
from typing import Literal

from hlat_api import PretrainJobSpec
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


def due(spec: PretrainJobSpec, step: int) -> bool:
    """Whether the durable checkpoint of `step` gets an evaluation."""
    ev = spec.evaluation
    if ev is None or step <= 0:
        return False
    return step % (ev.every * spec.checkpoint.interval) == 0 or step >= spec.total_steps


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


def settle(entries: Iterable[Evaluation], seen: Mapping[int, ObservedEvaluation],
           keep: int) -> tuple[list[Evaluation], list[Evaluation]]:
    """`entries` brought up to date with the Jobs seen: (all of them, the newest `keep`; those
    that finished in this pass). A Running entry whose Job is gone stays Running until its
    Job is seen again or is replaced: a Job deleted by hand is reported by the caller."""
    out: list[Evaluation] = []
    finished: list[Evaluation] = []
    for entry in entries:
        job = seen.get(entry.step)
        if entry.phase != "Running" or job is None or job.state == "Active":
            out.append(entry)
            continue
        if job.state == "Succeeded":
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
    return out[-keep:], finished
