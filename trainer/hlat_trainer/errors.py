"""Errors the user can fix.

A `UserError` carries a message that names the field or file at fault and says what to do.
The CLI prints it without a traceback and exits with `hlat_api.ExitCode.CONFIG_ERROR`, which
the operator treats as permanent (restarting the gang cannot fix a bad config or dataset).
"""

from hlat_api.errors import first_line

__all__ = ["UserError", "first_line"]


class UserError(Exception):
    """Bad input: a config value, a data file, a tokenizer, or a checkpoint the user pointed at."""
