"""The restart record of an in-place restart (`faultTolerance.restartStrategy: InPlace`).

Who writes: the operator, on the job's gang Lease (`labels.gang_lease_name`), when it moves the
kept pods to a new attempt. Who reads: every worker's launcher (`hlat-launch`), which polls it
(get only: the job's Role allows nothing else on it), stops its trainer when the attempt moves
on, and starts the next one with the record's values. `GangRecord.to_annotations` /
`from_annotations` are the only encoding.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ATTEMPT_KEY = "hlat.dev/attempt"
STEPS_DONE_KEY = "hlat.dev/steps-done"


class GangRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    attempt: int = Field(ge=0)
    """The attempt every trainer of the job must run now."""
    steps_done: int = Field(default=0, ge=0)
    """The highest step an earlier attempt's node rank 0 reported (HLAT_STEPS_DONE)."""

    def to_annotations(self) -> dict[str, str]:
        return {ATTEMPT_KEY: str(self.attempt), STEPS_DONE_KEY: str(self.steps_done)}

    @classmethod
    def from_annotations(cls, annotations: dict[str, str] | None) -> GangRecord | None:
        """Decode; None when absent or malformed."""
        if not annotations or ATTEMPT_KEY not in annotations:
            return None
        try:
            return cls(attempt=int(annotations[ATTEMPT_KEY]),
                       steps_done=int(annotations.get(STEPS_DONE_KEY) or 0))
        except (ValidationError, ValueError):
            return None
