"""The spec's one error type, shared by every module that validates part of a spec; how an
error is named in one log line (the trainer's and the operator's API calls alike)."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec that cannot run; `field` is the camelCase path, e.g. `parallelism.tensor`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field
        self.reason = message


def first_line(err: BaseException, limit: int = 300) -> str:
    """An error's first line for a log message, at most `limit` characters: its repr when its
    message is empty (a dropped connection can raise one without text, and logging the error
    must never raise in its place); `HTTP 403 Forbidden` for the Kubernetes client's errors
    (whose first line is just the status)."""
    status, reason = getattr(err, "status", None), getattr(err, "reason", None)
    if isinstance(status, int) and isinstance(reason, str):  # the Kubernetes client's errors
        return f"HTTP {status} {reason}"[:limit]
    lines = str(err).splitlines()
    return (lines[0] if lines and lines[0].strip() else repr(err))[:limit]
