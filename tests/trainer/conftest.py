"""Fixtures of the trainer tests (shared with tests/xla)."""

from jobfixtures import make_job, sample_data, write_config

__all__ = ["make_job", "sample_data", "write_config"]
