"""Fixtures of the trainer tests (shared with tests/xla)."""

from jobfixtures import held_out_data, make_job, sample_data, write_config

__all__ = ["held_out_data", "make_job", "sample_data", "write_config"]
