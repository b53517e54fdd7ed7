"""The restart record of an in-place restart (`faultTolerance.restartStrategy: InPlace`).

Who writes: the operator, on the job's gang Lease (`labels.gang_lease_name`), when it moves the
kept pods to a new attempt. Who reads: every worker's launcher (`hlat-launch`), which polls it
(get only: the job's Role allows nothing else on it), stops its trainer when the attempt moves
on, and starts the next one with the record's values. `GangRecord.to_annotations` /
`from_annotations` are the only encoding.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ATTEMPT_KEY = "hlat.dev/attempt"
STEPS_DONE_KEY = "hlat.dev/steps-done"
RANKS_KEY = "hlat.dev/ranks"
MASTER_KEY = "hlat.dev/master-addr"
NODES_KEY = "hlat.dev/nodes"


class GangRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    attempt: int = Field(ge=0)
    """The attempt every trainer of the job must run now."""
    steps_done: int = Field(default=0, ge=0)
    """The highest step an earlier attempt's node rank 0 reported (HLAT_STEPS_DONE)."""
    ranks: dict[str, int] = Field(default_factory=dict)
    """Node rank per pod name, for pods whose rank is not the one they were created with (a
    spare that took over a lost node's rank); a launcher not named here keeps its own."""
    master_addr: str | None = None
    """Node rank 0's address when it is not the one the pods were created with (a spare took
    over rank 0); None: HLAT_MASTER_ADDR."""
    nodes: int | None = Field(default=None, ge=1)
    """How many nodes the attempt runs on (an elastic job resized in place: its kept pods were
    created at another size); None: HLAT_NNODES."""

    def to_annotations(self) -> dict[str, str]:
        out = {ATTEMPT_KEY: str(self.attempt), STEPS_DONE_KEY: str(self.steps_done),
               RANKS_KEY: json.dumps(self.ranks, sort_keys=True, separators=(",", ":"))}
        if self.master_addr:
            out[MASTER_KEY] = self.master_addr
        if self.nodes is not None:
            out[NODES_KEY] = str(self.nodes)
        return out

    @classmethod
    def from_annotations(cls, annotations: dict[str, str] | None) -> GangRecord | None:
        """Decode; None when absent or malformed."""
        if not annotations or ATTEMPT_KEY not in annotations:
            return None
        try:
            return cls(attempt=int(annotations[ATTEMPT_KEY]),
                       steps_done=int(annotations.get(STEPS_DONE_KEY) or 0),
                       ranks=json.loads(annotations.get(RANKS_KEY) or "{}"),
                       master_addr=annotations.get(MASTER_KEY) or None,
                       nodes=int(annotations[NODES_KEY]) if annotations.get(NODES_KEY)
                       else None)
        except (ValidationError, ValueError):
            return None
