"""The heartbeat protocol: each node's local rank 0 renews a coordination.k8s.io Lease.

Who writes: the trainer (one Lease per worker pod, named by `lease_name`). Who reads: the
operator, for liveness (renewTime) and progress (the annotations). Values are strings, as
annotations must be; `Heartbeat.to_annotations` / `from_annotations` are the only encoding.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ValidationError

PREFIX = "hlat.dev/"
DEFAULT_PERIOD_SECONDS = 10.0

Phase = Literal["starting", "compiling", "training", "checkpointing", "finished"]


def lease_name(pod_name: str) -> str:
    """The Lease of a worker pod shares the pod's name (a different kind, so no clash)."""
    return pod_name


class Heartbeat(BaseModel):
    """What a worker reports with each renewal."""

    phase: Phase = "starting"
    step: int = 0
    tokens: float = 0
    loss: float | None = None
    tokens_per_second: float | None = None
    step_seconds: float | None = None
    """Mean seconds per optimizer step recently; the operator's hang timeout learns from it."""
    checkpoint_step: int | None = None
    """Newest complete checkpoint's step."""
    attempt: int | None = None

    def to_annotations(self) -> dict[str, str]:
        return {PREFIX + k: str(v) for k, v in self.model_dump().items() if v is not None}

    @classmethod
    def from_annotations(cls, annotations: dict[str, str] | None) -> Heartbeat | None:
        """Decode; None when absent or malformed (an unknown writer is not trusted)."""
        if not annotations:
            return None
        raw = {k[len(PREFIX) :]: v for k, v in annotations.items() if k.startswith(PREFIX)}
        if not raw:
            return None
        try:
            return cls.model_validate(raw)
        except ValidationError:
            return None
