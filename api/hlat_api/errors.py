"""The spec's one error type, shared by every module that validates part of a spec."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec that cannot run; `field` is the camelCase path, e.g. `parallelism.tensor`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field
        self.reason = message
